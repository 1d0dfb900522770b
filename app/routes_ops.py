"""Operational routes: health, Prometheus metrics, the dashboard's JSON snapshot.

/health is always open (load balancers probe it); the metrics need a key with OPS_AUTH=keys.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Schema
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.auth import require_ops_key
from app.openapi import json_object_operation, operation
from app.server import ServerState

_HEALTH = Schema(
    type=OpenAPIType.OBJECT,
    properties={"status": Schema(type=OpenAPIType.STRING, enum=["ok", "unavailable"])},
    required=["status"],
)
_UNAVAILABLE = OpenAPIResponse(
    description="The engine is not serving.",
    content={"application/json": OpenAPIMediaType(schema=_HEALTH)},
)


def _state(request: Request) -> ServerState:
    return request.app.state.server


@get("/health", operation_class=operation(_HEALTH, extra={"503": _UNAVAILABLE}))
async def health(request: Request) -> Response:
    engine = _state(request).engine
    if engine.is_healthy:
        return Response(b'{"status":"ok"}', media_type="application/json")
    return Response(b'{"status":"unavailable"}', status_code=503, media_type="application/json")


@get(
    "/metrics",
    guards=[require_ops_key],
    operation_class=operation(
        Schema(type=OpenAPIType.STRING, description="Prometheus text format"),
        media_type="text/plain",
    ),
)
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.update_gauges(state.engine.gauges())
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@get(
    "/api/metrics",
    guards=[require_ops_key],
    operation_class=json_object_operation("The engine's snapshot, as the dashboard reads it."),
)
async def metrics_json(request: Request) -> Response:
    state = _state(request)
    snapshot = state.engine.snapshot()
    snapshot["model"] = state.model_id
    return Response(msgspec.json.encode(snapshot), media_type="application/json")


ROUTES = [health, metrics, metrics_json]
