"""OpenAI's Responses API: create (plain or streamed), retrieve, delete, list input items.

A streamed response is Server-Sent Events, each `event: <type>` then `data: <json>`, as OpenAI
sends them (no closing [DONE]). The service (app.responses_service) admits before the 200 goes
out, so a refused request is an OpenAI-shaped 4xx, never a broken stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import Parameter
from litestar.response import Stream

from app.auth import identity_for, session_header
from app.openapi import operation
from app.responses_service import ResponsesService, response_not_found
from app.routes_openai import _authorize, _json, _state, _unknown_fields, _until_disconnect
from compat.errors import invalid_value
from compat.responses_input import decode_create_response
from compat.responses_types import (
    CreateResponseRequest,
    DeletedResponse,
    InputItemList,
    StreamEvent,
    event_type,
)
from compat.responses_types import (
    Response as ResponseObject,
)
from engine.request import DEFAULT_TENANT

_encoder = msgspec.json.Encoder()


def _service(request: Request) -> ResponsesService:
    return _state(request).responses


def _tenant(request: Request) -> str:
    """Who owns stored responses: the key's tenant, else the default one (a GET carries no
    `user`; without keys, every caller is that tenant unless it names a `user`)."""
    return _authorize(request) or request.query_params.get("user") or DEFAULT_TENANT


async def _sse(events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
    async for event in events:
        name = event_type(event).encode()
        yield b"event: " + name + b"\ndata: " + _encoder.encode(event) + b"\n\n"


@post(
    "/v1/responses",
    status_code=200,
    operation_class=operation(ResponseObject, CreateResponseRequest, streams=True),
)
async def create_response(request: Request) -> Response | Stream:
    key_tenant = _authorize(request)
    req = decode_create_response(await request.body(), _unknown_fields(request))
    session = session_header(request.headers.get("x-session-id"))
    identity = identity_for(key_tenant, req.user, session)
    service = _service(request)
    run = await service.start(req, identity)
    if req.stream:
        return Stream(
            _sse(service.stream(run)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return _json(await _until_disconnect(request, service.create(run)))


ResponseId = Annotated[str, Parameter(max_length=256)]


@get("/v1/responses/{response_id:str}", operation_class=operation(ResponseObject))
async def retrieve_response(request: Request, response_id: ResponseId) -> Response:
    record = _service(request).retrieve(_tenant(request), response_id)
    return _json(record.response)


@delete(
    "/v1/responses/{response_id:str}", status_code=200, operation_class=operation(DeletedResponse)
)
async def delete_response(request: Request, response_id: ResponseId) -> Response:
    service = _service(request)
    if not service.store.delete(_tenant(request), response_id):
        raise response_not_found(response_id)
    return _json(DeletedResponse(id=response_id))


@get("/v1/responses/{response_id:str}/input_items", operation_class=operation(InputItemList))
async def list_input_items(
    request: Request,
    response_id: ResponseId,
    limit: Annotated[int, Parameter(ge=1, le=100)] = 20,
    order: Annotated[str, Parameter(pattern="^(asc|desc)$")] = "desc",
    after: Annotated[str | None, Parameter(max_length=256)] = None,
) -> Response:
    items = list(_service(request).retrieve(_tenant(request), response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid_value("after", f"No input item with id {after!r} in this response.")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return _json(
        InputItemList(
            data=page,
            has_more=len(items) > limit,
            first_id=str(page[0]["id"]) if page else None,
            last_id=str(page[-1]["id"]) if page else None,
        )
    )


ROUTES = [create_response, retrieve_response, delete_response, list_input_items]
