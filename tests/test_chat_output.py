"""A chat's text events reshaped into content and tool calls (compat.chat_output), as pure
logic on hand-written event streams: each tool mode, finish reasons, and the fold of the
reshaped stream."""

from __future__ import annotations

import json

from compat.chat_output import ChatOutputPlan, ChoiceOutput
from compat.tool_parsers import parser_for
from engine.events import Event, Finished, FinishKind, TextDelta, ToolCallDelta, fold

PYTHONIC = parser_for("gemma3")


def reshaped(
    plan: ChatOutputPlan | None, pieces: list[str], reason: FinishKind = "stop"
) -> list[Event]:
    output = ChoiceOutput(0, plan)
    events: list[Event] = []
    for piece in pieces:
        events += output.shape(TextDelta(0, piece))
    return events + output.shape(Finished(0, reason))


def test_without_tools_the_text_is_the_content() -> None:
    events = reshaped(None, ["Hello", " there"])
    assert events == [TextDelta(0, "Hello"), TextDelta(0, " there"), Finished(0, "stop")]


def test_auto_finds_pythonic_calls_and_finishes_with_tool_calls() -> None:
    plan = ChatOutputPlan(tool_mode="auto", tool_parser=PYTHONIC, tool_names=("f", "g"))
    events = reshaped(plan, ["[f(a=1", ', b="x"), ', "g()]"])
    [result] = fold(events, 1).choices
    assert result.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("f", {"a": 1, "b": "x"}),
        ("g", {}),
    ]
    assert all(c.id.startswith("call_") for c in result.tool_calls)
    assert events[-1] == Finished(0, "tool_calls")


def test_auto_keeps_one_call_without_parallel_calls() -> None:
    plan = ChatOutputPlan(
        tool_mode="auto", tool_parser=PYTHONIC, tool_names=("f", "g"), single_call=True
    )
    [result] = fold(reshaped(plan, ["[f(a=1), g()]"]), 1).choices
    assert [c.name for c in result.tool_calls] == ["f"]


def test_auto_text_that_is_no_call_is_content() -> None:
    plan = ChatOutputPlan(tool_mode="auto", tool_parser=PYTHONIC, tool_names=("f",))
    events = reshaped(plan, ["[not a call", " at all"])
    # Plain strs, as the wire encoders (msgspec) need them.
    assert all(type(e.text) is str for e in events if isinstance(e, TextDelta))
    [result] = fold(events, 1).choices
    assert (result.text, result.tool_calls, result.finish_reason) == (
        "[not a call at all",
        [],
        "stop",
    )


def test_a_named_call_streams_its_arguments() -> None:
    plan = ChatOutputPlan(tool_mode="named", tool_name="f")
    events = reshaped(plan, ['{"a"', ":1}"])
    first, second, finished = events
    assert isinstance(first, ToolCallDelta) and first.name == "f" and first.arguments == '{"a"'
    assert second == ToolCallDelta(0, 0, None, None, ":1}")
    assert finished == Finished(0, "tool_calls")


def test_a_named_call_cut_short_keeps_length() -> None:
    plan = ChatOutputPlan(tool_mode="named", tool_name="f")
    assert reshaped(plan, ['{"a":'], "length")[-1] == Finished(0, "length")


def test_required_reads_the_list_when_it_is_whole() -> None:
    plan = ChatOutputPlan(tool_mode="required")
    text = '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]'
    events = reshaped(plan, [text[:10], text[10:]])
    [result] = fold(events, 1).choices
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("f", {"a": 1}),
        ("g", {}),
    ]
    assert result.finish_reason == "tool_calls"
    # Cut short, what was written is content and the reason stays.
    [cut] = fold(reshaped(plan, [text[:10]], "length"), 1).choices
    assert (cut.text, cut.tool_calls, cut.finish_reason) == (text[:10], [], "length")
