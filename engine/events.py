"""A generation as neutral events, whatever wire carries it.

A request's choices each stream `StepOutput`s from the engine. `ChoiceTracker` turns one
choice's outputs into events; the HTTP formatters, the WebSocket and the offline API all consume
the same events, and a whole (non-streamed) result is their fold (`fold`):

    PromptScored   the logprobs of a choice's prompt tokens (prompt logprobs, echo scoring)
    TextDelta      new text of a choice, with the logprobs of the tokens that made it
    ToolCallDelta  part of a tool call: the first part of a call names it, later parts extend
                   its JSON arguments
    Finished       a choice ended, and why
    UsageReport    token counts, once, after every choice finished

Tool calls are found in the text by a model family's parser above this module (the app layer);
the engine itself only ever emits text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from engine.request import FinishReason, StepOutput, TokenLogprob

# "tool_calls": the choice ended by calling tools; "abort": the client cancelled it.
FinishKind = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(frozen=True)
class PromptScored:
    """A choice's prompt, scored when its prefill ended: entries[i] scores token_ids[i + 1]
    (the first token has no logprob)."""

    choice: int
    token_ids: tuple[int, ...]
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class TextDelta:
    choice: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    # Per logprobs entry: where its token's text begins in the choice's generated text; for
    # an echo, where each prompt token's text begins in it.
    text_offsets: tuple[int, ...] = ()
    echo: bool = False  # the prompt, repeated before the generated text (completions echo)


@dataclass(frozen=True)
class ToolCallDelta:
    choice: int
    index: int  # the call's position among the choice's calls
    id: str | None = None  # the first delta of a call carries its id and name
    name: str | None = None
    arguments: str = ""  # more of the arguments' JSON text


@dataclass(frozen=True)
class Finished:
    choice: int
    reason: FinishKind


@dataclass(frozen=True)
class UsageReport:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


Event = PromptScored | TextDelta | ToolCallDelta | Finished | UsageReport


def finish_kind(reason: FinishReason | None) -> FinishKind:
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.ABORT:
        return "abort"
    return "stop"


@dataclass
class ChoiceTracker:
    """One choice's engine outputs -> events; keeps the counts its usage needs."""

    index: int
    prompt_token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text_length: int = 0  # characters of generated text so far
    finish_reason: FinishReason | None = None

    def events(self, out: StepOutput) -> list[PromptScored | TextDelta | Finished]:
        """The events of one step: the prompt's logprobs if it scored them, its text (and
        logprobs), then Finished if it was the last."""
        # A token's offset is where the text before its step ends: the detokenizer shows a
        # character split over byte tokens with its last token, so no offset passes the text
        # and a stream agrees with the whole response.
        offsets = (self.text_length,) * len(out.logprobs or [])
        self.text_length += len(out.new_text)
        self.completion_tokens += len(out.new_token_ids)
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        events: list[PromptScored | TextDelta | Finished] = []
        if out.prompt_logprobs is not None:
            events.append(
                PromptScored(self.index, self.prompt_token_ids, tuple(out.prompt_logprobs))
            )
        if out.new_text or out.logprobs:
            events.append(TextDelta(self.index, out.new_text, tuple(out.logprobs or ()), offsets))
        if out.finished:
            self.finish_reason = out.finish_reason
            events.append(Finished(self.index, finish_kind(out.finish_reason)))
        return events


def usage_of(trackers: list[ChoiceTracker], n: int) -> UsageReport:
    """Prompt tokens count once per prompt (not per choice), as OpenAI reports them; the
    trackers are in prompt-major order, n choices per prompt."""
    return UsageReport(
        prompt_tokens=sum(t.prompt_tokens for t in trackers[::n]),
        completion_tokens=sum(t.completion_tokens for t in trackers),
        cached_tokens=sum(t.cached_tokens for t in trackers[::n]),
    )


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ChoiceResult:
    """Everything one choice produced: the fold of its events."""

    index: int
    echo: str = ""
    echo_offsets: list[int] = field(default_factory=list)  # each prompt token's, in `echo`
    prompt: PromptScored | None = None
    text: str = ""  # generated text (tool-call text excluded)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishKind = "stop"


@dataclass
class FoldedGeneration:
    choices: list[ChoiceResult]
    usage: UsageReport


def fold(events: Iterable[Event], num_choices: int) -> FoldedGeneration:
    """The whole result the events describe."""
    choices = [ChoiceResult(i) for i in range(num_choices)]
    usage = UsageReport(0, 0, 0)
    texts: list[list[str]] = [[] for _ in range(num_choices)]
    for event in events:
        if isinstance(event, UsageReport):
            usage = event
            continue
        choice = choices[event.choice]
        if isinstance(event, PromptScored):
            choice.prompt = event
        elif isinstance(event, TextDelta):
            if event.echo:
                choice.echo += event.text
                choice.echo_offsets.extend(event.text_offsets)
            else:
                texts[event.choice].append(event.text)
                choice.logprobs.extend(event.logprobs)
                choice.text_offsets.extend(event.text_offsets)
        elif isinstance(event, ToolCallDelta):
            if event.index == len(choice.tool_calls):
                choice.tool_calls.append(ToolCall(event.id or "", event.name or "", ""))
            choice.tool_calls[event.index].arguments += event.arguments
        else:
            choice.finish_reason = event.reason
    for choice, parts in zip(choices, texts, strict=True):
        choice.text = "".join(parts)
    return FoldedGeneration(choices, usage)
