"""Neutral generation events (engine.events) -> OpenAI's wire shapes.

One formatter per endpoint. `chunk(event)` gives the stream chunk an event becomes (or None);
`response(folded)` the whole response, built from the fold of the same events, so a
non-streamed response always says what its stream would have said.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from msgspec import UNSET, UnsetType

from compat.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined,
    prompt_logprobs,
    shifted,
)
from compat.response_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    ToolCallChunk,
    ToolCallResponse,
    Usage,
    make_usage,
)
from engine.events import (
    ChoiceResult,
    Event,
    Finished,
    FinishKind,
    FoldedGeneration,
    PromptScored,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    UsageReport,
)


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str


def openai_usage(report: UsageReport) -> Usage:
    return make_usage(report.prompt_tokens, report.completion_tokens, report.cached_tokens)


def tool_call_chunk(event: ToolCallDelta) -> ToolCallChunk:
    """A chunk's `delta.tool_calls[i]`: a call's first delta has its id, type and name."""
    if event.id is None:
        return ToolCallChunk(
            index=event.index, function=FunctionCallDelta(arguments=event.arguments)
        )
    return ToolCallChunk(
        index=event.index,
        id=event.id,
        type="function",
        function=FunctionCallDelta(name=event.name or "", arguments=event.arguments),
    )


def tool_call_response(call: ToolCall) -> ToolCallResponse:
    function = FunctionCall(name=call.name, arguments=call.arguments)
    return ToolCallResponse(id=call.id, function=function)


def openai_finish_reason(reason: FinishKind) -> FinishReason:
    """An aborted choice is reported as stopped: OpenAI's finish reasons have no abort."""
    return "stop" if reason == "abort" else reason


class CompletionFormatter:
    """/v1/completions. A choice's text is its echo (when asked) and its generated text; with
    logprobs, an echo carries its prompt tokens' logprobs and every text offset counts from
    the start of the choice's text."""

    def __init__(
        self,
        meta: ResponseMeta,
        token_text: Callable[[int], str],
        *,
        logprobs: bool,
        include_usage: bool,
        prompt_logprobs: bool = False,
        usage_so_far: Callable[[], UsageReport] | None = None,
    ) -> None:
        self.meta = meta
        self.token_text = token_text
        self.logprobs = logprobs
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        self.usage_so_far = usage_so_far
        self.prompt_logprobs = prompt_logprobs  # vLLM's per-choice `prompt_logprobs`
        self._scored: dict[int, PromptScored] = {}  # per choice, until its echo is sent
        self._echo_length: dict[int, int] = {}  # per choice: its echo's characters

    def _echo_logprobs(
        self, choice: int, offsets: tuple[int, ...] | list[int]
    ) -> CompletionLogprobs | None:
        scored = self._scored.get(choice)
        if not self.logprobs or scored is None:
            return None
        return echo_logprobs(scored, self.token_text, offsets)

    def _completion(
        self, choices: list[CompletionChoice], usage: Usage | UnsetType = UNSET
    ) -> Completion:
        meta = self.meta
        if usage is UNSET and self.usage_so_far is not None:
            usage = openai_usage(self.usage_so_far())
        return Completion(
            id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage
        )

    def chunk(self, event: Event) -> Completion | None:
        # No `usage: null` (chat chunks have it): the spec's completion usage is not nullable.
        if isinstance(event, PromptScored):
            self._scored[event.choice] = event  # sent with the echo, which comes next
            return None
        if isinstance(event, TextDelta):
            logprobs = None
            if event.echo:
                self._echo_length[event.choice] = len(event.text)
                logprobs = self._echo_logprobs(event.choice, event.text_offsets)
            elif self.logprobs:
                logprobs = shifted(
                    completion_logprobs(event.logprobs, self.token_text, event.text_offsets),
                    self._echo_length.get(event.choice, 0),
                )
            choice = CompletionChoice(index=event.choice, text=event.text, logprobs=logprobs)
            return self._completion([choice])
        if isinstance(event, Finished):
            reason = openai_finish_reason(event.reason)
            return self._completion(
                [CompletionChoice(index=event.choice, text="", finish_reason=reason)]
            )
        if isinstance(event, UsageReport) and self.include_usage:
            return self._completion([], usage=openai_usage(event))
        return None

    def response(self, folded: FoldedGeneration) -> Completion:
        return self._completion(
            [self._choice(c) for c in folded.choices], usage=openai_usage(folded.usage)
        )

    def _choice(self, c: ChoiceResult) -> CompletionChoice:
        logprobs = None
        if self.logprobs:
            logprobs = shifted(
                completion_logprobs(c.logprobs, self.token_text, c.text_offsets), len(c.echo)
            )
            if c.echo and c.prompt is not None:
                echo = echo_logprobs(c.prompt, self.token_text, c.echo_offsets)
                logprobs = joined(echo, logprobs)
        choice = CompletionChoice(
            index=c.index,
            text=c.echo + c.text,
            logprobs=logprobs,
            finish_reason=openai_finish_reason(c.finish_reason),
        )
        if self.prompt_logprobs and c.prompt is not None:
            choice.prompt_logprobs = prompt_logprobs(c.prompt, self.token_text)
        return choice


class ChatFormatter:
    """/v1/chat/completions. A stream opens every choice with its role, then sends content and
    tool-call deltas, a `{}` delta with the finish reason, and a usage chunk when asked."""

    def __init__(
        self,
        meta: ResponseMeta,
        token_text: Callable[[int], str],
        token_bytes: Callable[[int], bytes],
        *,
        logprobs: bool,
        include_usage: bool,
        prompt_logprobs: bool = False,
        usage_so_far: Callable[[], UsageReport] | None = None,
    ) -> None:
        self.meta = meta
        self.token_text = token_text
        self.token_bytes = token_bytes
        self.logprobs = logprobs
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        self.usage_so_far = usage_so_far
        self.prompt_logprobs = prompt_logprobs  # vLLM's top-level `prompt_logprobs`

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        """With include_usage every chunk has `usage`, null until the last; with continuous
        usage, the usage so far."""
        meta = self.meta
        if usage is None and self.usage_so_far is not None:
            usage = openai_usage(self.usage_so_far())
        return ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model, choices=choices,
            usage=usage if self.include_usage or usage is not None else UNSET,
        )  # fmt: skip

    def opening(self, num_choices: int) -> list[ChatCompletionChunk]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(num_choices)
        ]

    def chunk(self, event: Event) -> ChatCompletionChunk | None:
        if isinstance(event, TextDelta):
            logprobs = None
            if self.logprobs:
                logprobs = chat_logprobs(event.logprobs, self.token_text, self.token_bytes)
            delta = ChatDelta(content=event.text)
            return self._chunk(
                [ChatChunkChoice(index=event.choice, delta=delta, logprobs=logprobs)]
            )
        if isinstance(event, ToolCallDelta):
            delta = ChatDelta(tool_calls=[tool_call_chunk(event)])
            return self._chunk([ChatChunkChoice(index=event.choice, delta=delta)])
        if isinstance(event, Finished):
            reason = openai_finish_reason(event.reason)
            return self._chunk(
                [ChatChunkChoice(index=event.choice, delta=ChatDelta(), finish_reason=reason)]
            )
        if isinstance(event, UsageReport) and self.include_usage:
            return self._chunk([], usage=openai_usage(event))
        return None

    def response(self, folded: FoldedGeneration) -> ChatCompletion:
        meta = self.meta
        response = ChatCompletion(
            id=meta.id,
            created=meta.created,
            model=meta.model,
            choices=[self._choice(c) for c in folded.choices],
            usage=openai_usage(folded.usage),
        )
        scored = folded.choices[0].prompt if folded.choices else None
        if self.prompt_logprobs and scored is not None:  # one prompt for every choice
            response.prompt_logprobs = prompt_logprobs(scored, self.token_text)
        return response

    def _choice(self, c: ChoiceResult) -> ChatChoice:
        calls = [tool_call_response(t) for t in c.tool_calls]
        message = ChatResponseMessage(
            # With tool calls and no text, content is null, as OpenAI sends it.
            content=c.text if c.text or not calls else None,
            tool_calls=calls or UNSET,
        )
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=chat_logprobs(c.logprobs, self.token_text, self.token_bytes)
            if self.logprobs
            else None,
            finish_reason=openai_finish_reason(c.finish_reason),
        )
