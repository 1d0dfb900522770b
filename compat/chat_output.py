"""How a chat's generated text becomes its answer: plain content, a structured output, or
tool calls.

`plan_chat_output` reads the request once: which grammar (if any) constrains the output and how
the text is to be read. `ChoiceOutput` then reshapes one choice's neutral events as they
stream:
- no tools (or `tool_choice` "none"): the text is the content;
- `auto`: the model family's parser (compat.tool_parsers) finds calls in the text; text that
  does not parse as a call is content, never an error;
- a named function: the grammar makes the whole output that function's arguments, streamed as
  one call's argument deltas;
- `required`: the grammar makes the output a JSON list of calls, read when it is complete.
A choice that called tools and stopped by itself finishes with "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from compat.errors import invalid_value
from compat.request_types import ChatCompletionRequest
from compat.structured import GrammarRequest, JsonStyle, json_schema_grammar, requested_grammar
from compat.tool_parsers import ContentDelta, StreamingToolParser, ToolParser
from compat.tool_parsers import ToolCallDelta as ParsedCall
from compat.tools import (
    calls_from_forced_output,
    forced_call_schema,
    new_tool_call_id,
    resolve_tool_choice,
)
from engine.events import Event, Finished, TextDelta, ToolCallDelta

ToolMode = Literal["none", "auto", "named", "required"]


@dataclass(frozen=True)
class ChatOutputPlan:
    grammar: GrammarRequest | None = None
    tool_mode: ToolMode = "none"
    tool_name: str | None = None  # the named function
    tool_parser: ToolParser | None = None  # how `auto` finds calls in the text
    tool_names: tuple[str, ...] = ()  # the declared functions: calls to others are text
    single_call: bool = False  # parallel_tool_calls false: `auto` keeps the first call only


def plan_chat_output(
    req: ChatCompletionRequest, tool_parser: ToolParser, style: JsonStyle, max_tool_calls: int
) -> ChatOutputPlan:
    """The grammar and tool mode of a chat request; 400 when they contradict each other.
    A `required` reply holds at most `max_tool_calls` calls (one without parallel calls)."""
    choice = resolve_tool_choice(req)
    grammar = requested_grammar(req.response_format, req.structured_outputs, style)
    if choice == "none":
        return ChatOutputPlan(grammar)
    if choice == "auto":
        names = tuple(tool.function.name for tool in req.tools or [])
        return ChatOutputPlan(
            grammar, "auto", tool_parser=tool_parser, tool_names=names,
            single_call=req.parallel_tool_calls is False,
        )  # fmt: skip
    if grammar is not None:
        raise invalid_value(
            "tool_choice",
            f"tool_choice {choice!r} constrains the output to tool calls; it cannot be combined "
            f"with '{grammar.param}'.",
        )
    tools = req.tools or []
    max_calls = max_tool_calls if req.parallel_tool_calls is not False else 1
    schema = forced_call_schema(tools, choice, max_calls)
    forced = json_schema_grammar(schema, style, "tools")
    if choice == "required":
        return ChatOutputPlan(forced, "required")
    return ChatOutputPlan(forced, "named", tool_name=choice)


@dataclass
class ChoiceOutput:
    """One choice's events, reshaped by the plan: text in, content and tool calls out."""

    choice: int
    plan: ChatOutputPlan | None
    _parser: StreamingToolParser | None = None
    _calls: int = 0  # tool calls emitted so far
    _held: list[str] = field(default_factory=list)  # `required`: the text until it is whole

    def __post_init__(self) -> None:
        if self.plan is not None and self.plan.tool_parser is not None:
            self._parser = self.plan.tool_parser.streaming_parser(self.plan.tool_names)

    def shape(self, event: Event) -> list[Event]:
        mode = "none" if self.plan is None else self.plan.tool_mode
        if mode == "none" or not isinstance(event, TextDelta | Finished):
            return [event]
        if isinstance(event, Finished):
            events = self._flush(event)
            if self._calls and event.reason == "stop":
                return [*events, Finished(self.choice, "tool_calls")]
            return [*events, event]
        if mode == "auto":
            return self._parsed(event, self._feed(event.text))
        if mode == "named":
            call = ToolCallDelta(self.choice, 0, arguments=event.text)
            if self._calls == 0:
                assert self.plan is not None
                call = ToolCallDelta(
                    self.choice, 0, new_tool_call_id(), self.plan.tool_name, event.text
                )
                self._calls = 1
            return [call]
        self._held.append(event.text)  # required: a list of calls, read whole at the end
        return []

    def _feed(self, text: str) -> list[ContentDelta | ParsedCall]:
        assert self._parser is not None
        return self._parser.feed(text)

    def _parsed(self, event: TextDelta, pieces: list[ContentDelta | ParsedCall]) -> list[Event]:
        """The parser's pieces as events; the step's logprobs go with its first content, or
        with an empty text delta when the step's text was all tool call (or held back)."""
        events: list[Event] = []
        logprobs, offsets = event.logprobs, event.text_offsets
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                # Its plain text: the wire encoders take a str, not a subclass of one.
                events.append(TextDelta(self.choice, piece.text, logprobs, offsets))
                logprobs, offsets = (), ()
            elif not (self.plan and self.plan.single_call and piece.index > 0):
                events.append(self._call_event(piece))
        if logprobs:
            events.append(TextDelta(self.choice, "", logprobs, offsets))
        return events

    def _call_event(self, piece: ParsedCall) -> ToolCallDelta:
        if piece.index >= self._calls:
            self._calls = piece.index + 1
        return ToolCallDelta(self.choice, piece.index, piece.id, piece.name, piece.arguments)

    def _flush(self, finished: Finished) -> list[Event]:
        if self._parser is not None:
            return self._parsed(TextDelta(self.choice, ""), self._parser.finish())
        if not self._held:
            return []
        text = "".join(self._held)
        calls = calls_from_forced_output(text, "required") if finished.reason == "stop" else []
        if not calls:  # cut short (length, abort): what was written is content
            return [TextDelta(self.choice, text)]
        self._calls = len(calls)
        return [
            ToolCallDelta(self.choice, i, call.id, call.name, call.arguments)
            for i, call in enumerate(calls)
        ]
