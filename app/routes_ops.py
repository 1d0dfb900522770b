"""Operational routes: liveness, readiness, Prometheus metrics, the dashboard's JSON snapshot.

/health answers 200 while the engine takes work and 503 from the start of a drain, so load
balancers (and a readiness probe) stop sending; /live stays 200 while the server drains, so an
orchestrator's liveness probe does not restart a process that is finishing its requests. Both
are always open; the metrics need a key with OPS_AUTH=keys.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Schema
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.auth import require_ops_key
from app.openapi import json_object_operation, operation
from app.server import ServerState


def _status_schema(*statuses: str) -> Schema:
    return Schema(
        type=OpenAPIType.OBJECT,
        properties={"status": Schema(type=OpenAPIType.STRING, enum=list(statuses))},
        required=["status"],
    )


def _unavailable(description: str, schema: Schema) -> dict[str, OpenAPIResponse]:
    return {
        "503": OpenAPIResponse(
            description=description, content={"application/json": OpenAPIMediaType(schema=schema)}
        )
    }


_HEALTH = _status_schema("ok", "draining", "unavailable")
_LIVE = _status_schema("ok", "unavailable")


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _status(status: str, code: int) -> Response:
    return Response(
        msgspec.json.encode({"status": status}), status_code=code, media_type="application/json"
    )


@get(
    "/health",
    operation_class=operation(
        _HEALTH, extra=_unavailable("Draining for shutdown, or the engine has stopped.", _HEALTH)
    ),
)
async def health(request: Request) -> Response:
    """Readiness: the engine takes work."""
    engine = _state(request).engine
    if engine.is_ready:
        return _status("ok", 200)
    return _status("draining" if engine.is_alive else "unavailable", 503)


@get(
    "/live",
    operation_class=operation(_LIVE, extra=_unavailable("The engine loop has stopped.", _LIVE)),
)
async def live(request: Request) -> Response:
    """Liveness: the engine loop runs, draining included."""
    if _state(request).engine.is_alive:
        return _status("ok", 200)
    return _status("unavailable", 503)


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


ROUTES = [health, live, metrics, metrics_json]
