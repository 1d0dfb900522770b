"""Request bodies of the OpenAI endpoints we serve, decoded and validated with msgspec.

Field names and ranges follow the OpenAI spec (CreateCompletionRequest,
CreateChatCompletionRequest) plus vLLM's sampling extensions. As in vLLM, a field we do not
know is ignored and logged by its JSON path (compat.unknown_fields), or, with
UNKNOWN_FIELDS=reject, a 400 naming it. A field we know but cannot honour (images, audio, the
legacy `functions`, ...) is always a 400 naming it, unless its value asks for nothing (null,
`"none"`, the default) - a request is never served while silently dropping what it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
import structlog
from msgspec import Meta

from compat.errors import (
    ApiError,
    from_decode_error,
    invalid_value,
    is_unknown_field_error,
    too_deeply_nested,
    unsupported_parameter,
    unsupported_value,
)
from compat.limits import (
    MAX_IDENTIFIER_LENGTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_SAFETY_IDENTIFIER_LENGTH,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
)
from compat.structured import ResponseFormat, StructuredOutputs, check_structured_outputs
from compat.tools import (
    AssistantToolCall,
    ToolChoice,
    ToolDefinition,
    check_tool_messages,
    check_tools,
)
from compat.unknown_fields import UnknownFields, drop_unknown_fields

log = structlog.get_logger(__name__)

TokenId = Annotated[int, Meta(ge=0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_LENGTH)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)]
# msgspec counts the entries in C right after building the object (which MAX_BODY_BYTES
# bounds: 100k entries take about 20 ms), so no Python code walks an oversized one.
LogitBias = Annotated[
    dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS_ENTRIES)
]


# A field of the spec we cannot honour: decoded as anything, so that a value is refused by
# name (unsupported_parameter), but documented (/schema) as what is served, null.
Refused = Annotated[Any, Meta(extra_json_schema={"type": "null"})]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    # OpenAI pads chunks against a side channel; we never add padding, so either value is fine.
    include_obfuscation: bool | None = None
    # vLLM's extension: every chunk carries the usage so far.
    continuous_usage_stats: bool | None = None


class _SamplingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    n: NumChoices | None = None
    stop: Stop | None = None
    seed: Int64 | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: Annotated[str, Meta(max_length=MAX_IDENTIFIER_LENGTH)] | None = None  # tenant, session
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM extensions.
    # The sampler holds top_k in an int64 tensor; past the vocabulary it keeps every token anyway.
    top_k: Annotated[int, Meta(ge=-1, le=2**63 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None  # lower is more urgent
    cache_salt: Annotated[str, Meta(min_length=1)] | None = None
    structured_outputs: StructuredOutputs | None = None  # grammar-constrained output
    # The logprobs of the prompt's own tokens, with this many alternatives each; the response
    # carries them as `prompt_logprobs` (non-streamed only, as in vLLM).
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM's extension)."""
        options = self.stream_options
        return bool(self.stream and options and options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        return self.n or 1


# --- /v1/completions ---------------------------------------------------------------------------

Prompt = str | list[str | TokenId | list[TokenId]] | None


class CompletionRequest(_SamplingRequest, kw_only=True, forbid_unknown_fields=True):
    # Required but nullable in the spec; null means "from the start of a document" (just BOS).
    prompt: Prompt
    # 0 with `echo` (or prompt_logprobs): score the prompt and generate nothing.
    max_tokens: Annotated[int, Meta(ge=0)] | None = None
    echo: bool | None = None
    best_of: NumChoices | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    suffix: str | None = None

    # The fields an error about the request's length names.
    prompt_param: ClassVar[str] = "prompt"
    max_tokens_param: ClassVar[str] = "max_tokens"

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids (checked at decode)."""
        if self.prompt is None:
            return [""]
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


def _check_completion(req: CompletionRequest) -> None:
    if isinstance(req.prompt, list):
        if not req.prompt:
            raise invalid_value("prompt", "'prompt' must not be an empty list.")
        kinds = {type(p) for p in req.prompt}
        if len(kinds) > 1:
            raise invalid_value(
                "prompt",
                "'prompt' must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids, not a mix.",
            )
        for i, p in enumerate(req.prompt):
            if isinstance(p, list) and not p:
                raise invalid_value(f"prompt[{i}]", f"'prompt[{i}]' must not be an empty list.")
    if req.suffix is not None:
        raise unsupported_parameter("suffix", "insertion (fill-in-the-middle) is not available.")
    if req.best_of is not None and req.best_of != req.num_choices:
        raise unsupported_value(
            "best_of",
            req.best_of,
            f"best_of must equal n ({req.num_choices}); candidates are not ranked server-side.",
        )
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise invalid_value(
            "max_tokens",
            "'max_tokens' must be at least 1, or 0 with 'echo' or 'prompt_logprobs' to score "
            "the prompt alone.",
        )


# --- /v1/chat/completions ----------------------------------------------------------------------


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """One element of a message's `content` list. Only text parts are served; the other
    OpenAI part kinds are declared so that they are refused by name, not as unknown."""

    type: Annotated[str, Meta(extra_json_schema={"enum": ["text"]})]
    text: str | None = None
    image_url: Refused = None
    input_audio: Refused = None
    file: Refused = None
    refusal: Refused = None
    prompt_cache_breakpoint: Refused = None


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The legacy "function" role decodes, to be refused by name; /schema leaves it out.
    role: Annotated[Role, Meta(extra_json_schema={"not": {"enum": ["function"]}})]
    content: str | Annotated[list[ContentPart], Meta(min_length=1)] | None = None
    name: str | None = None
    # An assistant's calls (content may then be null), and the call a `tool` message answers
    # (compat.tools.check_tool_messages). An empty list is no calls, on any role.
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    # Assistant fields of the spec, refused by name when set.
    refusal: Refused = None
    function_call: Refused = None
    audio: Refused = None

    def text(self) -> str:
        """The message text; text parts are joined with newlines."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content or [])


def _check_message(i: int, msg: ChatMessage) -> None:
    where = f"messages[{i}]"
    if msg.role == "function":
        raise unsupported_value(
            f"{where}.role", msg.role, "the legacy function calling is not available; use tools."
        )
    for field in ("refusal", "function_call", "audio"):
        if getattr(msg, field) is not None:
            raise unsupported_parameter(f"{where}.{field}", "only text messages are served.")
    if msg.content is None and not (msg.role == "assistant" and msg.tool_calls):
        raise ApiError(
            f"Missing required parameter: '{where}.content'.",
            param=f"{where}.content",
            code="missing_required_parameter",
        )
    if isinstance(msg.content, list):
        for j, part in enumerate(msg.content):
            part_where = f"{where}.content[{j}]"
            if part.type != "text":
                raise unsupported_value(
                    f"{part_where}.type", part.type, "only text content parts are served."
                )
            for field in ("image_url", "input_audio", "file", "refusal", "prompt_cache_breakpoint"):
                if getattr(part, field) is not None:
                    raise unsupported_parameter(
                        f"{part_where}.{field}", "only text content parts are served."
                    )
            if part.text is None:
                raise ApiError(
                    f"Missing required parameter: '{part_where}.text'.",
                    param=f"{part_where}.text",
                    code="missing_required_parameter",
                )


class ChatCompletionRequest(_SamplingRequest, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None  # deprecated alias
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # Hints that need no action here: prefix caching is automatic; end-user ids for abuse tracking.
    prompt_cache_key: str | None = None
    safety_identifier: Annotated[str, Meta(max_length=MAX_SAFETY_IDENTIFIER_LENGTH)] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (forced calls)
    # Known to the spec, served only at the values that ask for nothing (checked after decode).
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    function_call: Any = None
    functions: Refused = None
    audio: Refused = None
    prediction: Refused = None
    web_search_options: Refused = None
    verbosity: Refused = None
    store: bool | None = None
    metadata: Refused = None
    moderation: Refused = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Refused = None
    # vLLM's extension: extra variables for the checkpoint's chat template.
    chat_template_kwargs: dict[str, Any] | None = None

    prompt_param: ClassVar[str] = "messages"

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else the deprecated max_tokens; None when neither is set."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field that set requested_max_tokens."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are on, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


# Parameters whose only servable values are those listed ("asks for nothing").
_CHAT_OFF_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "function_call": ((None, "none"), "the legacy function calling is not available; use tools."),
    "functions": ((None,), "the legacy function calling is not available; use tools."),
    "audio": ((None,), "only text output is available."),
    "prediction": ((None,), "predicted outputs are not available."),
    "web_search_options": ((None,), "web search is not available."),
    "verbosity": ((None,), "the model has no verbosity control."),
    "reasoning_effort": ((None, "none"), "the model does not reason."),
    "service_tier": ((None, "auto", "default"), "there is a single service tier."),
    "store": ((None, False), "completions are not stored."),
    "metadata": ((None,), "metadata is only kept for stored completions, which are not available."),
    "moderation": ((None,), "moderation is not available."),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache lives in memory only."),
    "prompt_cache_options": ((None,), "the prefix cache is automatic and not configurable."),
}


def _check_chat(req: ChatCompletionRequest) -> None:
    for i, msg in enumerate(req.messages):
        _check_message(i, msg)
    check_tool_messages(req.messages)
    check_tools(req.tools, req.tool_choice)
    for field, (allowed, reason) in _CHAT_OFF_VALUES.items():
        value = getattr(req, field)
        if not any(value == ok and type(value) is type(ok) for ok in allowed):
            if isinstance(value, str):  # an enum-like choice we do not offer
                raise unsupported_value(field, value, reason)
            raise unsupported_parameter(field, reason)
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        bad = next(m for m in req.modalities if m != "text")
        raise unsupported_value("modalities", bad, "only text output is available.")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_value("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")


def _check_sampling_request(req: _SamplingRequest) -> None:
    if req.structured_outputs is not None:
        check_structured_outputs(req.structured_outputs)
    if req.prompt_logprobs is not None and req.stream:
        raise unsupported_parameter(
            "prompt_logprobs",
            "prompt_logprobs are only returned without streaming; a completion's echo with "
            "logprobs streams them.",
        )
    if req.stream_options is not None and not req.stream:
        raise invalid_value(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        )


# --- vLLM's /tokenize and /detokenize ----------------------------------------------------------


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of `prompt` (raw text) or `messages` (rendered with the chat template).
    `add_special_tokens` adds BOS as a completion or chat request would."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as in a chat request


def _check_tokenize(req: TokenizeRequest) -> None:
    if (req.prompt is None) == (req.messages is None):
        raise invalid_value("prompt", "Provide exactly one of 'prompt' or 'messages'.")
    for i, msg in enumerate(req.messages or []):
        _check_message(i, msg)
    check_tool_messages(req.messages or [])


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


# --- decoding ----------------------------------------------------------------------------------

T = TypeVar("T")
Body = bytes | str | dict[str, Any]


def _decode(body: Body, type_: type[T], unknown_fields: UnknownFields) -> T:
    """JSON bytes/str, or an already-parsed dict (e.g. one WebSocket message), to `type_`.
    Unknown fields are dropped and logged once, or (reject) a 400 naming the first."""
    try:
        # The typed decode first: the common case, and its errors name the field's path
        # (a number out of range, nesting too deep); an untyped parse cannot.
        try:
            if isinstance(body, dict):
                return msgspec.convert(body, type_)
            return msgspec.json.decode(body, type=type_)
        except msgspec.ValidationError as exc:
            if unknown_fields == "reject" or not is_unknown_field_error(exc):
                raise
        parsed = body if isinstance(body, dict) else msgspec.json.decode(body)
        known, dropped = drop_unknown_fields(parsed, type_)
        log.warning("unknown fields ignored", fields=dropped)
        return msgspec.convert(known, type_)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise from_decode_error(exc) from None
    except RecursionError:  # deep nesting inside a field typed Any (metadata, tool_calls, ...)
        raise too_deeply_nested() from None


def decode_completion_request(
    body: Body, unknown_fields: UnknownFields = "ignore"
) -> CompletionRequest:
    """Parse and validate a /v1/completions body; raises ApiError (400) naming the field."""
    req = _decode(body, CompletionRequest, unknown_fields)
    _check_sampling_request(req)
    _check_completion(req)
    return req


def decode_chat_completion_request(
    body: Body, unknown_fields: UnknownFields = "ignore"
) -> ChatCompletionRequest:
    """Parse and validate a /v1/chat/completions body; raises ApiError (400) naming the field."""
    req = _decode(body, ChatCompletionRequest, unknown_fields)
    _check_sampling_request(req)
    _check_chat(req)
    return req


def decode_tokenize_request(
    body: Body, unknown_fields: UnknownFields = "ignore"
) -> TokenizeRequest:
    req = _decode(body, TokenizeRequest, unknown_fields)
    _check_tokenize(req)
    return req


def decode_detokenize_request(
    body: Body, unknown_fields: UnknownFields = "ignore"
) -> DetokenizeRequest:
    return _decode(body, DetokenizeRequest, unknown_fields)
