"""Tool calling's protocol layer: request types and their 400s, forced-call schemas, prompts with
tools, and responses with tool calls against OpenAI's spec."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import msgspec
import pytest

from compat.chat_template import python_literal, render_chat_prompt, render_gemma_turns
from compat.errors import ApiError
from compat.request_types import (
    decode_chat_completion_request,
    decode_tokenize_request,
)
from compat.response_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCallChunk,
    ToolCallResponse,
    make_usage,
)
from compat.structured import bounded_numbers, closed_objects
from compat.tools import (
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
    calls_from_forced_output,
    forced_call_schema,
    new_tool_call_id,
    resolve_tool_choice,
)
from tests.openapi_schema import errors as spec_errors
from tests.openapi_schema import validate
from tests.test_compat_chat_template import GEMMA_FORMAT_TEMPLATE, make_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
        "strict": True,
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
USER_HI = [{"role": "user", "content": "hi"}]


def call(id_: str, name: str, arguments: dict) -> dict:
    return {
        "id": id_,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            call("c1", "get_weather", {"city": "Paris", "days": 2}),
            call(
                "c2",
                "get_weather",
                {"city": "Rome", "metric": True, "tags": ["a", None], "opts": {"x": 1.5}},
            ),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "  18C  "},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "21C"}]},
    {"role": "user", "content": "And now?"},
    {"role": "assistant", "content": None, "tool_calls": [call("c3", "now", {})]},
    {"role": "tool", "tool_call_id": "c3", "content": "12:00"},
]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER_HI, **fields}).encode()


def refused(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode_chat_completion_request(body)
    assert info.value.status == 400
    return info.value


# --- requests ----------------------------------------------------------------------------------


def test_a_full_tool_conversation_is_accepted_and_spec_valid():
    body = {
        "model": "m",
        "messages": HISTORY,
        "tools": [WEATHER, NOW],
        "tool_choice": {"type": "function", "function": {"name": "now"}},
        "parallel_tool_calls": False,
    }
    assert spec_errors(body, "CreateChatCompletionRequest") == []
    req = decode_chat_completion_request(json.dumps(body))
    assert [t.function.name for t in req.tools or []] == ["get_weather", "now"]
    assert req.tools is not None and req.tools[0].function.strict is True
    assert req.tool_choice == NamedToolChoice(type="function", function=NamedFunction("now"))
    assert req.parallel_tool_calls is False
    assistant = req.messages[2]
    assert assistant.tool_calls is not None
    assert [(c.id, c.function.name) for c in assistant.tool_calls] == [
        ("c1", "get_weather"),
        ("c2", "get_weather"),
    ]
    assert req.messages[6].content is None and req.messages[7].tool_call_id == "c3"
    assert resolve_tool_choice(req) == "now"


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, "none"),
        ({"tools": []}, "none"),
        ({"tools": [NOW]}, "auto"),
        ({"tools": [NOW], "tool_choice": "none"}, "none"),
        ({"tools": [NOW], "tool_choice": "required"}, "required"),
        ({"tool_choice": "none"}, "none"),
        ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}}, "now"),
    ],
)
def test_resolve_tool_choice(fields, expected):
    assert resolve_tool_choice(decode_chat_completion_request(chat(**fields))) == expected


def assistant_calls(*calls: dict, content: str | None = None) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


F = call("c", "f", {})
NAN = '{"a": NaN}'


def fn(name: str, **fields) -> dict:
    return {"type": "function", "function": {"name": name, **fields}}


@pytest.mark.parametrize(
    "fields, param, code",
    [
        # tools
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
         "tools[0].function.name", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
         "tools[0].function.name", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]},
         "tools[0].function.name", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f\n"}}]},
         "tools[0].function.name", "invalid_value"),
        ({"tools": [NOW, WEATHER, NOW]}, "tools[2].function.name", "invalid_value"),
        ({"tools": [fn("f", parameters={"type": "string"})]},
         "tools[0].function.parameters", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
         "tools[0].function.parameters", "invalid_type"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]},
         "tools[0].type", "invalid_value"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
        # tool_choice
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"tool_choice": "auto", "tools": []}, "tool_choice", "invalid_value"),
        ({"tool_choice": {"type": "function", "function": {"name": "now"}}},
         "tool_choice", "invalid_value"),
        ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "later"}}},
         "tool_choice.function.name", "invalid_value"),
        ({"tools": [NOW], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"tools": [NOW], "tool_choice": {"type": "function"}},
         "tool_choice.function", "missing_required_parameter"),
        ({"tools": [NOW], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}},
         "tool_choice.type", "invalid_value"),
        ({"tools": [NOW], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
        # the legacy function calling stays refused
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"function_call": "auto"}, "function_call", "unsupported_value"),
        ({"messages": [*USER_HI, {"role": "function", "name": "f", "content": "1"}]},
         "messages[1].role", "unsupported_value"),
        # calls and results in the history
        ({"messages": [*USER_HI, assistant_calls(F), {"role": "tool", "content": "1"}]},
         "messages[2].tool_call_id", "missing_required_parameter"),
        ({"messages": [*USER_HI, assistant_calls(F),
                       {"role": "tool", "content": "1", "tool_call_id": "other"}]},
         "messages[2].tool_call_id", "invalid_value"),
        ({"messages": [*USER_HI, {"role": "tool", "content": "1", "tool_call_id": "c"},
                       assistant_calls(F)]},
         "messages[1].tool_call_id", "invalid_value"),
        ({"messages": [*USER_HI, assistant_calls(F), {"role": "tool", "tool_call_id": "c"}]},
         "messages[2].content", "missing_required_parameter"),
        ({"messages": [*USER_HI, assistant_calls(
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{'a': 1}"}})]},
         "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        ({"messages": [*USER_HI, assistant_calls(
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}})]},
         "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        ({"messages": [*USER_HI, assistant_calls(
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": NAN}})]},
         "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        ({"messages": [*USER_HI, assistant_calls(
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}})]},
         "messages[1].tool_calls[0].function.arguments", "invalid_value"),
        ({"messages": [*USER_HI, assistant_calls(
            {"id": "c", "type": "function", "function": {"name": "f"}})]},
         "messages[1].tool_calls[0].function.arguments", "missing_required_parameter"),
        ({"messages": [*USER_HI, assistant_calls({"id": "c", "type": "custom", "custom": {}})]},
         "messages[1].tool_calls[0].type", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [F]}]},
         "messages[0].tool_calls", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
         "messages[0].tool_call_id", "invalid_value"),
        ({"messages": [*USER_HI, {"role": "assistant", "content": None}]},
         "messages[1].content", "missing_required_parameter"),
        ({"messages": [*USER_HI, {"role": "assistant", "content": None, "tool_calls": []}]},
         "messages[1].content", "missing_required_parameter"),
    ],
)  # fmt: skip
def test_tool_requests_refused_by_name(fields, param, code):
    err = refused(chat(**fields))
    assert (err.param, err.code) == (param, code), err.message


def test_tool_errors_are_exact():
    err = refused(chat(tools=[{"type": "function", "function": {"name": "get weather"}}]))
    assert err.message == (
        "Invalid 'tools[0].function.name': string does not match pattern. Expected a string "
        "that matches the pattern '^[a-zA-Z0-9_-]{1,64}$', got 'get weather'."
    )
    err = refused(chat(tools=[NOW, NOW]))
    assert err.message == "Duplicate function name 'now' in 'tools': names are unique."
    err = refused(
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
        )
    )
    assert err.message == (
        "Invalid schema for function 'f': 'parameters' must be a JSON Schema of "
        "'type: \"object\"', got 'type: \"array\"'."
    )
    err = refused(chat(tool_choice="required"))
    assert err.message == (
        "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified."
    )
    err = refused(chat(tools=[NOW], tool_choice={"type": "function", "function": {"name": "x"}}))
    assert err.message == "Invalid value for 'tool_choice': function 'x' is not among the 'tools'."
    err = refused(
        chat(
            messages=[
                *USER_HI,
                assistant_calls(F),
                {"role": "tool", "content": "1", "tool_call_id": "d"},
            ]
        )
    )
    assert err.message == (
        "Invalid parameter: messages with role 'tool' must be a response to a preceding message "
        "with 'tool_calls'; no earlier call has the id 'd'."
    )


def test_tokenize_checks_tool_messages_too():
    req = decode_tokenize_request(json.dumps({"messages": HISTORY}))
    assert req.messages is not None and len(req.messages) == len(HISTORY)
    with pytest.raises(ApiError) as info:
        decode_tokenize_request(
            json.dumps(
                {"messages": [*USER_HI, {"role": "tool", "content": "x", "tool_call_id": "c"}]}
            )
        )
    assert info.value.param == "messages[1].tool_call_id"


# --- forced calls ------------------------------------------------------------------------------

TOOLS = msgspec.convert(
    [
        WEATHER,
        NOW,
        {
            "type": "function",
            "function": {
                "name": "book",
                "parameters": {
                    "type": "object",
                    "properties": {"seat": {"$ref": "#/$defs/Seat"}},
                    "required": ["seat"],
                    "additionalProperties": False,
                    "$defs": {"Seat": {"type": "string", "enum": ["aisle", "window"]}},
                },
            },
        },
    ],
    list[ToolDefinition],
)


def test_forced_call_schema_named():
    # An object that lists its properties allows no others (the tool declared none).
    assert forced_call_schema(TOOLS, "get_weather") == {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    assert forced_call_schema(TOOLS, "now") == {"type": "object"}
    schema = forced_call_schema(TOOLS, "book")
    jsonschema.validate({"seat": "aisle"}, schema)
    for bad in ({"seat": "roof"}, {}, [], {"seat": "aisle", "x": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(ApiError) as info:
        forced_call_schema(TOOLS, "later")
    assert info.value.param == "tool_choice.function.name"


def required_alternative(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def test_forced_call_schema_required():
    schema = forced_call_schema(TOOLS, "required")
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                required_alternative(
                    "get_weather",
                    {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                ),
                required_alternative("now", {"type": "object"}),
                required_alternative(
                    "book",
                    {
                        "type": "object",
                        "properties": {"seat": {"$ref": "#/$defs/Seat"}},
                        "required": ["seat"],
                        "additionalProperties": False,
                    },
                ),
            ]
        },
        "$defs": {"Seat": {"type": "string", "enum": ["aisle", "window"]}},
    }
    good = [
        [{"name": "now", "parameters": {}}],
        [
            {"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "book", "parameters": {"seat": "window"}},
        ],
    ]
    bad = [
        [],
        {"name": "now", "parameters": {}},
        [{"name": "later", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],  # its schema requires city
        [{"name": "book", "parameters": {"seat": "roof"}}],
        [{"name": "now"}],
        [{"name": "now", "parameters": {}, "extra": 1}],
    ]
    for value in good:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    single = forced_call_schema(TOOLS, "required", max_calls=1)
    assert single == {**schema, "maxItems": 1}
    jsonschema.validate(good[0], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[1], single)


def test_forced_call_schema_conflicting_defs():
    tools = msgspec.convert(
        [
            fn("a", parameters={"$defs": {"X": {}}}),
            fn("b", parameters={"$defs": {"X": {"type": "string"}}}),
        ],
        list[ToolDefinition],
    )  # fmt: skip
    with pytest.raises(ApiError) as info:
        forced_call_schema(tools, "required")
    assert info.value.param == "tools[1].function.parameters"


def pairs(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_calls_from_forced_output():
    assert pairs(calls_from_forced_output('{"city":"Paris"}', "get_weather")) == [
        ("get_weather", '{"city": "Paris"}')
    ]
    # Cut short: the arguments as written, as OpenAI sends them.
    assert pairs(calls_from_forced_output(' {"city":"Par', "get_weather")) == [
        ("get_weather", '{"city":"Par')
    ]
    text = '[{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"Rome"}}]'
    assert pairs(calls_from_forced_output(text, "required")) == [
        ("now", "{}"),
        ("get_weather", '{"city": "Rome"}'),
    ]
    for text in (
        '[{"name":"now"',
        "{}",
        '[{"parameters":{}}]',
        '[{"name":"f","parameters":[]}]',
        "NaN",
    ):
        assert calls_from_forced_output(text, "required") == []


def test_tool_call_ids_look_like_openai_ones():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", ToolCall("f", "{}").id)


# --- prompts -----------------------------------------------------------------------------------

PREAMBLE = (
    "You can call the following functions, declared in JSON:\n"
    '{"name": "get_weather", "description": "Current weather.", "parameters": {"type": '
    '"object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}\n'
    '{"name": "now"}\n'
    "To call functions, reply with only a Python list of calls, with keyword arguments and "
    "Python literal values, such as [function_name(parameter=value, other=value), "
    "other_function()]. Do not write anything else when you call functions. Their results "
    "come back in ```tool_output blocks. If no function fits, answer normally.\n\n"
)
HISTORY_TEXT = (
    "<start_of_turn>user\nBe brief.\n\n" + PREAMBLE + "Weather in Paris and Rome?<end_of_turn>\n"
    "<start_of_turn>model\nChecking.\n"
    '[get_weather(city="Paris", days=2), get_weather(city="Rome", metric=True, '
    'tags=["a", None], opts={"x": 1.5})]<end_of_turn>\n'
    "<start_of_turn>user\n```tool_output\n18C\n```\n```tool_output\n21C\n```\n"
    "And now?<end_of_turn>\n"
    "<start_of_turn>model\n[now()]<end_of_turn>\n"
    "<start_of_turn>user\n```tool_output\n12:00\n```<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def history_request():
    return decode_chat_completion_request(
        json.dumps({"model": "m", "messages": HISTORY, "tools": [WEATHER, NOW]})
    )


def test_gemma_turns_with_tools_calls_and_results():
    req = history_request()
    assert render_chat_prompt(req.messages, tools=req.tools) == HISTORY_TEXT
    assert render_chat_prompt(req.messages, tools=req.tools, include_bos=True) == (
        "<bos>" + HISTORY_TEXT
    )
    # OpenAI tool dicts serve as well as decoded ones.
    assert render_chat_prompt(req.messages, tools=[WEATHER, NOW]) == HISTORY_TEXT
    # A template that knows no tools (Gemma 3's) is passed over for the same turns.
    for template in (None, GEMMA_FORMAT_TEMPLATE):
        tokenizer = make_tokenizer(template)
        assert render_chat_prompt(req.messages, tokenizer, tools=req.tools) == HISTORY_TEXT


def test_gemma_turns_tools_without_history_and_history_without_tools():
    req = decode_chat_completion_request(chat(tools=[NOW]))
    assert render_gemma_turns(req.messages, tools=req.tools) == (
        "<start_of_turn>user\nYou can call the following functions, declared in JSON:\n"
        '{"name": "now"}\n' + PREAMBLE.split('{"name": "now"}\n')[1] + "hi<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    req = history_request()
    text = render_gemma_turns(req.messages[1:4], add_generation_prompt=False)
    assert text == (
        "<start_of_turn>user\nWeather in Paris and Rome?<end_of_turn>\n"
        "<start_of_turn>model\nChecking.\n"
        '[get_weather(city="Paris", days=2), get_weather(city="Rome", metric=True, '
        'tags=["a", None], opts={"x": 1.5})]<end_of_turn>\n'
        "<start_of_turn>user\n```tool_output\n18C\n```<end_of_turn>\n"
    )


def test_gemma_tool_turns_still_alternate():
    req = history_request()
    with pytest.raises(ApiError) as info:  # two model turns in a row
        render_chat_prompt([*req.messages[:3], req.messages[6]])
    assert (info.value.param, info.value.message) == (
        "messages",
        "Conversation roles must alternate user/assistant/user/assistant/...",
    )
    with pytest.raises(ApiError) as info:
        render_chat_prompt([req.messages[1], req.messages[0]], tools=req.tools)
    assert info.value.param == "messages[1].role"
    with pytest.raises(ApiError) as info:
        render_chat_prompt(req.messages[:1], tools=req.tools)
    assert info.value.message == "The conversation must contain a user message."


def test_python_literal():
    assert (
        python_literal({"a": [1, 2.5, True, None, 'x\n"é']})
        == '{"a": [1, 2.5, True, None, "x\\n\\"é"]}'
    )
    with pytest.raises(TypeError):
        python_literal(object())


# A template that knows tools: it shows what it is given.
TOOLS_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}{% if m.name %}/{{ m.name }}{% endif %}"
    "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.id }} {{ c.type }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}]{% endfor %}"
    "{% if tools %}{tools:{{ tools | tojson }}}{% endif %}"
    "{% if flavour is defined %}({{ flavour }}){% endif %}"
    "{% if add_generation_prompt %}[model]{% endif %}"
)


def test_a_template_that_knows_tools_gets_them_in_transformers_shape():
    tokenizer = make_tokenizer(TOOLS_TEMPLATE)
    req = history_request()
    text = render_chat_prompt(
        req.messages[:5],
        tokenizer,
        tools=req.tools,
        chat_template_kwargs={"flavour": "x", "add_generation_prompt": False, "tools": []},
    )
    assert text == (
        "[system:Be brief.][user:Weather in Paris and Rome?]"
        '[assistant:Checking.<c1 function get_weather {"city": "Paris", "days": 2}>'
        '<c2 function get_weather {"city": "Rome", "metric": true, "tags": ["a", null], '
        '"opts": {"x": 1.5}}>]'
        "[tool/get_weather#c1:  18C  ][tool/get_weather#c2:21C]"
        '{tools:[{"type": "function", "function": {"name": "get_weather", "description": '
        '"Current weather.", "parameters": {"type": "object", "properties": {"city": {"type": '
        '"string"}}, "required": ["city"]}}}, {"type": "function", "function": {"name": "now"}}]}'
        "(x)[model]"
    )
    # Without tools the conversation is the plain one, as before.
    plain = decode_chat_completion_request(chat())
    assert render_chat_prompt(plain.messages, tokenizer) == "[user:hi][model]"


def test_tool_messages_name_their_function_for_the_template():
    tokenizer = make_tokenizer(TOOLS_TEMPLATE)
    req = history_request()
    text = render_chat_prompt(req.messages[6:8], tokenizer, add_generation_prompt=False)
    assert text == "[assistant:<c3 function now {}>][tool/now#c3:12:00]"


def test_template_objects_without_a_string_template_are_trusted():
    calls = []
    tokenizer = SimpleNamespace(
        chat_template=object(),
        bos_token="<bos>",
        apply_chat_template=lambda conv, **kw: calls.append((conv, kw)) or "<bos>x",
    )
    req = history_request()
    assert render_chat_prompt(req.messages[:2], tokenizer, tools=[NOW]) == "x"
    assert calls[0][1] == {"tokenize": False, "add_generation_prompt": True, "tools": [NOW]}


# --- responses ---------------------------------------------------------------------------------


def as_json(struct) -> dict:
    return json.loads(msgspec.json.encode(struct))


def test_chat_completion_with_tool_calls_matches_the_spec():
    response = ChatCompletion(
        id="chatcmpl-1",
        created=1,
        model="m",
        choices=[
            ChatChoice(
                index=0,
                message=ChatResponseMessage(
                    content=None,
                    tool_calls=[
                        ToolCallResponse(
                            id="call_1",
                            function=FunctionCall(
                                name="get_weather", arguments='{"city": "Paris"}'
                            ),
                        )
                    ],
                ),
                finish_reason="tool_calls",
            ),
            ChatChoice(index=1, message=ChatResponseMessage(content="Hi"), finish_reason="stop"),
        ],
        usage=make_usage(3, 4),
    )
    body = as_json(response)
    assert body["choices"][0] == {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    # No tools: the message is as it always was.
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "Hi", "refusal": None}
    validate(body, "CreateChatCompletionResponse")


def test_chat_chunks_with_tool_calls_match_the_spec():
    def chunk(delta: ChatDelta, finish=None) -> dict:
        return as_json(
            ChatCompletionChunk(
                id="chatcmpl-1",
                created=1,
                model="m",
                choices=[ChatChunkChoice(index=0, delta=delta, finish_reason=finish)],
            )
        )

    first = chunk(
        ChatDelta(
            tool_calls=[
                ToolCallChunk(
                    index=0,
                    id="call_1",
                    type="function",
                    function=FunctionCallDelta(name="get_weather", arguments=""),
                )
            ]
        )
    )
    later = chunk(
        ChatDelta(
            tool_calls=[ToolCallChunk(index=0, function=FunctionCallDelta(arguments='{"city"'))]
        )
    )
    last = chunk(ChatDelta(), finish="tool_calls")
    assert first["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ]
    }
    assert later["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]
    }
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    for body in (first, later, last):
        validate(body, "CreateChatCompletionStreamResponse")


def test_closed_objects_closes_every_listed_object_and_nothing_else():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "free": {"type": "object"},
            "list": {"type": "array", "items": {"properties": {"c": {}}}},
            "properties": {"type": "string", "default": {"properties": {}}},
        },
        "$defs": {"D": {"anyOf": [{"properties": {"d": {}}}, {"type": "null"}]}},
    }
    assert closed_objects(schema) == {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "integer"}},
                "additionalProperties": False,
            },
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "free": {"type": "object"},
            "list": {
                "type": "array",
                "items": {"properties": {"c": {}}, "additionalProperties": False},
            },
            # A default is data, not a schema: left as it is.
            "properties": {"type": "string", "default": {"properties": {}}},
        },
        "additionalProperties": False,
        "$defs": {
            "D": {
                "anyOf": [
                    {"properties": {"d": {}}, "additionalProperties": False},
                    {"type": "null"},
                ]
            }
        },
    }
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_bounded_numbers_bounds_numbers_without_their_own_multiple():
    schema = {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "price": {"type": "number", "multipleOf": 0.5},
            "either": {"type": ["number", "null"]},
            "count": {"type": "integer"},
        },
    }
    bounded = bounded_numbers(schema, 2)
    safe = {"minimum": -(2**53 - 1), "maximum": 2**53 - 1}
    assert bounded["properties"] == {
        "score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.01},
        "price": {"type": "number", "multipleOf": 0.5, **safe},
        "either": {"type": ["number", "null"], "multipleOf": 0.01, **safe},
        "count": {"type": "integer", **safe},
    }
    assert bounded_numbers(schema, 0)["properties"]["score"]["multipleOf"] == 1
    jsonschema.validate({"score": 9.25}, bounded)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"score": 9.125}, bounded)
