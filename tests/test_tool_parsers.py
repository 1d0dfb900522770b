"""Tool calls read back from generated text: Gemma 3's pythonic format and Gemma 4's native one,
whole and streamed."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from compat.tool_parsers import (
    ContentDelta,
    Gemma4ToolParser,
    ParsedOutput,
    PythonicToolParser,
    ToolCallDelta,
    parse_gemma4_arguments,
    parser_for,
)

Q = '<|"|>'  # Gemma 4's string delimiter
PYTHONIC = PythonicToolParser()
GEMMA4 = Gemma4ToolParser()


def calls_of(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


# --- Gemma 3: pythonic --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '[get_weather(city="Paris", days=3)]',
            None,
            [("get_weather", '{"city": "Paris", "days": 3}')],
        ),
        (
            "  [f(a=1, b='x'), g()]\n",
            None,
            [("f", '{"a": 1, "b": "x"}'), ("g", "{}")],
        ),
        (
            "[f(flag=True, other=False, nothing=None, neg=-2.5, t=(1, 2), "
            "d={'k': [1, {'z': None}]})]",
            None,
            [
                (
                    "f",
                    '{"flag": true, "other": false, "nothing": null, "neg": -2.5, "t": [1, 2], '
                    '"d": {"k": [1, {"z": null}]}}',
                )
            ],
        ),
        # JSON spellings, which small models mix in.
        ("[f(a=true, b=false, c=null)]", None, [("f", '{"a": true, "b": false, "c": null}')]),
        ('[f(s="é \\"q\\" \\n")]', None, [("f", '{"s": "é \\"q\\" \\n"}')]),
        # Fenced, as small Gemma models write it; the text before the block is the content.
        (
            '```tool_code\n[get_weather(city="Paris")]\n```',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            'Let me look.\n\n```tool_code\nprint(get_weather(city="Paris"))\n```\n',
            "Let me look.",
            [("get_weather", '{"city": "Paris"}')],
        ),
        ("```python\nnow()\n```", None, [("now", "{}")]),
        ("```py\n[a(), b(x=1)]\n```", None, [("a", "{}"), ("b", '{"x": 1}')]),
        ("```\n[a()]\n```", None, [("a", "{}")]),
        ("```tool_call\na(x=[])\n```", None, [("a", '{"x": []}')]),
        # The last block counts: an earlier code block is content.
        (
            "```python\nx = 1\n```\nThen:\n```tool_code\n[a()]\n```",
            "```python\nx = 1\n```\nThen:",
            [("a", "{}")],
        ),
    ],
)
def test_pythonic_calls(text, content, calls):
    parsed = PYTHONIC.parse(text)
    assert parsed.content == content
    assert calls_of(parsed) == calls


@pytest.mark.parametrize(
    "text",
    [
        "Hello there.",
        "",
        "[1, 2, 3]",
        "[]",
        "[Note] the list [f(a=1)] is inline",
        "[f(1)]",  # positional arguments
        "[f(a=x)]",  # a variable, not a literal
        "[f(a=1+2)]",
        "[f(**kw)]",
        "[f(a=1), 3]",
        "[f(a=1)",  # cut short
        "[f(a=float('nan'))]",
        "[f(a=b'x')]",
        "[f(a={1: 2})]",
        "[f(a={1, 2})]",
        "[obj.method(a=1)]",
        "f(a=1)",  # a bare call is read in a fence only
        "[f(a=1)] and then some text",
        "```json\n[f(a=1)]\n```",
        "```tool_code\n[f(a=1)]\n```\ntrailing words",
        "```tool_code\n[f(a=1)]",  # an unclosed fence
        "```tool_code\nimport os\n```",
        "[" * 500 + "]" * 500,
        "[f(a=" + "[" * 300 + "]" * 300 + ")]",
    ],
)
def test_pythonic_non_calls_are_content(text):
    assert PYTHONIC.parse(text) == ParsedOutput(text, [])


def test_pythonic_tool_names():
    names = ["get-weather", "now"]
    parsed = PYTHONIC.parse('[get-weather(city="Paris"), now()]', names)
    assert calls_of(parsed) == [("get-weather", '{"city": "Paris"}'), ("now", "{}")]
    # A call to a function the request did not offer is text (say, a code sample).
    assert PYTHONIC.parse("```python\nprint(len(x=1))\n```", names).tool_calls == []
    assert calls_of(PYTHONIC.parse("```python\nprint(len(x=1))\n```")) == [("len", '{"x": 1}')]


# --- Gemma 4: native ----------------------------------------------------------------------------


def g4(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            g4("get_weather", f"location:{Q}Paris, France{Q}"),
            None,
            [("get_weather", '{"location": "Paris, France"}')],
        ),
        (
            "Checking both.\n"
            + g4("get_weather", f"city:{Q}Tokyo{Q},days:3")
            + g4("now", "")
            + "<|tool_response>",
            "Checking both.",
            [("get_weather", '{"city": "Tokyo", "days": 3}'), ("now", "{}")],
        ),
        (
            g4(
                "plan",
                f"when:{{day:{Q}Mon{Q},hours:[9,10.5,-1e3]}},ok:true,no:false,none:null,"
                f"tags:[{Q}a,b{Q},{Q}{{c}}{Q},[]],deep:[{{k:[{{}}]}}]",
            ),
            None,
            [
                (
                    "plan",
                    '{"when": {"day": "Mon", "hours": [9, 10.5, -1000.0]}, "ok": true, '
                    '"no": false, "none": null, "tags": ["a,b", "{c}", []], "deep": [{"k": [{}]}]}',
                )
            ],
        ),
        # Strings keep what the delimiters enclose: quotes, colons, braces, newlines.
        (
            g4("say", f'text:{Q}He said "hi": {{ok}}\n{Q}'),
            None,
            [("say", '{"text": "He said \\"hi\\": {ok}\\n"}')],
        ),
        # Quoted keys, spaces, a bare word (a string without its delimiters), a trailing comma.
        (
            g4("f", f" {Q}a key{Q} : 1 , mode : fast ,"),
            None,
            [("f", '{"a key": 1, "mode": "fast"}')],
        ),
        # A malformed block before a good one is content; one after the calls is dropped.
        (
            "Hi " + g4("broken", "a:") + " " + g4("ok", "") + g4("bad", "x"),
            "Hi <|tool_call>call:broken{a:}<tool_call|>",
            [("ok", "{}")],
        ),
    ],
)
def test_gemma4_calls(text, content, calls):
    parsed = GEMMA4.parse(text)
    assert parsed.content == content
    assert calls_of(parsed) == calls


@pytest.mark.parametrize(
    "text",
    [
        "Just words.",
        "",
        "<|tool_call>call:f{a:1}",  # cut short
        g4("f", "a:1").replace("call:", "cal:"),
        g4("f", f"a:{Q}unterminated"),
        g4("f", "a:1}"),
        g4("f", "a:[1,2"),
        g4("f", "a 1"),
        g4("f", "a:" + "[" * 3000 + "]" * 3000),
    ],
)
def test_gemma4_non_calls_are_content(text):
    assert GEMMA4.parse(text) == ParsedOutput(text, [])


def test_gemma4_arguments():
    assert parse_gemma4_arguments(f"{{a:{Q}x{Q},b:[1,{{c:true}}]}}") == {
        "a": "x",
        "b": [1, {"c": True}],
    }
    with pytest.raises(ValueError):
        parse_gemma4_arguments("{a:1} extra")


# --- streaming ---------------------------------------------------------------------------------

STREAM_CASES = [
    (PYTHONIC, '[get_weather(city="Paris", days=3), now()]'),
    (PYTHONIC, '  \n[get_weather(city="Paris")]  \n'),
    (PYTHONIC, 'Let me look.\n\n```tool_code\nprint(get_weather(city="Paris"))\n```\n'),
    (PYTHONIC, "```python\nx = 1\n```\nThen:\n```tool_code\n[a()]\n```"),
    (PYTHONIC, "Some `code` and ``` fences ```\nthat are ``not`` calls.\n"),
    (PYTHONIC, "```tool_code\n[f(a=1)]\n```\ntrailing words"),
    (PYTHONIC, "[Note] the answer is 4.  "),
    (PYTHONIC, "[f(a=1)] and then some text"),
    (PYTHONIC, "Plain answer with a list [1, 2] and [f(x=1)] inline.\n\nBye "),
    (PYTHONIC, "  leading spaces\n"),
    (PYTHONIC, ""),
    (GEMMA4, g4("get_weather", f"location:{Q}Paris{Q}")),
    (
        GEMMA4,
        "Checking.\n\n"
        + g4("a", f"x:{Q}<tool_call|>?{Q}")
        + g4("b", "n:[1,{m:2}]")
        + "<|tool_response>",
    ),
    (GEMMA4, "Hi " + g4("broken", "a:") + " " + g4("ok", "") + g4("bad", "x")),
    (GEMMA4, "No call here, only <|tool and <|tool_cal text.  "),
    (GEMMA4, "Cut short <|tool_call>call:f{a:1"),
    (GEMMA4, ""),
]


def stream(parser, text: str, pieces: list[str]):
    streaming = parser.streaming_parser()
    out = []
    for piece in pieces:
        out += streaming.feed(piece)
    out += streaming.finish()
    assert streaming.finish() == [] and streaming.feed("more") == []
    content = "".join(p for p in out if isinstance(p, ContentDelta))
    deltas = [p for p in out if isinstance(p, ToolCallDelta)]
    return content, deltas


@pytest.mark.parametrize("parser, text", STREAM_CASES)
def test_streaming_one_character_at_a_time_equals_whole_parse(parser, text):
    parsed = parser.parse(text)
    for pieces in (list(text), [text]):
        content, deltas = stream(parser, text, pieces)
        assert content == (parsed.content or "")
        assert [(d.name, d.arguments) for d in deltas] == calls_of(parsed)
        assert [d.index for d in deltas] == list(range(len(deltas)))
        assert all(d.id and d.id.startswith("call_") for d in deltas)


@pytest.mark.parametrize("parser, text", STREAM_CASES)
def test_streaming_in_random_pieces_equals_whole_parse(parser, text):
    rng = random.Random(text)
    parsed = parser.parse(text)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if text else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        content, deltas = stream(parser, text, pieces)
        assert content == (parsed.content or "")
        assert [(d.name, d.arguments) for d in deltas] == calls_of(parsed)


def test_pythonic_stream_releases_plain_text_at_once_and_holds_what_may_be_a_call():
    streaming = PYTHONIC.streaming_parser()
    assert streaming.feed("Hello") == ["Hello"]
    assert streaming.feed(" world ") == [" world"]  # trailing whitespace waits
    assert streaming.feed("`") == []  # may open a fence
    assert streaming.feed("x") == [" `x"]
    assert streaming.feed("\n```tool_code\n[get_") == []
    assert streaming.feed("weather(city='Paris')]\n```") == []
    [call] = streaming.finish()  # the newline before the block is dropped with it
    assert isinstance(call, ToolCallDelta)
    assert (call.index, call.name, call.arguments) == (
        0,
        "get_weather",
        '{"city": "Paris"}',
    )

    streaming = PYTHONIC.streaming_parser()
    assert streaming.feed("[get") == []
    assert streaming.feed("_weather(") == []
    streaming = PYTHONIC.streaming_parser()
    assert streaming.feed("[Note") == []
    assert streaming.feed("] hi") == ["[Note] hi"]


def test_gemma4_stream_emits_each_call_when_it_closes():
    streaming = GEMMA4.streaming_parser()
    assert streaming.feed("Sure. <|tool") == ["Sure."]
    assert streaming.feed("_call>call:a{x:1}") == []
    [first] = streaming.feed("<tool_call|>")
    assert isinstance(first, ToolCallDelta)
    assert (first.index, first.name, first.arguments) == (0, "a", '{"x": 1}')
    assert first.id is not None and len(first.id) == 29
    [second] = streaming.feed(g4("b", ""))
    assert isinstance(second, ToolCallDelta)
    assert (second.index, second.name, second.arguments) == (1, "b", "{}")
    assert streaming.feed("<|tool_response>") == []
    assert streaming.finish() == []


def test_content_delta_is_a_str():
    piece = ContentDelta("abc")
    assert isinstance(piece, str) and piece == "abc" and piece.text == "abc"


# --- choosing the family -----------------------------------------------------------------------


def tokenizer_with(tokens: list[str]) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<unk>", *tokens])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )


class Config:
    def __init__(self, model_type: str) -> None:
        self.model_type = model_type


class Model:
    def __init__(self, model_type: str) -> None:
        self.config = Config(model_type)


def test_parser_for():
    assert isinstance(
        parser_for(tokenizer_with(["<|tool_call>", "<tool_call|>"])), Gemma4ToolParser
    )
    assert isinstance(parser_for(tokenizer_with(["<start_of_turn>"])), PythonicToolParser)
    assert isinstance(parser_for(Model("gemma4_text")), Gemma4ToolParser)
    assert isinstance(parser_for(Config("gemma3_text")), PythonicToolParser)
    assert isinstance(parser_for(None), PythonicToolParser)
    assert isinstance(parser_for("gemma4"), Gemma4ToolParser)
    assert isinstance(parser_for("gemma3"), PythonicToolParser)
    assert isinstance(parser_for("pythonic"), PythonicToolParser)
    assert (GEMMA4.family, PYTHONIC.family) == ("gemma4", "gemma3_pythonic")
