"""ASGI middlewares that Ray Serve's HTTP proxy runs before it routes a request (no Ray here).

Ray Serve installs them when RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names
`deploy.proxy:proxy_middlewares` in the proxy's environment (deploy/ray_serve.py sets it).

- RouteKeysMiddleware gives the router what it cannot see: the proxy routes a request before
  reading its body, so this reads the body of a generation request first (it is replayed to
  the proxy unchanged) and stores the request's RouteKeys in its scope.
- ReplicaFailureMiddleware answers what a replica's death leaves unanswered the way the single
  server answers its own failures. The proxy cuts a stream whose replica died (the client sees
  an incomplete chunked body) and returns from a request whose replica died before answering
  without any response (uvicorn then sends a plain-text 500): the stream gets an OpenAI error
  event and `data: [DONE]`, the request an OpenAI-shaped 500. The proxy's own plain-text
  errors (a 503 when no replica is up) get an OpenAI error body with the same status.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from compat.errors import ApiError
from compat.sse import SSE_DONE, sse_event
from deploy.routing import ROUTE_SCOPE_KEY, route_keys

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SESSION_HEADER = b"x-session-id"
_READ_BODY = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
MAX_BODY_BYTES = 1_000_000  # the server's default: a larger body routes on its headers alone
REPLICA_FAILED = "The replica serving this request failed before finishing it; retry it."


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class RouteKeysMiddleware:
    """Stores each HTTP request's and WebSocket handshake's RouteKeys in its scope under
    ROUTE_SCOPE_KEY; for POST generation requests, read from the body too (at most
    `max_body_bytes`: a larger body routes on its headers alone, and the replica answers 413)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        body: bytes | None = None
        if scope["type"] == "http" and (scope["method"], scope["path"]) in _READ_BODY:
            received, body = await self._read_body(receive)
            receive = _replay(received, receive)
        scope = {**scope, ROUTE_SCOPE_KEY: route_keys(_header(scope, SESSION_HEADER), body)}
        await self.app(scope, receive, send)

    async def _read_body(self, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The messages read, and the body (None when over the limit or cut short)."""
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                return received, None  # the client went away
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return received, None
            if not message.get("more_body"):
                return received, b"".join(m.get("body", b"") for m in received)


def _replay(received: list[Message], receive: Receive) -> Receive:
    pending = list(received)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


class ReplicaFailureMiddleware:
    """Ends the responses a dead replica left unfinished (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        guard = _ResponseGuard(send)
        try:
            await self.app(scope, receive, guard.send)
        except Exception:
            await guard.finish()  # the client gets its answer; uvicorn still logs the error
            raise
        await guard.finish()


class _ResponseGuard:
    def __init__(self, send: Send) -> None:
        self._send = send
        self._started = False
        self._stream = False  # an SSE response...
        self._open = False  # ...whose last body part has not been sent
        self._plain_error: Message | None = None  # the proxy's own 5xx start, held back
        self._text: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._started = True
            headers = dict(message.get("headers", ()))
            media_type = headers.get(b"content-type", b"")
            if message["status"] >= 500 and not media_type.startswith(b"application/json"):
                self._plain_error = message  # sent once its text is in
                return
            self._stream = media_type.startswith(b"text/event-stream")
            self._open = True
        elif message["type"] == "http.response.body":
            if self._plain_error is not None:
                self._text.append(message.get("body", b""))
                if not message.get("more_body"):
                    await self._send_error(self._plain_error, b"".join(self._text))
                return
            self._open = bool(message.get("more_body"))
        await self._send(message)

    async def _send_error(self, start: Message, text: bytes) -> None:
        status = start["status"]
        message = REPLICA_FAILED if status == 500 else text.decode(errors="replace").strip()
        code = "internal_error" if status == 500 else None
        body = msgspec.json.encode(ApiError(message, status=status, code=code).body())
        headers = [
            (k, v)
            for k, v in start.get("headers", ())
            if k not in (b"content-type", b"content-length")
        ]
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})

    async def finish(self) -> None:
        """After the proxy returned: answer a request it did not, end a stream it left open."""
        if not self._started:
            await self._send_error({"type": "http.response.start", "status": 500}, b"")
        elif self._stream and self._open:
            error = ApiError(REPLICA_FAILED, status=500, code="internal_error")
            body = sse_event(error.body()) + SSE_DONE
            await self._send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list[Any]:
    """The hook Ray Serve's proxy calls for its middlewares. Starlette is imported here, in the
    proxy, where Ray Serve has installed it."""
    from starlette.middleware import Middleware

    limit = int(os.environ.get("MAX_BODY_BYTES") or MAX_BODY_BYTES)  # the replicas' setting
    return [
        Middleware(RouteKeysMiddleware, max_body_bytes=limit),
        Middleware(ReplicaFailureMiddleware),
    ]
