"""Requests that change state must declare a JSON body: no cross-site requests.

A browser lets any page send a "simple" request to another origin without asking it first:
a POST whose Content-Type is text/plain, application/x-www-form-urlencoded or
multipart/form-data (a form, or `fetch` in no-cors mode). The page cannot read the answer, but
the server would still generate, or start the load generator, for whoever's browser it is.
Any other Content-Type, and any other method (PUT, PATCH, DELETE), needs a CORS preflight,
which this server never grants (it sends no CORS headers). So every POST must say
`application/json` (parameters such as `; charset=utf-8` and `application/*+json` types
allowed), or it is refused with 415 before its route runs, whether or not it has a body.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from compat.errors import unsupported_media_type

# The one writing method a page may send to another origin without a preflight.
_SIMPLE_WRITES = frozenset({"POST"})


def is_json_media_type(content_type: str | None) -> bool:
    """`application/json`, or `application/<anything>+json`, with any parameters."""
    if not content_type:
        return False
    media_type = content_type.partition(";")[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def json_only_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Litestar guard for the whole app: a POST without a JSON Content-Type is a 415."""
    scope = connection.scope
    if scope["type"] != "http" or scope.get("method") not in _SIMPLE_WRITES:  # WebSockets pass
        return
    content_type = connection.headers.get("content-type")
    if not is_json_media_type(content_type):
        raise unsupported_media_type(content_type)
