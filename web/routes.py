"""Dashboard routes: the page at `/`, its static files, and the load generator's JSON API.

The page and its files hold no data and stay open; the data comes from /api/metrics and the
load generator's routes, which the page calls with the API key it asks for (see app.js).
Driving load needs a key whenever API_KEYS is set; its status, only with OPS_AUTH=keys.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.spec import OpenAPIType, Schema
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler

from app.auth import require_api_key, require_ops_key
from app.openapi import json_object_operation, operation
from app.server import ServerState
from compat.errors import ApiError
from web.loadgen import LoadConfig, LoadGenerator, decode_load_config

STATIC_DIR = Path(__file__).resolve().parent / "static"
JSON = "application/json"


def _json(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type=JSON)


def _load_generator(request: Request) -> LoadGenerator:
    """The app's one load generator, made on first use."""
    state = request.app.state
    if "loadgen" not in state:
        state.loadgen = LoadGenerator()
    return state.loadgen


def own_base_url(request: Request) -> str:
    """Where this server can reach itself: the local socket that accepted this request,
    which works even when the browser came through a proxy; else the request's base URL."""
    server = request.scope.get("server")
    if server and server[1] is not None:  # (host, port); a unix socket has no port
        host, port = server
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return str(request.base_url).rstrip("/")


# The page lives at `/` and its files under /static: a static router mounted at `/` would
# answer every unknown path itself (405 instead of 404 for a POST to an unknown route).
@get("/", include_in_schema=False)
async def dashboard() -> Response:
    return Response((STATIC_DIR / "index.html").read_bytes(), media_type="text/html")


_STATUS = "The load generator's status and results."


@post(
    "/api/loadgen/start",
    status_code=200,
    guards=[require_api_key],
    operation_class=operation(Schema(type=OpenAPIType.OBJECT, description=_STATUS), LoadConfig),
)
async def loadgen_start(request: Request) -> Response:
    config = decode_load_config(await request.body())
    generator = _load_generator(request)
    if generator.running:
        raise ApiError(
            "The load generator is already running; stop it first.",
            status=409,
            code="loadgen_running",
        )
    server: ServerState = request.app.state.server
    generator.start(config, own_base_url(request), server.model_id, server.settings.api_keys)
    return _json(generator.status())


@post(
    "/api/loadgen/stop",
    status_code=200,
    guards=[require_api_key],
    operation_class=json_object_operation(_STATUS),
)
async def loadgen_stop(request: Request) -> Response:
    generator = _load_generator(request)
    await generator.stop()
    return _json(generator.status())


@get(
    "/api/loadgen/status", guards=[require_ops_key], operation_class=json_object_operation(_STATUS)
)
async def loadgen_status(request: Request) -> Response:
    return _json(_load_generator(request).status())


static_files = create_static_files_router(path="/static", directories=[STATIC_DIR], name="static")

ROUTES: list[ControllerRouterHandler] = [
    dashboard,
    static_files,
    loadgen_start,
    loadgen_stop,
    loadgen_status,
]
