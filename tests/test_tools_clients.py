"""Tool calling and structured outputs as the libraries people use drive them: the official
`openai` client, LangChain's `ChatOpenAI` and `instructor`, against the real server and the
embedded 270M model.

A base model this small rarely writes a tool call or JSON on its own; what these tests show is
that grammar-constrained decoding makes every forced call and every structured output valid
against its schema (checked with `jsonschema` and pydantic, never with the server's code), in
the shapes the libraries parse.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import instructor
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.conftest import MODEL_ID, RunningServer
from tests.openapi_schema import validate

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "artist", "doctor"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON: name, age and role."}]


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "artist", "doctor"]


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def compact(text: str) -> bool:
    """No whitespace outside JSON strings (the server's default JSON form)."""
    return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


# ------------------------------------------------------------------ the official client


def test_json_object_response_format(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_ID, messages=ASK_PERSON, response_format={"type": "json_object"},
        max_tokens=200, temperature=0,
    )  # fmt: skip
    validate(response.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    [choice] = response.choices
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert choice.finish_reason == "length"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_response_format_is_valid(client: openai.OpenAI, seed: int) -> None:
    response = client.chat.completions.create(
        model=MODEL_ID, messages=ASK_PERSON, max_tokens=120, temperature=1, seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )  # fmt: skip
    [choice] = response.choices
    assert choice.finish_reason == "stop"  # every string and number of this schema is bounded
    content = choice.message.content or ""
    jsonschema.validate(json.loads(content), PERSON_SCHEMA)
    assert compact(content)


def test_json_schema_stream_is_the_same_json(client: openai.OpenAI) -> None:
    body = dict(
        model=MODEL_ID, messages=ASK_PERSON, max_tokens=120, temperature=0,
        response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        },
    )  # fmt: skip
    whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**body, stream=True))  # type: ignore[call-overload]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), PERSON_SCHEMA)


def test_invalid_schema_is_a_400_naming_response_format(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_ID, messages=ASK_PERSON, max_tokens=10,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "object", "properties": 3}},
            },
        )  # fmt: skip
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]


def test_schema_that_cannot_finish_ends_with_length(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_ID, messages=ASK_PERSON, max_tokens=3, temperature=0,
        response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        },
    )  # fmt: skip
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_is_schema_valid(client: openai.OpenAI, choice: str) -> None:
    tool_choice = (
        "required" if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
        tool_choice=tool_choice, max_tokens=120, temperature=1, seed=3,  # type: ignore[arg-type]
    )  # fmt: skip
    validate(response.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionResponse")
    [c] = response.choices
    assert c.finish_reason == "tool_calls"
    calls = c.message.tool_calls or []
    assert calls and c.message.content is None
    schemas = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_TOOL["function"]["parameters"]}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        if choice == "named":
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_call_chunks_validate_and_fold_into_the_call(
    client: openai.OpenAI,
) -> None:
    body = dict(
        model=MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER_TOOL], max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
    )  # fmt: skip
    whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
    stream = client.chat.completions.create(**body, stream=True)  # type: ignore[call-overload]
    chunks = list(stream)
    name, arguments, call_ids = None, "", set()
    for chunk in chunks:
        validate(chunk.model_dump(mode="json", exclude_unset=True),
                 "CreateChatCompletionStreamResponse")  # fmt: skip
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            name = call.function.name or name if call.function else name
            arguments += (call.function.arguments or "") if call.function else ""
            if call.id:
                call_ids.add(call.id)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    [call] = whole.choices[0].message.tool_calls or []
    assert (name, arguments) == (call.function.name, call.function.arguments)
    assert len(call_ids) == 1
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


def test_tool_results_in_the_history_are_served(client: openai.OpenAI) -> None:
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    response = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=16,  # type: ignore[arg-type, list-item]
        temperature=0,
    )  # fmt: skip
    [c] = response.choices
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    # Streamed, `auto` releases what is no call as content chunks (the reply may differ in its
    # last bits: this prompt is now cached, and the default kernels follow the batch shape).
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=messages, tools=[WEATHER_TOOL], max_tokens=16,  # type: ignore[arg-type, list-item]
        temperature=0, stream=True,
    )  # fmt: skip
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert any(d.content or d.tool_calls for d in deltas)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


# ------------------------------------------------------------------ LangChain


def langchain_model(server: RunningServer) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.v1, api_key="unused", model=MODEL_ID, temperature=0,  # type: ignore[arg-type]
        max_tokens=120, max_retries=0, timeout=300,
    )  # fmt: skip


def test_langchain_with_structured_output_returns_the_model(server: RunningServer) -> None:
    structured = langchain_model(server).with_structured_output(Person, method="json_schema")
    person = structured.invoke("Describe a person: name, age and role.")
    assert isinstance(person, Person)


def test_langchain_bind_tools_returns_a_valid_call(server: RunningServer) -> None:
    model = langchain_model(server).bind_tools([GetWeather], tool_choice="GetWeather")
    message = model.invoke("What is the weather in Paris?")
    [call] = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])


# ------------------------------------------------------------------ instructor


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_returns_the_model(client: openai.OpenAI, mode: instructor.Mode) -> None:
    patched = instructor.from_openai(client, mode=mode)
    person = patched.chat.completions.create(
        model=MODEL_ID, response_model=Person, max_retries=0, max_tokens=120, temperature=0,
        messages=ASK_PERSON,  # type: ignore[arg-type]
    )  # fmt: skip
    assert isinstance(person, Person)
