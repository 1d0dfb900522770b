"""The Litestar application: `uvicorn app.main:app` or `python -m app serve`.

Building the app loads the model and starts the engine loop; a model that cannot load ends
the process before anything listens. On SIGTERM the server drains (app/shutdown.py): it stops
admitting, lets in-flight requests finish for SHUTDOWN_GRACE_S, fails the rest with an error,
and exits.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import structlog
from litestar import Litestar, Request, Router
from litestar.openapi import OpenAPIConfig

from app import routes_openai, routes_ops, routes_responses, routes_ws
from app.errors import EXCEPTION_HANDLERS
from app.json_only import json_only_guard
from app.logging import configure_logging
from app.origin import websocket_origin_guard
from app.server import ServerState, build_server_state
from app.settings import Settings, load_settings
from app.shutdown import DrainOnSignal
from web import routes as web_routes

log = structlog.get_logger(__name__)


def create_app(settings: Settings | None = None) -> Litestar:
    """The server: loads the model and starts the engine first (exiting if it cannot)."""
    settings = settings or load_settings()
    configure_logging(settings.LOG_FORMAT)
    state = _load(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.server = state
        DrainOnSignal(state.engine, settings.SHUTDOWN_GRACE_S).install()
        log.info("serving", host=settings.HOST, port=settings.PORT, model=state.model_id)
        try:
            yield
        finally:
            log.info("stopping", grace_s=settings.SHUTDOWN_GRACE_S)
            await state.engine.shutdown(settings.SHUTDOWN_GRACE_S)

    return _routes_app(settings, [lifespan])


def openapi_document() -> dict:
    """The document /schema/openapi.json serves, built from the routes alone (no model)."""
    return _routes_app(load_settings(), []).openapi_schema.to_schema()


async def _bind_request_id(request: Request) -> None:
    # async: Litestar runs a sync hook in a worker thread, whose contextvars would be lost.
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        request_id=request.headers.get("x-request-id") or uuid.uuid4().hex[:16],
        path=request.url.path,
    )


def _routes_app(
    settings: Settings, lifespan: list[Callable[[Litestar], AbstractAsyncContextManager[None]]]
) -> Litestar:
    return Litestar(
        route_handlers=[
            *routes_openai.ROUTES,
            *routes_responses.ROUTES,
            *routes_ops.ROUTES,
            # The Origin check guards the socket's handshake (cross-site WebSocket hijacking).
            Router("/", route_handlers=routes_ws.ROUTES, guards=[websocket_origin_guard]),
            *web_routes.ROUTES,
        ],
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        # Writes must declare JSON, which a cross-site page cannot send unasked (app/json_only.py).
        guards=[json_only_guard],
        before_request=_bind_request_id,
        request_max_body_size=settings.MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(title="gemma-serve", version="0.1.0", path="/schema"),
    )


def _load(settings: Settings) -> ServerState:
    """Load the model and start the engine, or exit with status 1 after one log line naming
    the cause: before uvicorn binds the port, so nothing ever answers /health."""
    try:
        return build_server_state(settings, created=int(time.time()))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.error("model failed to load", model=settings.MODEL_NAME, error=error)
        raise SystemExit(1) from None


def __getattr__(name: str) -> Litestar:
    # `uvicorn app.main:app` builds the app on first access, reading settings then.
    if name == "app":
        application = create_app()
        globals()["app"] = application
        return application
    raise AttributeError(name)
