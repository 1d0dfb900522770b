"""The OpenAPI document served at /schema: request bodies and responses from our msgspec types.

The handlers read `request.body()` and decode it with msgspec themselves (strict types, the
OpenAI-shaped 400 naming the field, the 413 past MAX_BODY_BYTES); a typed `data` parameter
would have Litestar convert the body non-strictly and answer with its own error shape. So each
route names its body and response types through an `operation_class` (Litestar's hook for
customising an operation), whose schemas are msgspec's own JSON schema of the very types that
decode them. They are inlined: Litestar fills components/schemas only with the schemas it
generated itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)

from compat.errors import ErrorResponse
from compat.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from compat.responses_types import (
    CreateResponseRequest,
)

JSON = "application/json"

# JSON Schema keywords whose value is a schema, a list of schemas or a map of them.
_SUBSCHEMA = {"items", "additionalProperties", "not"}
_SUBSCHEMA_LISTS = {"anyOf", "allOf", "oneOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties"}


def _snake_case(keyword: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in keyword)


def to_litestar_schema(
    node: dict[str, Any], definitions: dict[str, Any], *, open_objects: bool = False
) -> Schema:
    """A JSON Schema dict (as msgspec writes it) as Litestar's Schema objects, with every
    `$ref` to `definitions` inlined (none of our types is recursive). `open_objects` drops
    `additionalProperties: false`: the body's unknown fields are accepted (and ignored)."""

    def convert(child: dict[str, Any]) -> Schema:
        return to_litestar_schema(child, definitions, open_objects=open_objects)

    if "$ref" in node:
        return convert(definitions[node["$ref"].rpartition("/")[2]])
    fields: dict[str, Any] = {}
    for keyword, value in node.items():
        if open_objects and keyword == "additionalProperties" and value is False:
            continue
        if keyword in _SUBSCHEMA and isinstance(value, dict):
            converted: Any = convert(value)
        elif keyword in _SUBSCHEMA_LISTS:
            converted = [convert(item) for item in value]
        elif keyword in _SUBSCHEMA_MAPS:
            converted = {name: convert(item) for name, item in value.items()}
        elif keyword == "type":
            converted = OpenAPIType(value)
        else:
            converted = value
        # `not` is `schema_not` in Litestar; an unknown keyword fails here, not silently.
        fields["schema_not" if keyword == "not" else _snake_case(keyword)] = converted
    return Schema(**fields)


# The bodies whose unknown fields are ignored (UNKNOWN_FIELDS=ignore, the default).
OPEN_BODIES: frozenset[type[msgspec.Struct]] = frozenset(
    {
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
        CreateResponseRequest,
    }
)


@cache
def schema_of(type_: type[msgspec.Struct]) -> Schema:
    """The OpenAPI schema of a request or response struct (its definitions inlined), made
    once per type; bodies in OPEN_BODIES accept unknown fields."""
    (root,), definitions = msgspec.json.schema_components((type_,))
    return to_litestar_schema(root, definitions, open_objects=type_ in OPEN_BODIES)


def _content(schema: Schema, media_type: str = JSON) -> dict[str, OpenAPIMediaType]:
    return {media_type: OpenAPIMediaType(schema=schema)}


_ERROR = OpenAPIResponse(
    description="An OpenAI-shaped error: {error: {message, type, param, code}}.",
    content=_content(schema_of(ErrorResponse)),
)
# The schema of one server-sent event, as OpenAPI 3.1 reads a text/event-stream `schema`.
_SSE = Schema(
    type=OpenAPIType.OBJECT,
    description="One event: `data` holds a chunk's JSON, or [DONE] last; Responses API events "
    "also name their `type` in `event`.",
    properties={"data": Schema(type=OpenAPIType.STRING), "event": Schema(type=OpenAPIType.STRING)},
    required=["data"],
)


def operation(
    response: type[msgspec.Struct] | Schema,
    request: type[msgspec.Struct] | None = None,
    *,
    media_type: str = JSON,
    streams: bool = False,
    extra: dict[str, OpenAPIResponse] | None = None,
) -> type[Operation]:
    """An `operation_class` for a route: its JSON body type (if any), its 200 response (a
    struct, or a schema of `media_type`), SSE as well when it `streams`, and the error shape
    for every other status. `extra` adds responses by status."""
    ok_schema = schema_of(response) if isinstance(response, type) else response
    ok = _content(ok_schema, media_type)
    if streams:
        ok |= _content(_SSE, "text/event-stream")
    responses = {"200": OpenAPIResponse(description="OK", content=ok), **(extra or {})}
    responses["default"] = _ERROR
    body = (
        None
        if request is None
        else RequestBody(content=_content(schema_of(request)), required=True)
    )

    @dataclass
    class _Operation(Operation):
        def __post_init__(self) -> None:
            self.request_body = body
            self.responses = dict(responses)

    return _Operation


def json_object_operation(description: str) -> type[Operation]:
    """An operation answering with a free-form JSON object (snapshots, status)."""
    return operation(Schema(type=OpenAPIType.OBJECT, description=description))
