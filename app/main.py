"""The Litestar application: `uvicorn app.main:app` or `python -m app serve`.

The lifespan loads the model and starts the engine loop; on shutdown it stops admitting,
lets in-flight requests finish for SHUTDOWN_GRACE_S, then aborts the rest.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from litestar import Litestar, Request, Router
from litestar.openapi import OpenAPIConfig

from app import routes_openai, routes_ops, routes_ws
from app.errors import EXCEPTION_HANDLERS
from app.logging import configure_logging
from app.origin import websocket_origin_guard
from app.server import build_server_state
from app.settings import Settings, load_settings
from web import routes as web_routes

log = structlog.get_logger(__name__)


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or load_settings()
    configure_logging(settings.LOG_FORMAT)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        state = build_server_state(settings, created=int(time.time()))
        app.state.server = state
        log.info("serving", host=settings.HOST, port=settings.PORT, model=state.model_id)
        try:
            yield
        finally:
            log.info("draining", grace_s=settings.SHUTDOWN_GRACE_S)
            await state.engine.shutdown(settings.SHUTDOWN_GRACE_S)

    async def bind_request_id(request: Request) -> None:
        # async: Litestar runs a sync hook in a worker thread, whose contextvars would be lost.
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex[:16],
            path=request.url.path,
        )

    return Litestar(
        route_handlers=[
            *routes_openai.ROUTES,
            *routes_ops.ROUTES,
            # The Origin check guards the socket's handshake (cross-site WebSocket hijacking).
            Router("/", route_handlers=routes_ws.ROUTES, guards=[websocket_origin_guard]),
            *web_routes.ROUTES,
        ],
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        before_request=bind_request_id,
        request_max_body_size=settings.MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(title="gemma-serve", version="0.1.0", path="/schema"),
    )


def __getattr__(name: str) -> Litestar:
    # `uvicorn app.main:app` builds the app on first access, reading settings then.
    if name == "app":
        application = create_app()
        globals()["app"] = application
        return application
    raise AttributeError(name)
