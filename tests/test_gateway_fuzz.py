"""The OpenAPI document at /schema describes our bodies exactly, and Schemathesis fuzzes every
operation in it against a real server: no 5xx, responses as declared, the server alive after.

The fuzzing run is bounded (MAX_EXAMPLES cases per operation, the same each run) and its server
keeps generation short: a tiny KV cache refuses large `max_tokens` and `n` at once, and what is
served is a few dozen tokens at most, so the whole run takes under a minute on two cores.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate as validate_openapi
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import openapi_document
from compat.errors import ApiError
from compat.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_completion_request,
    decode_completion_request,
)
from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.gateway_helpers import chat_body, completion_body

SCHEMA_PATH = "/schema/openapi.json"
MAX_EXAMPLES = 100  # per operation
BODY_PATHS = (
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/api/loadgen/start",
)  # fmt: skip


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    """The document /schema/openapi.json serves (built without a model or a server)."""
    return openapi_document()


def request_schema(spec: dict[str, Any], path: str) -> dict[str, Any]:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_schema_is_valid_openapi_3_1(spec: dict[str, Any]) -> None:
    assert spec["openapi"].startswith("3.1")
    validate_openapi(spec)
    for path in BODY_PATHS:
        assert spec["paths"][path]["post"]["requestBody"]["required"] is True, path
    for item in spec["paths"].values():
        for op in item.values():
            assert "default" in op["responses"], op["operationId"]  # the error shape


@pytest.mark.parametrize(
    ("path", "type_"),
    [("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)],
)
def test_request_schema_lists_exactly_the_fields_we_decode(
    spec: dict[str, Any], path: str, type_: type[msgspec.Struct]
) -> None:
    schema = request_schema(spec, path)
    info = msgspec.inspect.type_info(type_)
    assert isinstance(info, msgspec.inspect.StructType)
    assert set(schema["properties"]) == {f.encode_name for f in info.fields}
    assert set(schema["required"]) == {f.encode_name for f in info.fields if f.required}
    # Unknown fields are accepted and ignored (UNKNOWN_FIELDS=ignore, the fuzz server's).
    assert "additionalProperties" not in schema


# Bodies on both sides of the schema's constraints: the schema and the decoder agree on each.
# (Rules across fields, e.g. top_logprobs needing logprobs, are the decoder's alone.)
SHAPES = [
    ("/v1/chat/completions", decode_chat_completion_request, body)
    for body in (
        chat_body(),
        chat_body(temperature=2, n=128, stop=["a"] * 16, logit_bias={"1": -100}),
        chat_body(temperature=2.5),
        chat_body(n=0),
        chat_body(n=129),
        chat_body(stop=["a"] * 17),
        chat_body(stop="x" * 257),
        chat_body(logit_bias={str(i): 1 for i in range(301)}),
        chat_body(max_tokens=0),
        chat_body(seed=2**63),
        chat_body(top_logprobs=21, logprobs=True),
        chat_body(bogus=1),
        {"model": MODEL_ID, "messages": []},
        {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": []}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "x", "extra": 1}]},
        {"messages": [{"role": "user", "content": "x"}]},
        {"model": MODEL_ID, "messages": [{"role": "function", "content": "x", "name": "f"}]},
        {
            "model": MODEL_ID,
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "1", "tool_call_id": "c"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
        },
        chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="maybe"),
        chat_body(tools=[{"type": "custom", "custom": {"name": "f"}}]),
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        {"model": MODEL_ID, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        },
        chat_body(metadata={"a": "b"}),
        chat_body(metadata=None, audio=None),
    )
] + [
    ("/v1/completions", decode_completion_request, body)
    for body in (
        completion_body(),
        completion_body([[1, 2], [3]], logprobs=5, best_of=2, n=2),
        completion_body(None),
        completion_body([-1]),
        completion_body(logprobs=6),
        completion_body(top_p=1.01),
        completion_body(repetition_penalty=0),
        completion_body(top_k=-2),
        completion_body(stream=True, stream_options={"include_usage": True, "x": 1}),
        {"model": MODEL_ID},
    )
]


@pytest.mark.parametrize(("path", "decode", "body"), SHAPES)
def test_request_schema_accepts_what_the_decoder_accepts(
    spec: dict[str, Any], path: str, decode: Callable[[bytes], object], body: dict[str, Any]
) -> None:
    by_schema = jsonschema.Draft202012Validator(request_schema(spec, path)).is_valid(body)
    try:
        decode(json.dumps(body).encode())
        by_decoder = True
    except ApiError as exc:
        assert exc.status == 400
        by_decoder = False
    assert by_schema == by_decoder


# ------------------------------------------------------------------ Schemathesis


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("fuzz"),
        # A handful of KV blocks: most generated max_tokens and n are refused at once (400),
        # and what is admitted ends within a few dozen tokens.
        MAX_ACTIVE_KV_TOKENS="64",
        OMP_NUM_THREADS="1",  # a 2-thread team sharing a core with the fuzzer stalls
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: RunningServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(fuzz_server.base_url + SCHEMA_PATH)


def _operations() -> list[tuple[str, str]]:
    """(method, path) of every documented operation, read without a server."""
    paths = openapi_document()["paths"]
    return [
        (method.upper(), path)
        for path, item in paths.items()
        for method in item
        # A valid start request runs the load generator for up to a day; its validation is
        # covered by tests/test_loadgen.py.
        if path != "/api/loadgen/start"
    ]


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    # The schema is the decoders' own: whatever violates it must be refused.
    negative_data_rejection,
]


@pytest.mark.parametrize(("method", "path"), _operations())
def test_fuzz_operation(
    fuzz_server: RunningServer, api_schema: schemathesis.BaseSchema, method: str, path: str
) -> None:
    operation = api_schema[path][method]
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    # Most generated model names are unknown, a 404 before anything else is looked at: half
    # the cases name the served model, so they reach validation and generation.
    @given(case=cases, our_model=st.booleans())
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same cases every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    def fuzz(case: schemathesis.Case, our_model: bool) -> None:
        if our_model and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body = {**case.body, "model": MODEL_ID}
        case.call_and_validate(base_url=fuzz_server.base_url, checks=CHECKS, timeout=60)

    fuzz()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(stream=True, max_tokens=4)),
        ("/v1/completions", completion_body(stream=True, max_tokens=4)),
        (
            "/v1/responses",
            {"model": MODEL_ID, "input": "Hi", "stream": True, "max_output_tokens": 16},
        ),
    ],
)
def test_streams_conform_to_the_documented_event_schema(
    fuzz_server: RunningServer, api_schema: schemathesis.BaseSchema, path: str, body: dict[str, Any]
) -> None:
    """The fuzzer meets a served stream only now and then; every stream is checked here."""
    case = api_schema[path]["POST"].Case(body=body)
    response = case.call_and_validate(base_url=fuzz_server.base_url, checks=CHECKS, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"][0].startswith("text/event-stream")
    assert b"data: " in response.content


def test_server_alive_after_fuzzing(fuzz_server: RunningServer) -> None:
    assert fuzz_server.process.poll() is None
    health = httpx.get(fuzz_server.base_url + "/health", timeout=30)
    assert health.status_code == 200, health.text
    log = fuzz_server.log()
    at = log.find("unhandled error")
    assert at < 0, log[max(0, at - 2000) : at + 4000]  # the request before it and the traceback
