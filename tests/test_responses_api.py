"""`/v1/responses` driven by the official `openai` client and httpx against the real server:
plain and streamed responses, structured outputs, function calls and their follow-up,
retrieval, deletion, tenants, and requests refused by name. Bodies are validated against
OpenAI's spec (the vendored subset).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam
from pydantic import BaseModel, Field

from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.openapi_schema import validate
from tests.test_tools_clients import WEATHER_PARAMETERS  # the chat tests' tool, flat here

WEATHER_TOOL: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=24)
    role: Literal["engineer", "artist", "doctor"]


@pytest.fixture
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", timeout=300)


def _post(server: RunningServer, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.v1 + "/responses", json=body, headers=headers, timeout=300)


def _body(input_: str | list[Any] = "Say hello.", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_ID, "input": input_, "max_output_tokens": 16, **fields}


def _sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event, after checking the framing: `event:` then `data:`."""
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        events.append((event_line[len("event: ") :], json.loads(data_line[len("data: ") :])))
    return events


def _output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


# --- plain and streamed ------------------------------------------------------------------------


def test_plain_response_matches_the_spec(server: RunningServer, client: openai.OpenAI) -> None:
    raw = _post(server, _body(metadata={"k": "v"}, instructions="Be brief."))
    assert raw.status_code == 200
    body = raw.json()
    validate(body, "Response")
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] in ("completed", "incomplete")
    if body["status"] == "incomplete":
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["usage"]["output_tokens"] == 16
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert body["metadata"] == {"k": "v"} and body["instructions"] == "Be brief."
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["annotations"] == []
    # The client's output_text convenience reads the same text; GET returns the same object.
    assert client.responses.retrieve(body["id"]).output_text == _output_text(body)
    assert httpx.get(f"{server.v1}/responses/{body['id']}").json() == body


def test_stream_events_in_order_and_deltas_make_the_text(server: RunningServer) -> None:
    raw = _post(server, _body("Count to three.", stream=True))
    assert raw.status_code == 200
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = _sse(raw.content)
    for name, data in events:
        assert data["type"] == name
        validate(data, "ResponseStreamEvent")
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    names = [name for name, _ in events]
    last = names[-1]
    assert last in ("response.completed", "response.incomplete")
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", last,
    ]  # fmt: skip
    final = events[-1][1]["response"]
    text = "".join(d["delta"] for d in deltas)
    assert text == _output_text(final) == events[-4][1]["text"]
    assert events[0][1]["response"]["status"] == "in_progress"
    assert events[-2][1]["item"]["content"][0]["text"] == text


def test_official_client_streams(client: openai.OpenAI) -> None:
    stream = client.responses.create(
        model=MODEL_ID, input="Say hi.", max_output_tokens=16, stream=True
    )
    events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == text
    # The helper accumulates the same events into its snapshot.
    with client.responses.stream(model=MODEL_ID, input="Say hi.", max_output_tokens=16) as helper:
        streamed = list(helper)
    last = streamed[-1]
    assert streamed[0].type == "response.created"
    assert last.type == "response.completed" or last.type == "response.incomplete"
    snapshots = [e.snapshot for e in streamed if e.type == "response.output_text.delta"]
    assert snapshots and snapshots[-1] == last.response.output_text


# --- structured outputs and tools --------------------------------------------------------------


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_ID,
        input="Describe a person as JSON.",
        max_output_tokens=64,
        text={
            "format": {
                "type": "json_schema",
                "name": "person",
                "schema": PERSON_SCHEMA,
                "strict": True,
            }
        },
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON_SCHEMA)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    parsed = client.responses.parse(
        model=MODEL_ID, input="Describe a person.", max_output_tokens=64, text_format=Person
    )
    assert isinstance(parsed.output_parsed, Person)


def test_required_function_call_then_its_output_chained(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL_ID, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
        # One call, greedy, with room to finish it: up to MAX_TOOL_CALLS sampled calls could
        # outrun the budget and end as `incomplete` with no call.
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=128,
    )  # fmt: skip
    validate(raw.http_response.json(), "Response")
    first = raw.parse()
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        assert call.call_id.startswith("call_") and call.status == "completed"
    follow_up = client.responses.create(
        model=MODEL_ID, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature": 21}'}],
        max_output_tokens=16,
    )  # fmt: skip
    assert follow_up.previous_response_id == first.id
    assert follow_up.usage is not None and first.usage is not None
    assert follow_up.usage.input_tokens > first.usage.input_tokens
    assert follow_up.usage.input_tokens_details.cached_tokens > 0


def test_named_function_streams_its_arguments(server: RunningServer) -> None:
    raw = _post(
        server,
        _body("Weather in Oslo?", max_output_tokens=64, stream=True, tools=[WEATHER_TOOL],
              tool_choice={"type": "function", "name": "get_weather"}),
    )  # fmt: skip
    assert raw.status_code == 200
    events = _sse(raw.content)
    for _, data in events:
        validate(data, "ResponseStreamEvent")
    deltas = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    (done,) = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert done["arguments"] == deltas and done["name"] == "get_weather"
    jsonschema.validate(json.loads(deltas), WEATHER_PARAMETERS)
    final = events[-1][1]["response"]
    assert final["tool_choice"] == {"type": "function", "name": "get_weather"}
    (call,) = final["output"]
    assert call["type"] == "function_call" and call["arguments"] == deltas


def test_input_items_messages_and_echoed_calls(server: RunningServer) -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome", "unit": "celsius"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    raw = _post(server, _body(items, tools=[WEATHER_TOOL], tool_choice="none"))
    assert raw.status_code == 200, raw.text
    listed = httpx.get(f"{server.v1}/responses/{raw.json()['id']}/input_items?order=asc").json()
    validate(listed, "ResponseItemList")
    assert [item["type"] for item in listed["data"]] == [
        "message", "message", "message", "function_call", "function_call_output"
    ]  # fmt: skip
    assert listed["first_id"] == listed["data"][0]["id"] and not listed["has_more"]


# --- stored responses --------------------------------------------------------------------------


def test_delete_then_gone(server: RunningServer, client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_ID, input="Hi", max_output_tokens=16)
    deleted = httpx.request(
        "DELETE", f"{server.v1}/responses/{response.id}",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert deleted.status_code == 200
    assert deleted.json() == {"id": response.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    validate(missing.value.response.json(), "ErrorResponse")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError) as chained:
        client.responses.create(
            model=MODEL_ID, input="Hi", previous_response_id=response.id, max_output_tokens=16
        )
    error = chained.value.response.json()["error"]
    assert error["param"] == "previous_response_id"
    assert error["message"] == f"Previous response with id '{response.id}' not found."


def test_store_false_is_neither_retrievable_nor_chainable(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_ID, input="Hi", store=False, max_output_tokens=16
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=MODEL_ID, input="Hi", previous_response_id=response.id, max_output_tokens=16
        )


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("responses-keys"),
        API_KEYS="alice:key-a,bob:key-b",
        RESPONSES_MAX_STORED_PER_TENANT="2",
    )
    yield running
    stop_server(running)


def test_tenants_see_only_their_own_and_quota_evicts_oldest(keyed: RunningServer) -> None:
    alice = openai.OpenAI(base_url=keyed.v1, api_key="key-a", timeout=300)
    bob = openai.OpenAI(base_url=keyed.v1, api_key="key-b", timeout=300)
    ids = [
        alice.responses.create(model=MODEL_ID, input=f"Hi {i}", max_output_tokens=16).id
        for i in range(3)
    ]
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(ids[2])
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(ids[2])
    with pytest.raises(openai.BadRequestError):
        bob.responses.create(
            model=MODEL_ID, input="Hi", previous_response_id=ids[2], max_output_tokens=16
        )
    assert alice.responses.retrieve(ids[2]).id == ids[2]
    # Two per tenant: the least recently used went.
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(ids[0])
    assert alice.responses.retrieve(ids[1]).id == ids[1]


# --- refused by name ---------------------------------------------------------------------------

REFUSED = [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    (
        {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
        "input[0].call_id",
    ),
    ({"max_output_tokens": 5}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "other"}},
        "tool_choice.name",
    ),
    ({"tools": [{**WEATHER_TOOL, "name": "bad name"}]}, "tools[0].name"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": None}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"temperature": 3}, "temperature"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_refused_with_400_naming_the_field(
    server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    raw = _post(server, _body(**fields))
    assert raw.status_code == 400, raw.text
    validate(raw.json(), "ErrorResponse")
    assert raw.json()["error"]["param"] == param


def test_unknown_model_and_id_are_404(server: RunningServer) -> None:
    raw = _post(server, _body(model="gpt-unknown"))
    assert raw.status_code == 404 and raw.json()["error"]["param"] == "model"
    missing = httpx.get(server.v1 + "/responses/resp_nothing")
    assert missing.status_code == 404
    validate(missing.json(), "ErrorResponse")
