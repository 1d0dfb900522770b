"""Who is calling: API-key auth, the tenant for fairness and the session for KV reuse.

With API_KEYS set, every /v1 call needs `Authorization: Bearer <key>`; the key's name is the
tenant. Without keys, the OpenAI `user` field (else a default tenant) is the tenant. The
session is `X-Session-Id`, else `user`; a chat with `X-Session-Id` also keeps its KV pinned
between turns under that id. The guards below put the same check on routes that only need a
key, not a tenant: the load generator, and (OPS_AUTH=keys) the metrics and dashboard data.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from app.generation import Identity
from compat.errors import invalid_api_key, invalid_value, missing_api_key
from compat.limits import MAX_IDENTIFIER_LENGTH
from engine.request import DEFAULT_TENANT


def tenant_for_key(api_keys: Mapping[str, str], authorization: str | None) -> str | None:
    """The tenant named by a valid bearer key; None when auth is off. Raises ApiError 401."""
    if not api_keys:
        return None
    if not authorization:
        raise missing_api_key()
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise missing_api_key()
    token = token.strip()
    for key, tenant in api_keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):  # constant time
            return tenant
    raise invalid_api_key()


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard: with API_KEYS set, a valid bearer key (401 otherwise)."""
    settings = connection.app.state.server.settings
    tenant_for_key(settings.api_keys, connection.headers.get("authorization"))


def require_ops_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard for /metrics, /api/metrics and the dashboard's data: a valid bearer key
    when OPS_AUTH=keys and API_KEYS is set (401 otherwise); open otherwise."""
    settings = connection.app.state.server.settings
    tenant_for_key(settings.ops_keys, connection.headers.get("authorization"))


def session_header(value: str | None) -> str | None:
    """The X-Session-Id header, bounded like `user`: a session id appears in logs and keys
    per-session state. Raises ApiError 400 naming the header past MAX_IDENTIFIER_LENGTH."""
    if value is not None and len(value) > MAX_IDENTIFIER_LENGTH:
        raise invalid_value(
            "X-Session-Id",
            f"Invalid value for 'X-Session-Id': expected string of length <= "
            f"{MAX_IDENTIFIER_LENGTH}.",
        )
    return value


def identity_for(
    key_tenant: str | None,
    user: str | None = None,
    session_header: str | None = None,
    pin_session: bool = False,
) -> Identity:
    """The key's tenant, else the `user` field, else the default; the session from the header,
    else the user. With `pin_session`, the header's session also pins its KV between turns."""
    return Identity(
        tenant=key_tenant or user or DEFAULT_TENANT,
        session_id=session_header or user,
        kv_session=session_header if pin_session else None,
    )
