"""Structured outputs: what a request asks its output to match, as a grammar for the engine.

Three ways in, one `GrammarSpec` out:
- OpenAI's `response_format`: `json_object` (any JSON object) or `json_schema` (strict or not,
  the schema is enforced by grammar-constrained decoding; strict, as in OpenAI's API, also
  closes objects to properties they do not list: `closed_objects`);
- vLLM's `structured_outputs` extension: exactly one of `json` (a schema), `regex`, `choice`
  (one of the given strings), `grammar` (Lark, or GBNF/EBNF) or `json_object`;
- a chat's `tool_choice` of `required` or a named function (compat.tools.forced_call_schema).

A small model inside a grammar fills whatever room the grammar leaves it: given any JSON
whitespace it can spend its whole budget on newlines, given an object open to other keys it
invents keys until `max_tokens`. So by default (`JsonStyle`):
- JSON is compact: no whitespace outside strings (STRUCTURED_OUTPUT_WHITESPACE=flexible, or a
  request's `structured_outputs.disable_any_whitespace: false`, allows it);
- an object schema that lists `properties` and says nothing of `additionalProperties` allows no
  other keys (`closed_objects`; STRUCTURED_OUTPUT_EXTRA_PROPERTIES=allow, or a request's
  `structured_outputs.disable_additional_properties: false`, keeps JSON Schema's default of
  allowing them). A strict `json_schema` and a function's parameters are always closed;
- a number has at most 6 digits after its point unless its schema gives a `multipleOf`, and a
  number or integer without bounds stays within +-(2**53 - 1) (`bounded_numbers`;
  STRUCTURED_OUTPUT_FRACTION_DIGITS sets how many digits, -1 lifts both).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from compat.errors import ApiError, invalid_value
from engine.structured.spec import GrammarSpec, Whitespace


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(
    msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True
):
    pass


class JsonSchemaResponseFormat(
    msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True
):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


@dataclass(frozen=True)
class JsonStyle:
    """How JSON constrained by a schema may be written (see the module docstring)."""

    whitespace: Whitespace = "compact"
    closed_objects: bool = True
    fraction_digits: int | None = 6  # the most digits after a number's point; None: any


@dataclass(frozen=True)
class GrammarRequest:
    """A grammar and the request field that asked for it (named by a compile error)."""

    spec: GrammarSpec
    param: str


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _each_schema(schema: Any, change: Callable[[dict[str, Any]], None]) -> Any:
    """A copy of `schema` with `change` applied to it and every schema inside it (never to
    data such as `default` or `enum`); the caller's schema is left as it is."""
    if not isinstance(schema, dict):
        return schema
    copy = dict(schema)
    for key in _SUBSCHEMA:
        if key in schema:
            copy[key] = _each_schema(schema[key], change)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            copy[key] = [_each_schema(sub, change) for sub in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            copy[key] = {name: _each_schema(sub, change) for name, sub in schema[key].items()}
    change(copy)
    return copy


def _close(schema: dict[str, Any]) -> None:
    if isinstance(schema.get("properties"), dict):
        schema.setdefault("additionalProperties", False)


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that lists `properties` and says nothing of
    `additionalProperties` allows no others: OpenAI's strict mode, and what a function's
    parameters mean. Left open, a small model fills the object with keys of its own."""
    return _each_schema(schema, _close)


# A number without bounds stays within the integers a double holds exactly (JavaScript's
# safe integers), which every JSON parser reads without loss.
_SAFE_MIN, _SAFE_MAX = -(2**53 - 1), 2**53 - 1


def bounded_numbers(schema: Any, digits: int) -> Any:
    """A copy of `schema` where a number without `multipleOf` has at most `digits` digits after
    the decimal point, and a number or integer without `minimum` / `maximum` stays within
    +-(2**53 - 1): bounds on a value do not bound its length, and a small
    model can write digits until `max_tokens`."""

    def bound(sub: dict[str, Any]) -> None:
        kinds = sub.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if "number" in kinds and "multipleOf" not in sub:
            sub["multipleOf"] = 10**-digits if digits else 1
        if "number" in kinds or "integer" in kinds:
            if "minimum" not in sub and "exclusiveMinimum" not in sub:
                sub["minimum"] = _SAFE_MIN
            if "maximum" not in sub and "exclusiveMaximum" not in sub:
                sub["maximum"] = _SAFE_MAX

    return _each_schema(schema, bound)


def json_schema_grammar(schema: dict[str, Any], style: JsonStyle, param: str) -> GrammarRequest:
    """The schema's key order is kept: its properties' order is the output's."""
    if style.closed_objects:
        schema = closed_objects(schema)
    if style.fraction_digits is not None:
        schema = bounded_numbers(schema, style.fraction_digits)
    return GrammarRequest(GrammarSpec.json_schema(schema, style.whitespace), param)


def _from_response_format(fmt: ResponseFormat, style: JsonStyle) -> GrammarRequest | None:
    if isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat) or fmt.json_schema.schema is None:
        # json_object, or a json_schema without a schema: any JSON object
        return GrammarRequest(GrammarSpec.json_object(style.whitespace), "response_format")
    if fmt.json_schema.strict:
        style = replace(style, closed_objects=True)
    return json_schema_grammar(fmt.json_schema.schema, style, "response_format")


def check_structured_outputs(so: StructuredOutputs) -> str:
    """The one constraint `structured_outputs` gives; a 400 unless exactly one."""
    given = [
        name for name in ("json", "regex", "choice", "grammar") if getattr(so, name) is not None
    ] + (["json_object"] if so.json_object else [])
    if len(given) != 1:
        raise invalid_value(
            "structured_outputs",
            "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar' "
            f"or 'json_object'; got {', '.join(given) or 'none'}.",
        )
    return given[0]


def _from_structured_outputs(so: StructuredOutputs, style: JsonStyle) -> GrammarRequest:
    if so.disable_any_whitespace is not None:
        style = replace(style, whitespace="compact" if so.disable_any_whitespace else "flexible")
    if so.disable_additional_properties is not None:
        style = replace(style, closed_objects=so.disable_additional_properties)
    whitespace = style.whitespace
    kind = check_structured_outputs(so)
    param = f"structured_outputs.{kind}"
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise invalid_value(param, f"'{param}' is not valid JSON: {exc}.") from None
            if not isinstance(schema, dict):
                raise invalid_value(param, f"'{param}' must be a JSON schema object.")
        assert isinstance(schema, dict)
        return json_schema_grammar(schema, style, param)
    if kind == "json_object":
        return GrammarRequest(GrammarSpec("json_object", "", whitespace), param)
    if kind == "choice":
        return GrammarRequest(GrammarSpec("choice", json.dumps(so.choice), whitespace), param)
    source = so.regex if kind == "regex" else so.grammar
    assert source is not None
    return GrammarRequest(GrammarSpec(kind, source, whitespace), param)  # type: ignore[arg-type]


def requested_grammar(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    style: JsonStyle,
) -> GrammarRequest | None:
    """The grammar a request's `response_format` or `structured_outputs` asks for, if any."""
    from_format = None if response_format is None else _from_response_format(response_format, style)
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise invalid_value(
            "structured_outputs",
            "Use either 'response_format' or 'structured_outputs', not both.",
        )
    return _from_structured_outputs(structured_outputs, style)


def grammar_error(param: str, message: str) -> ApiError:
    """A grammar the engine could not compile: a 400 naming the field that gave it."""
    return invalid_value(param, f"Invalid '{param}': {message}")
