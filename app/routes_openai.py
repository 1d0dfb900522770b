"""The OpenAI-compatible HTTP routes: models, completions, chat completions, tokenize."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from app.auth import identity_for, session_header, tenant_for_key
from app.openapi import operation
from app.server import ServerState
from compat.chat_template import render_chat_prompt
from compat.engine_mapping import check_token_ids
from compat.errors import ApiError
from compat.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode_chat_completion_request,
    decode_completion_request,
    decode_detokenize_request,
    decode_tokenize_request,
)
from compat.response_types import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    Model,
    ModelList,
    TokenizeResponse,
)
from compat.sse import SSE_DONE, sse_event
from compat.unknown_fields import UnknownFields

JSON = "application/json"
T = TypeVar("T")


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _json(payload: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type=JSON)


def _authorize(request: Request) -> str | None:
    """The tenant named by the request's API key (None when auth is off); 401 otherwise."""
    return tenant_for_key(_state(request).settings.api_keys, request.headers.get("authorization"))


def _unknown_fields(request: Request) -> UnknownFields:
    return _state(request).settings.UNKNOWN_FIELDS


def _session_id(request: Request) -> str | None:
    return session_header(request.headers.get("x-session-id"))


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client hangs up first: cancelling aborts its
    sequences, so their KV blocks are freed instead of generating for nobody."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_client_disconnected(request))
    try:
        await asyncio.wait((task, hangup), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let its clean-up (aborting the sequences) finish
    if task.cancelled():
        # Nobody reads this answer; 499 is the customary status for "client closed request".
        raise ApiError("The client closed the request.", status=499, code="client_closed_request")
    return task.result()


async def _client_disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(chunks: AsyncIterator[object]) -> AsyncIterator[bytes]:
    """SSE frames of the chunks, then [DONE]. A failure after the 200 went out (the engine
    failed mid-generation) becomes an error event, which OpenAI clients raise as an error."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except ApiError as exc:
        yield sse_event(exc.body())
    yield SSE_DONE


def _sse_response(chunks: AsyncIterator[object]) -> Stream:
    return Stream(
        _sse(chunks),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@get("/v1/models", operation_class=operation(ModelList))
async def list_models(request: Request) -> Response:
    _authorize(request)
    state = _state(request)
    model = Model(
        id=state.model_id,
        created=state.created,
        owned_by="gemma-serve",
        max_model_len=state.service.max_model_len,
    )
    return _json(ModelList(data=[model]))


@get("/v1/models/{model_id:path}", operation_class=operation(Model))
async def retrieve_model(request: Request, model_id: str) -> Response:
    _authorize(request)
    state = _state(request)
    state.service.check_model(model_id.lstrip("/"))
    return _json(
        Model(
            id=state.model_id, created=state.created, owned_by="gemma-serve",
            max_model_len=state.service.max_model_len,
        )
    )  # fmt: skip


@post(
    "/v1/completions",
    status_code=200,
    operation_class=operation(Completion, CompletionRequest, streams=True),
)
async def completions(request: Request) -> Response | Stream:
    state = _state(request)
    key_tenant = _authorize(request)
    req = decode_completion_request(await request.body(), _unknown_fields(request))
    identity = identity_for(key_tenant, req.user, _session_id(request))
    if req.is_stream:
        return _sse_response(await state.service.completion_stream(req, identity))
    return _json(await _until_disconnect(request, state.service.completion(req, identity)))


@post(
    "/v1/chat/completions",
    status_code=200,
    operation_class=operation(ChatCompletion, ChatCompletionRequest, streams=True),
)
async def chat_completions(request: Request) -> Response | Stream:
    state = _state(request)
    key_tenant = _authorize(request)
    req = decode_chat_completion_request(await request.body(), _unknown_fields(request))
    identity = identity_for(key_tenant, req.user, _session_id(request), pin_session=True)
    if req.is_stream:
        return _sse_response(await state.service.chat_stream(req, identity))
    return _json(await _until_disconnect(request, state.service.chat(req, identity)))


@post("/tokenize", status_code=200, operation_class=operation(TokenizeResponse, TokenizeRequest))
async def tokenize(request: Request) -> Response:
    _authorize(request)
    service = _state(request).service
    req = decode_tokenize_request(await request.body(), _unknown_fields(request))
    if req.model is not None:
        service.check_model(req.model)
    if req.messages is not None:
        text = render_chat_prompt(
            req.messages, service.tokenizer, add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.chat_template_kwargs,
        )  # fmt: skip
    else:
        text = req.prompt or ""
    ids = service.tokenizer(text, add_special_tokens=req.add_special_tokens).input_ids
    response = TokenizeResponse(count=len(ids), max_model_len=service.max_model_len, tokens=ids)
    if req.return_token_strs:
        token_strs = service.tokenizer.convert_ids_to_tokens(ids)
        assert isinstance(token_strs, list)  # a list of ids gives a list of tokens
        response.token_strs = token_strs
    return _json(response)


@post(
    "/detokenize",
    status_code=200,
    operation_class=operation(DetokenizeResponse, DetokenizeRequest),
)
async def detokenize(request: Request) -> Response:
    _authorize(request)
    service = _state(request).service
    req = decode_detokenize_request(await request.body(), _unknown_fields(request))
    if req.model is not None:
        service.check_model(req.model)
    check_token_ids(req.tokens, service.vocab_size, "tokens")
    return _json(DetokenizeResponse(prompt=service.decode(req.tokens)))


ROUTES = [list_models, retrieve_model, completions, chat_completions, tokenize, detokenize]
