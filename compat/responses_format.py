"""Neutral generation events (engine.events) -> the Responses API's stream events and Response.

One choice's events become output items as they stream: text opens a `message` item with one
`output_text` part, each tool call a `function_call` item. `feed(event)` gives the stream
events an event becomes (each with its `sequence_number`); the last, after the usage, is
`response.completed` (or `response.incomplete` when the output hit max_output_tokens) carrying
the whole Response. A non-streamed response is that same final Response, so it always says
what its stream would have said.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from compat.responses_types import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    ItemStatus,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseIncomplete,
    ResponseInProgress,
    StreamEvent,
    new_item_id,
    now_s,
    response_usage,
)
from engine.events import Event, Finished, FinishKind, TextDelta, ToolCallDelta, UsageReport

T = TypeVar("T")


@dataclass
class _OpenItem:
    output_index: int
    item: OutputMessage | FunctionCallItem
    text: list[str] = field(default_factory=list)  # a message's text so far


class ResponsesFormatter:
    """One response's events -> stream events. `base` is the Response as created (status
    in_progress, no output): the request's echoed settings, its id and created_at."""

    def __init__(self, base: Response) -> None:
        self.base = base
        self.output: list[OutputMessage | FunctionCallItem] = []
        self.final: Response | None = None
        self._open: list[_OpenItem] = []
        self._calls: dict[int, _OpenItem] = {}  # by the call's index among the choice's calls
        self.finish: FinishKind = "stop"
        self._sequence = 0

    def _numbered(self, events: list[StreamEvent]) -> list[StreamEvent]:
        for event in events:
            event.sequence_number = self._sequence
            self._sequence += 1
        return events

    def failed(self, code: str | None, message: str, param: str | None) -> list[StreamEvent]:
        """The `error` event ending a stream the engine failed."""
        return self._numbered([ErrorEvent(code=code, message=message, param=param)])

    def opening(self) -> list[StreamEvent]:
        return self._numbered(
            [ResponseCreated(response=self.base), ResponseInProgress(response=self.base)]
        )

    def feed(self, event: Event) -> list[StreamEvent]:
        """The stream events of one neutral event (choice 0: a response has one)."""
        events: list[StreamEvent] = []
        if isinstance(event, TextDelta) and event.text and not event.echo:
            message = self._message(events)
            message.text.append(event.text)
            events.append(
                OutputTextDelta(
                    item_id=message.item.id,
                    output_index=message.output_index,
                    content_index=0,
                    delta=event.text,
                )
            )
        elif isinstance(event, ToolCallDelta):
            call = self._calls.get(event.index)
            if call is None:
                call = self._open_call(event, events)
            assert isinstance(call.item, FunctionCallItem)
            if event.arguments:
                call.item.arguments += event.arguments
                events.append(
                    FunctionCallArgumentsDelta(
                        item_id=call.item.id,
                        output_index=call.output_index,
                        delta=event.arguments,
                    )
                )
        elif isinstance(event, Finished):
            self.finish = event.reason
            self._close_all(events)
        elif isinstance(event, UsageReport):
            self.final = self._final(event)
            done = ResponseIncomplete if self.final.status == "incomplete" else ResponseCompleted
            events.append(done(response=self.final))
        return self._numbered(events)

    # ------------------------------------------------------------------ items

    def _message(self, events: list[StreamEvent]) -> _OpenItem:
        if self._open and isinstance(self._open[-1].item, OutputMessage):
            return self._open[-1]
        self._close_all(events)
        item = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
        opened = self._add(item, events)
        events.append(
            ContentPartAdded(
                item_id=item.id,
                output_index=opened.output_index,
                content_index=0,
                part=OutputText(text=""),
            )
        )
        return opened

    def _open_call(self, event: ToolCallDelta, events: list[StreamEvent]) -> _OpenItem:
        self._close_all(events)
        item = FunctionCallItem(
            id=new_item_id("fc"), call_id=event.id or new_item_id("call"),
            name=event.name or "", arguments="", status="in_progress",
        )  # fmt: skip
        opened = self._add(item, events)
        self._calls[event.index] = opened
        return opened

    def _add(self, item: OutputMessage | FunctionCallItem, events: list[StreamEvent]) -> _OpenItem:
        opened = _OpenItem(len(self.output), item)
        self.output.append(item)
        self._open.append(opened)
        events.append(OutputItemAdded(output_index=opened.output_index, item=_copy(item)))
        return opened

    def _close_all(self, events: list[StreamEvent]) -> None:
        status: ItemStatus = "incomplete" if self.finish == "length" else "completed"
        for opened in self._open:
            item, index = opened.item, opened.output_index
            if isinstance(item, OutputMessage):
                text = "".join(opened.text)
                part = OutputText(text=text)
                item.content = [part]
                events.append(
                    OutputTextDone(item_id=item.id, output_index=index, content_index=0, text=text)
                )
                events.append(
                    ContentPartDone(
                        item_id=item.id, output_index=index, content_index=0, part=_copy(part)
                    )
                )
            else:
                events.append(
                    FunctionCallArgumentsDone(
                        item_id=item.id,
                        output_index=index,
                        name=item.name,
                        arguments=item.arguments,
                    )
                )
            item.status = status
            events.append(OutputItemDone(output_index=index, item=_copy(item)))
        self._open = []

    def _final(self, usage: UsageReport) -> Response:
        incomplete = self.finish == "length"
        return msgspec.structs.replace(
            self.base,
            status="incomplete" if incomplete else "completed",
            incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None,
            completed_at=None if incomplete else now_s(),
            output=[_copy(item) for item in self.output],
            usage=response_usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
        )


def _copy(value: T) -> T:
    """A snapshot: an event keeps what the item was when it was sent."""
    return copy.deepcopy(value)
