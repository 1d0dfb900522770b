"""OpenAI tool calling: the request's tool types, their validation, and forced calls.

Request side (decoded with msgspec, documented in /schema):
- `tools`: function tools only, `{"type": "function", "function": {name, description?,
  parameters?, strict?}}`; names match OpenAI's `^[a-zA-Z0-9_-]{1,64}$` and are unique;
  `parameters` is a JSON schema object whose `type`, when given, is "object".
- `tool_choice`: "none" | "auto" | "required" | {"type": "function", "function": {"name"}};
  anything but "none" needs `tools`, and a named function must be one of them.
- in `messages`: assistant `tool_calls` (arguments a JSON object as a string) and `tool`
  messages answering one of them by `tool_call_id`. A tool message whose id matches no earlier
  assistant call is a 400 (OpenAI refuses it too; vLLM lets it through): the renderers need the
  call to know which function answered.
- The legacy `functions` / `function_call` stay refused by name (compat.request_types).

Forced calls (`tool_choice` "required" or a named function) are constrained by a JSON schema,
as vLLM does whatever the model's native format: the named function's arguments object, or a
JSON list of `{"name", "parameters"}` calls (`forced_call_schema`), read back by
`calls_from_forced_output`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from compat.errors import ApiError, invalid_value
from compat.structured import closed_objects

if TYPE_CHECKING:
    from compat.request_types import ChatMessage

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ID_ALPHABET = string.ascii_letters + string.digits

ToolChoiceMode = Literal["none", "auto", "required"]

# --- request types ----------------------------------------------------------------------------


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Checked after decode (check_tools) for an OpenAI-worded 400; /schema states the pattern.
    name: Annotated[str, Meta(extra_json_schema={"pattern": FUNCTION_NAME_PATTERN})]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no parameters
    strict: bool | None = None  # the schema is enforced only for forced calls, strict or not


class ToolDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = ToolChoiceMode | NamedToolChoice


class AssistantFunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # a JSON object, as text


class AssistantToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"]
    function: AssistantFunctionCall


# --- validation -------------------------------------------------------------------------------


def _bad_name(param: str, name: str) -> ApiError:
    return invalid_value(
        param,
        f"Invalid '{param}': string does not match pattern. Expected a string that matches "
        f"the pattern '{FUNCTION_NAME_PATTERN}', got {name!r}.",
    )


def check_tools(
    tools: Sequence[ToolDefinition] | None,
    tool_choice: ToolChoice | None,
) -> None:
    """400s naming the field: bad or duplicate names, a `parameters` that is no object schema,
    a `tool_choice` without tools or naming a function that is not among them."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        fn = tool.function
        param = f"tools[{i}].function"
        if not _FUNCTION_NAME.fullmatch(fn.name):
            raise _bad_name(f"{param}.name", fn.name)
        if fn.name in seen:
            raise invalid_value(
                f"{param}.name",
                f"Duplicate function name {fn.name!r} in 'tools': names are unique.",
            )
        seen.add(fn.name)
        schema_type = (fn.parameters or {}).get("type", "object")
        if schema_type != "object":
            raise invalid_value(
                f"{param}.parameters",
                f"Invalid schema for function {fn.name!r}: 'parameters' must be a JSON Schema "
                f"of 'type: \"object\"', got 'type: {json.dumps(schema_type)}'.",
            )
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:
        raise invalid_value(
            "tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when "
            "'tools' are specified.",
        )  # fmt: skip
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in seen:
        raise invalid_value(
            "tool_choice.function.name",
            f"Invalid value for 'tool_choice': function {tool_choice.function.name!r} is not "
            "among the 'tools'.",
        )


def parse_arguments(arguments: str, param: str) -> dict[str, Any]:
    """A history call's `arguments` as a dict; a 400 naming `param` unless a JSON object."""
    try:
        value = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise invalid_value(param, f"'{param}' is not valid JSON.") from None
    if not isinstance(value, dict):
        raise invalid_value(param, f"'{param}' must be a JSON object.")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_tool_messages(messages: Sequence[ChatMessage]) -> None:
    """The tool parts of a conversation: calls only on assistant messages, with JSON-object
    arguments; a `tool` message has a `tool_call_id` answering an earlier assistant call."""
    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.tool_calls:
            if msg.role != "assistant":
                raise invalid_value(
                    f"{where}.tool_calls", "Only assistant messages can have 'tool_calls'."
                )
            for j, call in enumerate(msg.tool_calls):
                parse_arguments(
                    call.function.arguments, f"{where}.tool_calls[{j}].function.arguments"
                )
                call_ids.add(call.id)
        if msg.role == "tool":
            if msg.tool_call_id is None:
                raise ApiError(
                    f"Missing required parameter: '{where}.tool_call_id'.",
                    param=f"{where}.tool_call_id",
                    code="missing_required_parameter",
                )
            if msg.tool_call_id not in call_ids:
                raise invalid_value(
                    f"{where}.tool_call_id",
                    f"Invalid parameter: messages with role 'tool' must be a response to a "
                    f"preceding message with 'tool_calls'; no earlier call has the id "
                    f"{msg.tool_call_id!r}.",
                )
        elif msg.tool_call_id is not None:
            raise invalid_value(
                f"{where}.tool_call_id", "Only messages with role 'tool' have a 'tool_call_id'."
            )


def resolve_tool_choice(req: Any) -> str:
    """ "none", "auto", "required" or the name of the function to call, with OpenAI's default:
    "auto" when the request has tools, "none" when it has none. `req` needs `tools` and
    `tool_choice` (a ChatCompletionRequest)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    if choice is None:
        return "auto" if req.tools else "none"
    return str(choice)


# --- forced calls -----------------------------------------------------------------------------


def new_tool_call_id() -> str:
    """An id shaped like OpenAI's: `call_` and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its arguments are JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)


def _function(tools: Sequence[ToolDefinition], name: str) -> FunctionDefinition:
    for tool in tools:
        if tool.function.name == name:
            return tool.function
    raise invalid_value("tool_choice.function.name", f"No function named {name!r} in 'tools'.")


def _object_schema(fn: FunctionDefinition) -> dict[str, Any]:
    """A function's parameters; an object lists all its properties (closed_objects)."""
    schema = closed_objects(dict(fn.parameters or {}))
    schema.setdefault("type", "object")
    return schema


def forced_call_schema(
    tools: Sequence[ToolDefinition], choice: str, max_calls: int | None = None
) -> dict[str, Any]:
    """The JSON schema a forced call's output follows.

    A named function (`choice` is its name): the output is its arguments object, the function's
    `parameters` (an object of any shape when it has none). "required": a JSON list of one or
    more `{"name": ..., "parameters": {...}}`, each name tied to its own schema (anyOf over the
    tools), at most `max_calls` of them. The tools' `$defs` move to the top level, so
    their `#/$defs/...` references still resolve; two tools defining one name differently are a
    400.
    """
    if choice != "required":
        return _object_schema(_function(tools, choice))
    defs: dict[str, Any] = {}
    alternatives = []
    for i, tool in enumerate(tools):
        schema = _object_schema(tool.function)
        for key, value in (schema.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise invalid_value(
                    f"tools[{i}].function.parameters",
                    f"Tool definitions conflict: '$defs' {key!r} differs between tools.",
                )
            defs[key] = value
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": schema,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    result: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if max_calls is not None:
        result["maxItems"] = max_calls
    if defs:
        result["$defs"] = defs
    return result


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def calls_from_forced_output(text: str, choice: str) -> list[ToolCall]:
    """The calls in a forced call's output (see forced_call_schema).

    A named function: one call; its arguments are the text re-serialised when it is JSON, else
    the text as written (cut short by max_tokens, say: OpenAI also sends what was written).
    "required": the calls of the list, or [] when the text is not such a list.
    """
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        value = None
        if choice != "required":
            return [ToolCall(choice, text.strip())]
    if choice != "required":
        return [ToolCall(choice, _json_text(value))]
    if not isinstance(value, list):
        return []
    calls = []
    for item in value:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("parameters", {}), dict)
        ):
            return []
        calls.append(ToolCall(item["name"], _json_text(item.get("parameters", {}))))
    return calls
