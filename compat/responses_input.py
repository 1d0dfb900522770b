"""A Responses request, checked and turned into what the chat machinery serves.

`decode_create_response` decodes and checks a `POST /v1/responses` body: what it asks for that
cannot be served (reasoning, background runs, built-in tools, images, ...) is a 400 naming the
field, unless its value asks for nothing. `input_messages` turns the input items into chat
messages (compat.request_types.ChatMessage: message items, function calls as an assistant's
tool calls, call outputs as tool messages); `as_chat_request` gives the equivalent chat
request, whose tools, tool_choice and text format the chat code already plans and samples.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from compat.errors import ApiError, invalid_value, unsupported_parameter, unsupported_value
from compat.request_types import Body, ChatCompletionRequest, ChatMessage, _decode
from compat.responses_types import (
    CreateResponseRequest,
    FormatJsonObject,
    FormatJsonSchema,
    FormatText,
    InputContentPart,
    InputItem,
    ToolChoiceFunctionParam,
)
from compat.structured import (
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaResponseFormat,
    ResponseFormat,
    TextFormat,
)
from compat.tools import (
    AssistantFunctionCall,
    AssistantToolCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
    check_tools,
    parse_arguments,
)
from compat.unknown_fields import UnknownFields

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_REFUSED_PART_FIELDS = (
    "image_url", "file_id", "file_url", "file_data", "filename", "detail", "input_audio"
)  # fmt: skip

# Parameters whose only servable values are those listed ("asks for nothing").
_OFF_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "responses run in the foreground only."),
    "truncation": ((None, "disabled"), "the input is never truncated."),
    "service_tier": ((None, "auto", "default"), "there is a single service tier."),
    "top_logprobs": ((None, 0), "the Responses API serves no logprobs here."),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache lives in memory only."),
    "prompt": ((None,), "prompt templates are not available."),
    "conversation": ((None,), "conversations are not available; use previous_response_id."),
    "context_management": ((None,), "context management is not available."),
    "moderation": ((None,), "moderation is not available."),
    "prompt_cache_options": ((None,), "the prefix cache is automatic and not configurable."),
}


def decode_create_response(
    body: Body, unknown_fields: UnknownFields = "ignore"
) -> CreateResponseRequest:
    """Parse and check a /v1/responses body; raises ApiError (400) naming the field."""
    req = _decode(body, CreateResponseRequest, unknown_fields)
    _check_request(req)
    return req


def _is_off(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(value == ok and type(value) is type(ok) for ok in allowed)


def _check_request(req: CreateResponseRequest) -> None:
    for field, (allowed, reason) in _OFF_VALUES.items():
        value = getattr(req, field)
        if not _is_off(value, allowed):
            if isinstance(value, str):
                raise unsupported_value(field, value, reason)
            raise unsupported_parameter(field, reason)
    if req.include:
        raise unsupported_value("include", req.include[0], "there is no extra output to include.")
    if req.reasoning is not None:
        reasoning = req.reasoning
        if reasoning.effort not in (None, "none"):
            raise unsupported_value("reasoning.effort", reasoning.effort, "the model does not "
                                    "reason.")  # fmt: skip
        for field in ("summary", "generate_summary", "mode", "context"):
            if getattr(reasoning, field) is not None:
                raise unsupported_parameter(f"reasoning.{field}", "the model does not reason.")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise unsupported_value(
            "text.verbosity", req.text.verbosity, "the model has no verbosity control."
        )
    if req.stream_options is not None and not req.stream:
        raise invalid_value(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        )
    if req.input is None:
        raise ApiError(
            "Missing required parameter: 'input'.", param="input",
            code="missing_required_parameter",
        )  # fmt: skip
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise unsupported_value(
                f"tools[{i}].type", tool.type, "only function tools are available."
            )
        if tool.name is None:
            raise _missing(f"tools[{i}].name")
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunctionParam):
        if choice.type != "function":
            raise unsupported_value(
                "tool_choice.type", choice.type, "only function tools are available."
            )
        if choice.name is None:
            raise _missing("tool_choice.name")
    try:
        check_tools(chat_tools(req), chat_tool_choice(req))
    except ApiError as exc:
        raise renamed(exc) from None
    if isinstance(req.input, list):
        for i, item in enumerate(req.input):
            _check_item(i, item)


def _missing(param: str) -> ApiError:
    return ApiError(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


_CHAT_PARAMS = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
    (re.compile(r"^messages"), "input"),
)


def renamed(exc: ApiError) -> ApiError:
    """A chat-side error (from code that serves chat requests) naming the Responses field
    it came from."""
    if exc.param is not None:
        for pattern, replacement in _CHAT_PARAMS:
            param = pattern.sub(replacement, exc.param)
            if param != exc.param:
                exc.message = exc.message.replace(exc.param, param)
                exc.param = param
                break
    return exc


def _check_item(i: int, item: InputItem) -> None:
    where = f"input[{i}]"
    kind = item.type or "message"
    if kind == "message":
        if item.role is None:
            raise _missing(f"{where}.role")
        if item.role not in _MESSAGE_ROLES:
            raise unsupported_value(f"{where}.role", item.role, "the roles are user, system, "
                                    "developer and assistant.")  # fmt: skip
        if item.content is None:
            raise _missing(f"{where}.content")
        if item.phase is not None:
            raise unsupported_parameter(f"{where}.phase", "message phases are not available.")
        _check_parts(f"{where}.content", item.content)
        _no_fields(where, item, ("call_id", "name", "arguments", "output"), kind)
    elif kind == "function_call":
        for field in ("call_id", "name", "arguments"):
            if getattr(item, field) is None:
                raise _missing(f"{where}.{field}")
        assert item.arguments is not None
        parse_arguments(item.arguments, f"{where}.arguments")
        _no_fields(where, item, ("role", "content", "output"), kind)
    elif kind == "function_call_output":
        for field in ("call_id", "output"):
            if getattr(item, field) is None:
                raise _missing(f"{where}.{field}")
        assert item.output is not None
        _check_parts(f"{where}.output", item.output)
        _no_fields(where, item, ("role", "content", "name", "arguments"), kind)
    else:
        raise unsupported_value(
            f"{where}.type", kind,
            "the input items served are messages, function_call and function_call_output.",
        )  # fmt: skip


def _no_fields(where: str, item: InputItem, fields: Sequence[str], kind: str) -> None:
    for field in fields:
        if getattr(item, field) is not None:
            raise invalid_value(f"{where}.{field}", f"A '{kind}' input item has no '{field}'.")


def _check_parts(where: str, content: str | list[InputContentPart]) -> None:
    if isinstance(content, str):
        return
    for j, part in enumerate(content):
        part_where = f"{where}[{j}]"
        if part.type not in _TEXT_PARTS:
            raise unsupported_value(
                f"{part_where}.type", part.type, "only text content parts are served."
            )
        for field in _REFUSED_PART_FIELDS:
            if getattr(part, field) is not None:
                raise unsupported_parameter(
                    f"{part_where}.{field}", "only text content parts are served."
                )
        if part.text is None:
            raise _missing(f"{part_where}.text")


# --- input items -> chat messages --------------------------------------------------------------


def _text(content: str | list[InputContentPart] | None) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content or [])


def input_messages(
    req: CreateResponseRequest, earlier_call_ids: Sequence[str] = ()
) -> list[ChatMessage]:
    """The request's input as chat messages (instructions excluded). Consecutive function
    calls are one assistant message's tool calls; a call output must answer a call made
    earlier (in `earlier_call_ids`, the chained history's, or in this input)."""
    if isinstance(req.input, str):
        return [ChatMessage(role="user", content=req.input)]
    messages: list[ChatMessage] = []
    call_ids = set(earlier_call_ids)
    for i, item in enumerate(req.input or []):
        kind = item.type or "message"
        if kind == "message":
            role = item.role
            assert role is not None  # checked at decode
            messages.append(ChatMessage(role=role, content=_text(item.content)))  # type: ignore[arg-type]
        elif kind == "function_call":
            assert item.call_id is not None and item.name is not None
            call = AssistantToolCall(
                id=item.call_id, type="function",
                function=AssistantFunctionCall(item.name, item.arguments or "{}"),
            )  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            call_ids.add(item.call_id)
        else:
            if item.call_id not in call_ids:
                raise invalid_value(
                    f"input[{i}].call_id",
                    f"No tool call found for function call output with call_id {item.call_id!r}.",
                )
            messages.append(
                ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id)
            )
    return messages


def call_ids_of(messages: Sequence[ChatMessage]) -> list[str]:
    return [call.id for msg in messages for call in msg.tool_calls or []]


# --- the equivalent chat request ---------------------------------------------------------------


def chat_tools(req: CreateResponseRequest) -> list[ToolDefinition] | None:
    if not req.tools:
        return None
    return [
        ToolDefinition(
            type="function",
            function=FunctionDefinition(
                name=tool.name or "",
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            ),
        )
        for tool in req.tools
    ]


def chat_tool_choice(req: CreateResponseRequest) -> ToolChoice | None:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunctionParam):
        return NamedToolChoice(type="function", function=NamedFunction(choice.name or ""))
    return choice


def chat_response_format(req: CreateResponseRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or isinstance(fmt, FormatText):
        return None if fmt is None else TextFormat()
    if isinstance(fmt, FormatJsonObject):
        return JsonObjectFormat()
    assert isinstance(fmt, FormatJsonSchema)
    return JsonSchemaResponseFormat(
        json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict
        )
    )


def as_chat_request(
    req: CreateResponseRequest, messages: list[ChatMessage]
) -> ChatCompletionRequest:
    """The chat request that asks what `req` asks, over `messages` (instructions included)."""
    return msgspec.structs.replace(
        ChatCompletionRequest(model=req.model, messages=messages),
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=chat_tools(req),
        tool_choice=chat_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=chat_response_format(req),
        user=req.user,
        stream=req.stream,
    )
