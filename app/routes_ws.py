"""`WS /v1/ws`: streaming generations, multi-turn sessions and cancellation over one socket.

Every frame is one JSON object with a "type". The client sends `generate` (a chat or
completions body, validated exactly as over HTTP; streaming is implied), `cancel`, `auth`,
`session.start` and `session.end`; the server answers with `ready`, `delta`, `done`, `error`,
`session.started` and `session.ended`. Each generation runs in its own task, so several run at
once; sends are serialized. A session keeps a chat's history on the server: each turn sends
only its new messages, and since the next prompt extends the last prompt + reply, the prefix
cache serves everything but the new text. Closing the socket aborts its generations, which
frees their KV blocks. The protocol is documented in docs/websocket.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import msgspec
import structlog
from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect
from msgspec import UNSET, Meta, UnsetType

from app.auth import identity_for, tenant_for_key
from app.generation import Admitted, GenerationService, Identity
from app.server import ServerState
from compat.errors import (
    ApiError,
    ErrorDetail,
    from_decode_error,
    invalid_value,
    server_error,
    too_deeply_nested,
)
from compat.formatters import (
    CompletionFormatter,
    openai_usage,
    tool_call_chunk,
    tool_call_response,
)
from compat.limits import MAX_IDENTIFIER_LENGTH
from compat.logprobs import chat_logprobs
from compat.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_completion_request,
    decode_completion_request,
)
from compat.response_types import ChatLogprobs, CompletionLogprobs, ToolCallChunk, Usage
from engine.events import FoldedGeneration, PromptScored, TextDelta, ToolCallDelta, fold
from engine.kv.eviction import EVICTION_POLICIES

log = structlog.get_logger(__name__)

CLOSE_UNAUTHORIZED = 4401  # application close code (4000-4999), mirrors HTTP 401
AUTH_TIMEOUT_S = 10.0  # how long a socket that needs a key waits for the `auth` message
MAX_SESSIONS_PER_SOCKET = 64  # each holds a chat history in server memory
# Envelope fields of a `generate` message; everything else is the request body.
_ENVELOPE = ("type", "id", "endpoint", "session")
# Names echoed in every event of their generation or session, and logged: bounded like `user`.
_NAMES = ("id", "session")


# --- client -> server ------------------------------------------------------------------------

Name = Annotated[str, Meta(min_length=1, max_length=MAX_IDENTIFIER_LENGTH)]


class Generate(msgspec.Struct, tag="generate", tag_field="type", kw_only=True):
    """Starts a generation; the frame's other fields are the chat or completions body."""

    id: Name
    endpoint: Literal["chat", "completions"] | None = None
    session: Name | None = None


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    id: Name


class Auth(msgspec.Struct, tag="auth", tag_field="type"):
    api_key: Annotated[str, Meta(min_length=1)]


class SessionStart(msgspec.Struct, tag="session.start", tag_field="type", kw_only=True):
    session: Name | None = None
    eviction_policy: str | None = None  # one of EVICTION_POLICIES (checked with its message)
    kv_tokens: Annotated[int, Meta(ge=1)] | None = None


class SessionEnd(msgspec.Struct, tag="session.end", tag_field="type"):
    session: Name


ClientFrame = Generate | Cancel | Auth | SessionStart | SessionEnd
_FRAME_TYPES = "'generate', 'cancel', 'session.start', 'session.end', 'auth'"


def decode_frame(message: dict[str, Any]) -> ClientFrame:
    """A client's JSON object -> its frame; ApiError (400) naming the field otherwise."""
    kind = message.get("type")
    if isinstance(kind, str) and kind not in ("generate", "cancel", "auth", "session.start",
                                              "session.end"):  # fmt: skip
        raise invalid_value(
            "type", f"Unknown message type {kind!r}; expected one of {_FRAME_TYPES}."
        )
    try:
        return msgspec.convert(message, ClientFrame)
    except msgspec.ValidationError as exc:
        raise from_decode_error(exc) from None


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
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET  # as in a chat chunk's delta


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
    admitted: Admitted
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
            auth = decode_frame(message)
            assert isinstance(auth, Auth)
            self.key_tenant = tenant_for_key(keys, f"Bearer {auth.api_key}")
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
            for stream in generation.admitted.streams:
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
            request = decode_frame(message)
            if isinstance(request, Generate):
                await self.start_generation(request, message)
            elif isinstance(request, Cancel):
                self.cancel(request)
            elif isinstance(request, SessionStart):
                await self.send(self.start_session(request))
            elif isinstance(request, SessionEnd):
                await self.send(self.end_session(request))
            else:
                if self.state.settings.api_keys:
                    raise _conflict("type", "This socket is already authenticated.",
                                    "already_authenticated")  # fmt: skip
                await self.send(self.ready())  # no keys: nothing to check
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

    def start_session(self, request: SessionStart) -> SessionStarted:
        name = request.session or f"sess-{secrets.token_hex(6)}"
        if name in self.sessions:
            raise _conflict("session", f"Session {name!r} already exists.", "session_exists")
        if len(self.sessions) >= MAX_SESSIONS_PER_SOCKET:
            raise invalid_value(
                "session",
                f"A socket holds at most {MAX_SESSIONS_PER_SOCKET} sessions; end one first.",
            )
        policy = request.eviction_policy
        if policy is not None and policy not in EVICTION_POLICIES:
            raise invalid_value(
                "eviction_policy",
                f"'eviction_policy' must be one of {', '.join(EVICTION_POLICIES)}.",
            )
        self.sessions[name] = ChatSession(name, eviction_policy=policy, kv_tokens=request.kv_tokens)
        return SessionStarted(session=name)

    def end_session(self, request: SessionEnd) -> SessionEnded:
        """Forget the history; a turn still in flight finishes without being recorded."""
        session = self.sessions.pop(request.session, None)
        if session is None:
            raise _not_found("session", f"No session {request.session!r} on this socket.")
        self._unpin(session)
        return SessionEnded(session=request.session)

    def _unpin(self, session: ChatSession) -> None:
        """The session's pinned KV goes back to the prefix cache (reclaimable)."""
        if session.pinned_as is not None:
            self.state.engine.end_session(*session.pinned_as)
            session.pinned_as = None

    # ------------------------------------------------------------------ generations

    def cancel(self, request: Cancel) -> None:
        """Abort a generation; its task then sends `done` with finish_reason "abort"."""
        generation = self.generations.get(request.id)
        if generation is None:
            raise _not_found("id", f"No generation {request.id!r} is in flight.")
        for stream in generation.admitted.streams:
            stream.abort()

    async def start_generation(self, request: Generate, message: dict[str, Any]) -> None:
        """Validate and admit at once (refusals raise here), then stream from a task."""
        if request.id in self.generations:
            raise _conflict("id", f"A generation with id {request.id!r} is already in "
                            "flight.", "duplicate_id")  # fmt: skip
        session = self._session_for(request.session)
        body = {k: v for k, v in message.items() if k not in _ENVELOPE}
        body["stream"] = True  # implied; usage always comes with `done`
        is_chat = self._is_chat(request.endpoint, body)
        new_messages: list[dict[str, Any]] = []
        if session is not None:
            if not is_chat:
                raise invalid_value("session", "A session holds a chat: send 'messages'.")
            if isinstance(body.get("messages"), list):
                new_messages = body["messages"]
                body["messages"] = session.history + new_messages
        unknown_fields = self.state.settings.UNKNOWN_FIELDS
        req = (
            decode_chat_completion_request(body, unknown_fields)
            if is_chat
            else decode_completion_request(body, unknown_fields)
        )
        if session is not None and req.num_choices != 1:
            raise invalid_value("n", "A session turn has exactly one choice (n = 1).")
        if session is not None:
            session.busy = True  # before admission awaits: no second turn slips in
        try:
            admitted = await self._admit(req, session)
        except BaseException:
            if session is not None:
                session.busy = False
            raise
        generation = Generation(request.id, is_chat, req, admitted, session, new_messages)
        self.generations[request.id] = generation
        generation.task = asyncio.create_task(self.run(generation))

    def _session_for(self, name: str | None) -> ChatSession | None:
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
    def _is_chat(endpoint: str | None, body: dict[str, Any]) -> bool:
        if endpoint is None:
            if "messages" in body:
                return True
            if "prompt" in body:
                return False
            raise _missing("messages")
        return endpoint == "chat"

    async def _admit(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        session: ChatSession | None = None,
    ) -> Admitted:
        """Tokenize, check against the context, and submit every prompt x n choices."""
        identity: Identity = identity_for(self.key_tenant, req.user, self.connection_id)
        if isinstance(req, CompletionRequest):
            return await self.service.start_completion(req, identity)
        if session is not None:  # its KV stays pinned between turns
            key = f"{self.connection_id}/{session.name}"
            identity = replace(identity, kv_session=key)
            if session.pinned_as not in (None, (identity.tenant, key)):
                self._unpin(session)  # the tenant changed (`user`): the old pin goes
            session.pinned_as = (identity.tenant, key)
        return await self.service.start_chat(
            req, identity,
            eviction_policy=session.eviction_policy if session else None,
            kv_tokens=session.kv_tokens if session else None,
        )  # fmt: skip

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
        events = []
        req = generation.request
        # A completion's logprobs as /v1/completions gives them (an echo's included).
        legacy = (
            None
            if isinstance(req, ChatCompletionRequest)
            else self.service.completion_formatter(req)
        )
        async for event in self.service.events(generation.admitted):
            events.append(event)
            if isinstance(event, PromptScored) and legacy is not None:
                legacy.chunk(event)  # kept for the echo, which comes next
            elif isinstance(event, TextDelta):
                logprobs = self._logprobs(generation, event, legacy)
                if event.text or logprobs is not UNSET:
                    await self.send(Delta(id=gid, choice=event.choice, text=event.text,
                                          logprobs=logprobs))  # fmt: skip
            elif isinstance(event, ToolCallDelta):
                await self.send(Delta(id=gid, choice=event.choice, text="",
                                      tool_calls=[tool_call_chunk(event)]))  # fmt: skip
        folded = fold(events, len(generation.admitted.streams))
        reasons = [c.finish_reason for c in folded.choices]
        session = generation.session
        if session is not None and reasons[0] != "abort":
            session.history += [*generation.new_messages, _reply_message(folded)]
        return Done(
            id=gid, finish_reason=reasons[0], finish_reasons=list(reasons),
            usage=openai_usage(folded.usage),
            session=session.name if session is not None else UNSET,
        )  # fmt: skip

    def _release(self, generation: Generation) -> None:
        if self.generations.get(generation.id) is generation:
            del self.generations[generation.id]
        if generation.session is not None:
            generation.session.busy = False

    def _logprobs(
        self, generation: Generation, event: TextDelta, legacy: CompletionFormatter | None
    ) -> ChatLogprobs | CompletionLogprobs | UnsetType:
        req = generation.request
        if isinstance(req, ChatCompletionRequest):
            if not req.logprobs:
                return UNSET
            return chat_logprobs(event.logprobs, self.service.token_text, self.service.token_bytes)
        assert legacy is not None  # a completion has its formatter
        chunk = legacy.chunk(event)
        logprobs = chunk.choices[0].logprobs if chunk is not None else None
        return UNSET if logprobs is None else logprobs


def _reply_message(folded: FoldedGeneration) -> dict[str, Any]:
    """The assistant message a session's history keeps for choice 0's reply."""
    reply = folded.choices[0]
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        message["tool_calls"] = [
            msgspec.to_builtins(tool_call_response(call)) for call in reply.tool_calls
        ]
    elif message["content"] is None:
        message["content"] = ""
    return message


@websocket("/v1/ws")
async def ws_endpoint(socket: WebSocket) -> None:
    await WsConnection(socket, socket.app.state.server).serve()


ROUTES = [ws_endpoint]
