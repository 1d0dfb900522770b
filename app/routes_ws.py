"""`WS /v1/ws`: streaming generations, multi-turn sessions and cancellation over one socket.

Every frame is one JSON object with a "type". The client sends `generate` (a chat or
completions body, validated exactly as over HTTP; streaming is implied), `cancel`, `auth`,
`session.start` and `session.end`; the server answers with `ready`, `delta`, `done`, `error`,
`session.started` and `session.ended`. Each generation runs in its own task, so several run at
once; sends are serialized. A session keeps a chat's history on the server: each turn sends
only its new messages, and since the next prompt extends the last prompt + reply, the prefix
cache serves everything but the new text. Closing the socket aborts its generations, which
frees their KV blocks. The protocol is documented in the README ("WebSocket API").
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import structlog
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect
from msgspec import UNSET, UnsetType

from app.auth import identity_for, tenant_for_key
from app.generation import ChoiceState, GenerationService, Identity, usage_of
from app.server import ServerState
from compat.errors import ApiError, ErrorDetail, invalid_value, server_error, too_deeply_nested
from compat.limits import MAX_IDENTIFIER_LENGTH
from compat.logprobs import chat_logprobs, completion_logprobs
from compat.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_completion_request,
    decode_completion_request,
)
from compat.response_types import ChatLogprobs, CompletionLogprobs, Usage
from engine.async_engine import RequestStream
from engine.kv.eviction import EVICTION_POLICIES

log = structlog.get_logger(__name__)

CLOSE_UNAUTHORIZED = 4401  # application close code (4000-4999), mirrors HTTP 401
AUTH_TIMEOUT_S = 10.0  # how long a socket that needs a key waits for the `auth` message
MAX_SESSIONS_PER_SOCKET = 64  # each holds a chat history in server memory
# Envelope fields of a `generate` message; everything else is the request body.
_ENVELOPE = ("type", "id", "endpoint", "session")
# Names echoed in every event of their generation or session, and logged: bounded like `user`.
_NAMES = ("id", "session")


# --- server -> client ------------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", tag_field="type"):
    """The socket may be used: sent after the handshake, or after a valid `auth` message."""

    connection_id: str  # the session id the engine sees for this socket's requests
    model: str
    max_message_bytes: int


class Delta(msgspec.Struct, tag="delta", tag_field="type"):
    id: str
    choice: int
    text: str
    logprobs: ChatLogprobs | CompletionLogprobs | UnsetType = UNSET  # only when asked for


class Done(msgspec.Struct, tag="done", tag_field="type"):
    id: str
    finish_reason: str  # choice 0's: "stop", "length" or "abort" (cancelled)
    finish_reasons: list[str]  # one per choice
    usage: Usage
    session: str | UnsetType = UNSET


class Error(msgspec.Struct, tag="error", tag_field="type"):
    id: str | None  # the message's id when it had one
    error: ErrorDetail
    retry_after: int | UnsetType = UNSET  # seconds, on rate_limit_exceeded


class SessionStarted(msgspec.Struct, tag="session.started", tag_field="type"):
    session: str


class SessionEnded(msgspec.Struct, tag="session.ended", tag_field="type"):
    session: str


_encoder = msgspec.json.Encoder()


def error_event(exc: ApiError, message_id: str | None) -> Error:
    """An OpenAI-shaped error for the client; a 429 also says when to retry."""
    retry_after = exc.headers.get("Retry-After")
    return Error(
        id=message_id,
        error=exc.body().error,
        retry_after=int(retry_after) if retry_after else UNSET,
    )


# --- protocol errors -----------------------------------------------------------------------


def _unauthorized(message: str, code: str) -> ApiError:
    return ApiError(message, status=401, code=code)


def _missing(param: str) -> ApiError:
    return ApiError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _not_found(param: str, message: str) -> ApiError:
    return ApiError(message, status=404, param=param, code="not_found")


def _conflict(param: str, message: str, code: str) -> ApiError:
    return ApiError(message, status=409, param=param, code=code)


def _optional_string_field(message: dict[str, Any], name: str) -> str | None:
    value = message.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(
            f"Invalid type for '{name}': expected a non-empty string.",
            param=name,
            code="invalid_type",
        )
    if name in _NAMES and len(value) > MAX_IDENTIFIER_LENGTH:
        limit = MAX_IDENTIFIER_LENGTH
        raise invalid_value(
            name, f"Invalid value for '{name}': expected string of length <= {limit}."
        )
    return value


def _string_field(message: dict[str, Any], name: str) -> str:
    value = _optional_string_field(message, name)
    if value is None:
        raise _missing(name)
    return value


# --- per-socket state ----------------------------------------------------------------------


@dataclass
class ChatSession:
    """A conversation kept on the server: the messages of every completed turn."""

    name: str
    history: list[dict[str, Any]] = field(default_factory=list)
    busy: bool = False  # a turn is in flight; turns of one conversation are sequential
    eviction_policy: str | None = None  # this session's KV eviction; None: the server default
    kv_tokens: int | None = None  # its KV budget under that policy; None: the server default
    pinned_as: tuple[str, str] | None = None  # (tenant, key) its KV is pinned under


@dataclass
class Generation:
    id: str
    is_chat: bool
    request: ChatCompletionRequest | CompletionRequest
    streams: list[RequestStream]
    n: int
    echo_texts: list[str]  # per prompt, sent first when a completion asks for echo
    session: ChatSession | None = None
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    task: asyncio.Task | None = None


class _SocketGone(Exception):
    """The client went away while we were sending."""


class WsConnection:
    """One client socket: authentication, the receive loop and its generations."""

    def __init__(self, socket: WebSocket, state: ServerState) -> None:
        self.socket = socket
        self.state = state
        self.service: GenerationService = state.service
        self.max_message_bytes = state.settings.MAX_BODY_BYTES
        self.connection_id = f"ws-{secrets.token_hex(8)}"
        self.key_tenant: str | None = None
        self.generations: dict[str, Generation] = {}
        self.sessions: dict[str, ChatSession] = {}
        self._send_lock = asyncio.Lock()
        self._gone = False

    # ------------------------------------------------------------------ sending

    async def send(self, event: msgspec.Struct) -> None:
        """Send one event; frames from concurrent generations never interleave."""
        if self._gone:
            raise _SocketGone
        data = _encoder.encode(event).decode()
        async with self._send_lock:
            try:
                await self.socket.send_text(data)
            except Exception:  # disconnected: the receive loop cleans up
                self._gone = True
                raise _SocketGone from None

    # ------------------------------------------------------------------ receiving

    async def receive_frame(self) -> str | bytes | None:
        """The next text or binary frame; None once the client has gone."""
        try:
            event = await self.socket.receive()
        except WebSocketDisconnect:
            return None
        if event["type"] != "websocket.receive":
            return None
        text = event.get("text")
        return text if text is not None else event.get("bytes") or b""

    def parse(self, frame: str | bytes) -> dict[str, Any]:
        """A frame -> a JSON object; ApiError on anything else."""
        size = len(frame.encode() if isinstance(frame, str) else frame)
        if size > self.max_message_bytes:
            raise ApiError(
                f"The message is {size} bytes, larger than the limit of "
                f"{self.max_message_bytes} bytes.",
                status=413,
                code="request_too_large",
            )
        try:
            message = msgspec.json.decode(frame)
        except msgspec.DecodeError as exc:
            raise ApiError(
                f"We could not parse the message as JSON: {exc}", code="invalid_json"
            ) from None
        except RecursionError:
            raise too_deeply_nested("the message as JSON") from None
        if not isinstance(message, dict):
            raise ApiError("A message must be a JSON object with a 'type'.", code="invalid_type")
        return message

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(connection_id=self.connection_id, path="/v1/ws")
        await self.socket.accept()
        try:
            if not await self.authenticate():
                return
            await self.send(self.ready())
            while (frame := await self.receive_frame()) is not None:
                await self.handle(frame)
        except _SocketGone:
            pass
        finally:
            await self.abort_all()
            for session in self.sessions.values():
                self._unpin(session)

    def ready(self) -> Ready:
        return Ready(
            connection_id=self.connection_id,
            model=self.service.model_id,
            max_message_bytes=self.max_message_bytes,
        )

    async def authenticate(self) -> bool:
        """With API_KEYS set: the handshake's `Authorization: Bearer` header, else a first
        {"type": "auth", "api_key": ...} message. A refusal is an error event, then close 4401."""
        keys = self.state.settings.api_keys
        if not keys:
            return True
        try:
            header = self.socket.headers.get("authorization")
            if header is not None:
                self.key_tenant = tenant_for_key(keys, header)
                return True
            try:
                frame = await asyncio.wait_for(self.receive_frame(), AUTH_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise _unauthorized(
                    f"No 'auth' message within {AUTH_TIMEOUT_S:g} seconds.", "missing_api_key"
                ) from None
            if frame is None:
                return False
            message = self.parse(frame)
            if message.get("type") != "auth":
                raise _unauthorized(
                    'Authenticate first: send {"type": "auth", "api_key": KEY} as the '
                    "first message, or the Authorization: Bearer header on the handshake.",
                    "missing_api_key",
                )
            api_key = _string_field(message, "api_key")
            self.key_tenant = tenant_for_key(keys, f"Bearer {api_key}")
            return True
        except ApiError as exc:
            if exc.status != 401:  # a malformed first message is still a missing key
                exc = _unauthorized(exc.message, "missing_api_key")
            await self.send(error_event(exc, None))
            await self.socket.close(CLOSE_UNAUTHORIZED, "unauthorized")
            return False

    async def abort_all(self) -> None:
        """The client went away: abort every generation (their blocks are freed)."""
        tasks = []
        for generation in list(self.generations.values()):
            for stream in generation.streams:
                stream.abort()
            if generation.task is not None:
                generation.task.cancel()
                tasks.append(generation.task)
        self.generations.clear()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ dispatch

    async def handle(self, frame: str | bytes) -> None:
        """One client message. Every refusal is an error event; the socket stays usable."""
        message_id = None
        try:
            message = self.parse(frame)
            if isinstance(message.get("id"), str) and len(message["id"]) <= MAX_IDENTIFIER_LENGTH:
                message_id = message["id"]
            kind = _string_field(message, "type")
            if kind == "generate":
                self.start_generation(message)
            elif kind == "cancel":
                self.cancel(message)
            elif kind == "session.start":
                await self.send(self.start_session(message))
            elif kind == "session.end":
                await self.send(self.end_session(message))
            elif kind == "auth":
                if self.state.settings.api_keys:
                    raise _conflict("type", "This socket is already authenticated.",
                                    "already_authenticated")  # fmt: skip
                await self.send(self.ready())  # no keys: nothing to check
            else:
                raise invalid_value(
                    "type",
                    f"Unknown message type {kind!r}; expected one of 'generate', 'cancel', "
                    "'session.start', 'session.end', 'auth'.",
                )
        except ApiError as exc:
            # A duplicate id is the running generation's: an error carrying it would read as
            # that generation's end.
            await self.send(error_event(exc, None if exc.code == "duplicate_id" else message_id))
        except _SocketGone:
            raise
        except Exception:  # a bug: report it, keep serving the socket
            log.exception("websocket message failed")
            await self.send(error_event(server_error(), message_id))

    # ------------------------------------------------------------------ sessions

    def start_session(self, message: dict[str, Any]) -> SessionStarted:
        name = _optional_string_field(message, "session") or f"sess-{secrets.token_hex(6)}"
        if name in self.sessions:
            raise _conflict("session", f"Session {name!r} already exists.", "session_exists")
        if len(self.sessions) >= MAX_SESSIONS_PER_SOCKET:
            raise invalid_value(
                "session",
                f"A socket holds at most {MAX_SESSIONS_PER_SOCKET} sessions; end one first.",
            )
        policy = _optional_string_field(message, "eviction_policy")
        if policy is not None and policy not in EVICTION_POLICIES:
            raise invalid_value(
                "eviction_policy",
                f"'eviction_policy' must be one of {', '.join(EVICTION_POLICIES)}.",
            )
        kv_tokens = message.get("kv_tokens")
        if kv_tokens is not None and (type(kv_tokens) is not int or kv_tokens < 1):
            raise invalid_value("kv_tokens", "'kv_tokens' must be a positive integer.")
        self.sessions[name] = ChatSession(name, eviction_policy=policy, kv_tokens=kv_tokens)
        return SessionStarted(session=name)

    def end_session(self, message: dict[str, Any]) -> SessionEnded:
        """Forget the history; a turn still in flight finishes without being recorded."""
        name = _string_field(message, "session")
        session = self.sessions.pop(name, None)
        if session is None:
            raise _not_found("session", f"No session {name!r} on this socket.")
        self._unpin(session)
        return SessionEnded(session=name)

    def _unpin(self, session: ChatSession) -> None:
        """The session's pinned KV goes back to the prefix cache (reclaimable)."""
        if session.pinned_as is not None:
            self.state.engine.end_session(*session.pinned_as)
            session.pinned_as = None

    # ------------------------------------------------------------------ generations

    def cancel(self, message: dict[str, Any]) -> None:
        """Abort a generation; its task then sends `done` with finish_reason "abort"."""
        generation_id = _string_field(message, "id")
        generation = self.generations.get(generation_id)
        if generation is None:
            raise _not_found("id", f"No generation {generation_id!r} is in flight.")
        for stream in generation.streams:
            stream.abort()

    def start_generation(self, message: dict[str, Any]) -> None:
        """Validate and admit at once (refusals raise here), then stream from a task."""
        generation_id = _string_field(message, "id")
        if generation_id in self.generations:
            raise _conflict("id", f"A generation with id {generation_id!r} is already in "
                            "flight.", "duplicate_id")  # fmt: skip
        session = self._session_for(message)
        body = {k: v for k, v in message.items() if k not in _ENVELOPE}
        body["stream"] = True  # implied; usage always comes with `done`
        is_chat = self._is_chat(message, body)
        new_messages: list[dict[str, Any]] = []
        if session is not None:
            if not is_chat:
                raise invalid_value("session", "A session holds a chat: send 'messages'.")
            if isinstance(body.get("messages"), list):
                new_messages = body["messages"]
                body["messages"] = session.history + new_messages
        req = decode_chat_completion_request(body) if is_chat else decode_completion_request(body)
        if session is not None and req.num_choices != 1:
            raise invalid_value("n", "A session turn has exactly one choice (n = 1).")
        generation = self._admit(generation_id, req, session)
        if session is not None:
            session.busy = True
            generation.session, generation.new_messages = session, new_messages
        self.generations[generation_id] = generation
        generation.task = asyncio.create_task(self.run(generation))

    def _session_for(self, message: dict[str, Any]) -> ChatSession | None:
        name = _optional_string_field(message, "session")
        if name is None:
            return None
        session = self.sessions.get(name)
        if session is None:
            raise _not_found("session", f"No session {name!r} on this socket; send "
                             "session.start first.")  # fmt: skip
        if session.busy:
            raise _conflict("session", f"Session {name!r} has a turn in flight.", "session_busy")
        return session

    @staticmethod
    def _is_chat(message: dict[str, Any], body: dict[str, Any]) -> bool:
        endpoint = message.get("endpoint")
        if endpoint is None:
            if "messages" in body:
                return True
            if "prompt" in body:
                return False
            raise _missing("messages")
        if endpoint not in ("chat", "completions"):
            raise invalid_value("endpoint", "'endpoint' must be 'chat' or 'completions'.")
        return endpoint == "chat"

    def _admit(
        self,
        generation_id: str,
        req: ChatCompletionRequest | CompletionRequest,
        session: ChatSession | None = None,
    ) -> Generation:
        """Tokenize, check against the context, and submit every prompt x n choices."""
        service = self.service
        if isinstance(req, ChatCompletionRequest):
            is_chat, prompts, echo_texts = True, [service.prepare_chat(req)], [""]
        else:
            is_chat, prompts = False, service.prepare_completion(req)
            echo_texts = [p.text if req.echo else "" for p in prompts]
        identity: Identity = identity_for(self.key_tenant, req.user, self.connection_id)
        if session is not None:  # its KV stays pinned between turns
            key = f"{self.connection_id}/{session.name}"
            identity = replace(identity, kv_session=key)
            if session.pinned_as not in (None, (identity.tenant, key)):
                self._unpin(session)  # the tenant changed (`user`): the old pin goes
            session.pinned_as = (identity.tenant, key)
        streams = service.submit(
            prompts, req.num_choices, identity, priority=req.priority or 0,
            cache_salt=req.cache_salt,
            eviction_policy=session.eviction_policy if session else None,
            kv_tokens=session.kv_tokens if session else None,
        )  # fmt: skip
        return Generation(generation_id, is_chat, req, streams, req.num_choices, echo_texts)

    async def run(self, generation: Generation) -> None:
        """Stream one generation, then send `done` (or `error`)."""
        try:
            event: Done | Error = await self._stream(generation)
        except _SocketGone:
            return
        except ApiError as exc:  # the engine failed mid-generation
            event = error_event(exc, generation.id)
        except Exception:
            log.exception("websocket generation failed", generation_id=generation.id)
            event = error_event(server_error(), generation.id)
        finally:
            self._release(generation)  # before the last event: the client may reuse the id
        with contextlib.suppress(_SocketGone):
            await self.send(event)

    async def _stream(self, generation: Generation) -> Done:
        """Send the deltas; record a session turn; the `done` event to end with."""
        gid = generation.id
        choices = [ChoiceState(i) for i in range(len(generation.streams))]
        for i in range(len(choices)):
            if echo := generation.echo_texts[i // generation.n]:
                await self.send(Delta(id=gid, choice=i, text=echo))
        async for index, out in self.service.merged(generation.streams):
            offsets = choices[index].add(out)
            logprobs = self._logprobs(generation, out.logprobs or [], offsets)
            if out.new_text or logprobs is not UNSET:
                await self.send(Delta(id=gid, choice=index, text=out.new_text,
                                      logprobs=logprobs))  # fmt: skip
        reasons = [c.finish_reason.value if c.finish_reason else "stop" for c in choices]
        session = generation.session
        if session is not None and reasons[0] != "abort":
            reply = {"role": "assistant", "content": "".join(choices[0].text)}
            session.history += [*generation.new_messages, reply]
        return Done(
            id=gid, finish_reason=reasons[0], finish_reasons=reasons,
            usage=usage_of(choices, generation.n),
            session=session.name if session is not None else UNSET,
        )  # fmt: skip

    def _release(self, generation: Generation) -> None:
        if self.generations.get(generation.id) is generation:
            del self.generations[generation.id]
        if generation.session is not None:
            generation.session.busy = False

    def _logprobs(
        self, generation: Generation, entries: list, offsets: list[int]
    ) -> ChatLogprobs | CompletionLogprobs | UnsetType:
        req = generation.request
        if generation.is_chat:
            if not req.logprobs:
                return UNSET
            return chat_logprobs(entries, self.service.token_text, self.service.token_bytes)
        if req.logprobs is None:
            return UNSET
        return completion_logprobs(entries, self.service.token_text, offsets)


@websocket("/v1/ws")
async def ws_endpoint(socket: WebSocket) -> None:
    await WsConnection(socket, socket.app.state.server).serve()


ROUTES = [ws_endpoint]
