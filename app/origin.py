"""Which browser pages may open `WS /v1/ws`: a guard on the handshake's Origin header.

A WebSocket handshake is not subject to CORS: any page a browser shows can open
ws://127.0.0.1:8000/v1/ws, and a server without API keys would serve it (cross-site WebSocket
hijacking). Browsers always send the page's Origin, so the guard admits:

- no Origin: not a browser (websockets, curl); such a client could send any Origin anyway;
- the server's own origin (the Origin's host:port is the Host header): the dashboard;
- an origin listed in WS_ALLOWED_ORIGINS, or any origin when it lists `*`.

Any other handshake is refused before the upgrade, which uvicorn answers with HTTP 403.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import structlog
from litestar.connection import ASGIConnection
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler

log = structlog.get_logger(__name__)


def normalize_origin(origin: str) -> str:
    """`HTTP://App.Example/` -> `http://app.example`: the form origins are compared in."""
    return origin.strip().rstrip("/").lower()


def origin_allowed(origin: str | None, host: str | None, allowed: frozenset[str]) -> bool:
    """Whether a handshake with this Origin and Host headers may open the socket."""
    if origin is None:
        return True
    if "*" in allowed or normalize_origin(origin) in allowed:
        return True
    # An opaque origin ("null": sandboxed frames, file:// pages) has no host and never matches.
    netloc = urlsplit(normalize_origin(origin)).netloc
    return bool(netloc) and netloc == (host or "").strip().lower()


def websocket_origin_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard for WebSocket routes: refuses (403) an Origin that is not allowed."""
    origin = connection.headers.get("origin")
    allowed = connection.app.state.server.settings.ws_allowed_origins
    if not origin_allowed(origin, connection.headers.get("host"), allowed):
        log.info("websocket origin refused", origin=origin)
        raise PermissionDeniedException("This origin may not open the WebSocket.")
