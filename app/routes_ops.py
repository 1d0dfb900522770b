"""Operational routes: health, Prometheus metrics, the dashboard's JSON snapshot.

/health is always open (load balancers probe it); the metrics need a key with OPS_AUTH=keys.
"""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.auth import require_ops_key
from app.server import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.server


@get("/health")
async def health(request: Request) -> Response:
    engine = _state(request).engine
    if engine.is_healthy:
        return Response(b'{"status":"ok"}', media_type="application/json")
    return Response(b'{"status":"unavailable"}', status_code=503, media_type="application/json")


@get("/metrics", guards=[require_ops_key])
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.update_gauges(state.engine.gauges())
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@get("/api/metrics", guards=[require_ops_key])
async def metrics_json(request: Request) -> Response:
    state = _state(request)
    snapshot = state.engine.snapshot()
    snapshot["model"] = state.model_id
    return Response(msgspec.json.encode(snapshot), media_type="application/json")


ROUTES = [health, metrics, metrics_json]
