"""Every error leaves the server in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE
from litestar.types import ExceptionHandlersMap

from compat.errors import ApiError, route_not_found, server_error

log = structlog.get_logger(__name__)


def _response(error: ApiError) -> Response:
    return Response(
        msgspec.json.encode(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers=error.headers,
    )


def api_error_handler(_: Request, exc: ApiError) -> Response:
    log.info("request refused", status=exc.status, code=exc.code, param=exc.param)
    return _response(exc)


def http_exception_handler(request: Request, exc: HTTPException) -> Response:
    """Litestar's own refusals (unknown route, wrong method, body too large, bad JSON)."""
    status = exc.status_code
    if status == 404:
        return _response(route_not_found(request.method, request.url.path))
    if status == HTTP_413_REQUEST_ENTITY_TOO_LARGE:
        limit = request.app.state.server.settings.MAX_BODY_BYTES
        return _response(
            ApiError(
                f"The request body is larger than the limit of {limit} bytes.",
                status=413,
                code="request_too_large",
            )
        )
    return _response(ApiError(str(exc.detail), status=status, headers=exc.headers or {}))


def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", path=request.url.path)
    return _response(server_error())


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    ApiError: api_error_handler,
    HTTPException: http_exception_handler,
    Exception: unexpected_error_handler,
}
