"""OpenAI's Responses API (`POST /v1/responses`): the request body, the Response object and
its stream events, as msgspec types.

Field names follow OpenAI's spec (CreateResponse, Response, ResponseStreamEvent). The request
decodes leniently wherever OpenAI's own shapes vary (an input message with or without
`"type": "message"`); compat.responses_input then checks the items and turns them into chat
messages, refusing by name what cannot be served (images, built-in tools, reasoning, ...).
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from compat.limits import MAX_IDENTIFIER_LENGTH, MAX_SAFETY_IDENTIFIER_LENGTH
from compat.request_types import Refused

# --- ids ---------------------------------------------------------------------------------------


def new_item_id(prefix: str) -> str:
    """An id shaped like OpenAI's: a prefix ("resp", "msg", "fc") and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


# --- request -----------------------------------------------------------------------------------

# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]


class InputContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A part of an input message's content: text is served (input_text, or an assistant's
    output_text); the image, file and audio parts are declared to be refused by name."""

    type: Annotated[str, Meta(extra_json_schema={"enum": ["input_text", "output_text"]})]
    text: str | None = None
    annotations: list[Any] | None = None  # an echoed output_text's (always empty here)
    logprobs: list[Any] | None = None
    image_url: Refused = None
    file_id: Refused = None
    file_url: Refused = None
    file_data: Refused = None
    filename: Refused = None
    detail: Refused = None
    input_audio: Refused = None


class InputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One input item: a message (`type` "message" or absent), an earlier `function_call`
    echoed back, or a `function_call_output` answering one."""

    type: (
        Annotated[
            str,
            Meta(extra_json_schema={"enum": ["message", "function_call", "function_call_output"]}),
        ]
        | None
    ) = None
    role: (
        Annotated[
            str, Meta(extra_json_schema={"enum": ["user", "system", "developer", "assistant"]})
        ]
        | None
    ) = None
    content: str | list[InputContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None
    phase: Refused = None


class FunctionToolParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool of the request: Responses' flat function tool; other types are refused by name."""

    type: Annotated[str, Meta(extra_json_schema={"enum": ["function"]})]
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunctionParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Annotated[str, Meta(extra_json_schema={"enum": ["function"]})]
    name: str | None = None


ToolChoiceParam = Literal["none", "auto", "required"] | ToolChoiceFunctionParam


class FormatText(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class FormatJsonObject(
    msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True
):
    pass


class FormatJsonSchema(
    msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True, forbid_unknown_fields=True
):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


TextFormatParam = FormatText | FormatJsonObject | FormatJsonSchema


class TextParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormatParam | None = None
    verbosity: str | None = None  # served at "medium" (or null) only


class ReasoningParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None  # served at "none" (or null) only
    summary: str | None = None
    generate_summary: str | None = None
    mode: Refused = None
    context: Refused = None


class StreamOptionsParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # OpenAI pads events against a side channel; we never pad, so either value is fine.
    include_obfuscation: bool | None = None


class CreateResponseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | Annotated[list[InputItem], Meta(min_length=1)] | None = None
    instructions: str | None = None
    # OpenAI's minimum is 16.
    max_output_tokens: Annotated[int, Meta(ge=16)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    text: TextParam | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Meta(max_length=MAX_IDENTIFIER_LENGTH)] | None = None
    metadata: Metadata | None = None
    user: Annotated[str, Meta(max_length=MAX_IDENTIFIER_LENGTH)] | None = None  # tenant
    safety_identifier: Annotated[str, Meta(max_length=MAX_SAFETY_IDENTIFIER_LENGTH)] | None = None
    prompt_cache_key: str | None = None  # a hint: prefix caching is automatic
    stream: bool | None = None
    stream_options: StreamOptionsParam | None = None
    # Known to the spec, served only at the values that ask for nothing (checked after decode).
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None  # counts built-in tools: none here
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: ReasoningParam | None = None
    prompt_cache_retention: str | None = None
    prompt: Refused = None
    conversation: Refused = None
    context_management: Refused = None
    moderation: Refused = None
    prompt_cache_options: Refused = None


# --- the Response object -----------------------------------------------------------------------


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", kw_only=True):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: ItemStatus
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem


class FunctionTool(msgspec.Struct, tag="function", tag_field="type", kw_only=True):
    name: str
    parameters: dict[str, Any] | None
    strict: bool | None
    description: str | None = None


class ToolChoiceFunction(msgspec.Struct, tag="function", tag_field="type", kw_only=True):
    name: str


class TextFormatText(msgspec.Struct, tag="text", tag_field="type"):
    pass


class TextFormatJsonObject(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class TextFormatJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True):
    name: str
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | UnsetType = UNSET


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema
    verbosity: Literal["medium"] = "medium"


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=input_tokens + output_tokens,
    )


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseErrorDetail(msgspec.Struct):
    code: str
    message: str


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class Response(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    instructions: str | None
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    metadata: dict[str, str]
    text: TextConfig
    store: bool
    object: Literal["response"] = "response"
    error: ResponseErrorDetail | None = None
    incomplete_details: IncompleteDetails | None = None
    completed_at: int | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    top_logprobs: int = 0
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    service_tier: Literal["default"] = "default"
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | UnsetType = UNSET  # not nullable: absent until the response ends
    user: str | UnsetType = UNSET  # not nullable in the spec
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(msgspec.Struct, kw_only=True):
    """GET /v1/responses/{id}/input_items: the items a response was given, as stored."""

    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: Literal["list"] = "list"


def now_s() -> int:
    return int(time.time())


# --- stream events -----------------------------------------------------------------------------


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0  # set when the event is sent


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, tag="error"):
    code: str | None
    message: str
    param: str | None


StreamEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ErrorEvent
)


def event_type(event: StreamEvent) -> str:
    """The event's `type`, which its SSE `event:` line repeats."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag
