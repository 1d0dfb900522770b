"""Response bodies and stream chunks, shaped as the OpenAI spec describes them.

Encode with msgspec.json.encode. Fields OpenAI leaves out unless asked for are typed
`... | UnsetType` and default to UNSET, which msgspec omits; fields the spec requires even when
empty (a choice's `logprobs`, a message's `refusal`) default to None and are sent as null.
"""

from __future__ import annotations

import secrets
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

# "tool_calls": the model called tools (and stopped by itself).
FinishReason = Literal["stop", "length", "tool_calls"]


def new_completion_id() -> str:
    return f"cmpl-{secrets.token_hex(12)}"


def new_chat_completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


# --- usage -------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


# --- /v1/completions (the same shape is used for stream chunks) -------------------------------


class CompletionLogprobs(msgspec.Struct):
    """The legacy logprobs. With `echo` the prompt's tokens come first, and the first of them
    has null for its logprob and alternatives (nothing precedes it), as OpenAI sent them."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


# Per prompt position (null for the first): token id (as a JSON key) -> its entry; holds the
# prompt's own token and the requested number of most likely ones.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None  # null in stream chunks until the last one
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's extension, when asked


class Completion(msgspec.Struct, kw_only=True):
    """A text completion, or one chunk of a streamed one.

    `usage`: set on a full response; in a stream, absent from every chunk but a final one with
    no choices, sent when stream_options.include_usage is on (the spec's usage is not nullable).
    """

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | UnsetType = UNSET
    choices: list[CompletionChoice]
    usage: Usage | UnsetType | None = UNSET


# --- /v1/chat/completions ----------------------------------------------------------------------


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallResponse(msgspec.Struct, kw_only=True):
    """One of a message's `tool_calls` (the spec's ChatCompletionMessageToolCall)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    """`content` is null when the model only called tools; `tool_calls` is left out when it
    called none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallResponse] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | UnsetType = UNSET
    choices: list[ChatChoice]
    usage: Usage | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's extension, when asked


class FunctionCallDelta(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # in a call's first delta only
    arguments: str | UnsetType = UNSET  # more of the arguments' JSON text


class ToolCallChunk(msgspec.Struct, kw_only=True):
    """One of a delta's `tool_calls` (the spec's ChatCompletionMessageToolCallChunk): a call's
    first chunk has its id, type and name; later ones extend its arguments."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: FunctionCallDelta


class ChatDelta(msgspec.Struct, kw_only=True):
    """The first chunk of a choice carries the role; later ones the new content or tool calls;
    the last {}."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One chat stream chunk; `usage` as in Completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | UnsetType = UNSET
    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType | None = UNSET


# --- /v1/models --------------------------------------------------------------------------------


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int  # vLLM's extension: the context length in tokens


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Model]


# --- vLLM's /tokenize and /detokenize ----------------------------------------------------------


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET  # only when return_token_strs was asked for


class DetokenizeResponse(msgspec.Struct):
    prompt: str
