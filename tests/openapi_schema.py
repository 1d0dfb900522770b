"""Validate JSON instances against a component schema of the OpenAI spec (for tests).

    from tests.openapi_schema import validate
    validate(body, "CreateChatCompletionResponse")   # raises jsonschema.ValidationError

The spec is the trimmed copy vendored in tests/openai_spec (see SOURCE.md there). It is OpenAPI
3.1 (JSON Schema 2020-12) but still uses the 3.0 keyword `nullable: true`, which JSON Schema
ignores; it is rewritten once at load time to allow null. `$ref`s resolve
within the document through a `referencing` registry.

Two documented deviations. The spec says streamed and non-streamed completions share one shape,
but its `finish_reason` is not nullable, while every chunk before the last carries null (as
OpenAI's own API sends). Validate completion chunks against COMPLETION_CHUNK, which is
CreateCompletionResponse with a nullable finish_reason. And with `echo` the legacy logprobs
start with the prompt's first token, which has no logprob: its `token_logprobs` and
`top_logprobs` entries are null (as OpenAI's API sent them, and lm-eval skips them), where the
spec's items are not nullable; both completion schemas allow null there.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.openai_spec.vendor_spec import SUBSET_PATH

_URI = "urn:openai-openapi"
COMPLETION_CHUNK = "CreateCompletionResponse(stream chunk)"

_TYPE_SIBLINGS = {"oneOf", "anyOf", "allOf", "$ref"}


def _allow_null(node: Any) -> Any:
    """Rewrite every `nullable: true` into JSON Schema, depth first."""
    if isinstance(node, list):
        return [_allow_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _allow_null(value) for key, value in node.items()}
    if node.pop("nullable", False) is not True:
        return node
    if "type" in node and not _TYPE_SIBLINGS & node.keys():
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        node["type"] = [*types, "null"]
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
        return node
    return {"anyOf": [node, {"type": "null"}]}


@functools.cache
def _spec() -> dict[str, Any]:
    spec = _allow_null(json.loads(SUBSET_PATH.read_text()))
    schemas = spec["components"]["schemas"]
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]
    logprobs = next(
        option for option in choice["properties"]["logprobs"]["anyOf"] if "properties" in option
    )
    for name in ("token_logprobs", "top_logprobs"):
        items = logprobs["properties"][name]["items"]
        items["type"] = [items["type"], "null"]
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    finish["type"], finish["enum"] = ["string", "null"], [*finish["enum"], None]
    schemas[COMPLETION_CHUNK] = chunk
    return spec


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    spec = _spec()
    if name not in spec["components"]["schemas"]:
        raise KeyError(f"no component schema named {name!r}")
    registry = Registry().with_resource(
        _URI, Resource.from_contents(spec, default_specification=DRAFT202012)
    )
    return jsonschema.Draft202012Validator(
        {"$ref": f"{_URI}#/components/schemas/{name}"}, registry=registry
    )


def schema(name: str) -> dict[str, Any]:
    """The (null-rewritten, unresolved) component schema called `name`."""
    return _spec()["components"]["schemas"][name]


def validate(instance: Any, name: str) -> None:
    """Raise jsonschema.ValidationError unless `instance` matches component schema `name`."""
    _validator(name).validate(instance)


def errors(instance: Any, name: str) -> list[str]:
    """Every violation as "path: message" (empty when valid), for readable assertions."""
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in _validator(name).iter_errors(instance)
    ]
