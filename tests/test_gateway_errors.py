"""Errors over HTTP: OpenAI-shaped bodies with the right status, parameter and code; never a
500 for bad input. A second server with tight settings shows 401 (API keys), 413 (body size),
429 with Retry-After (a full queue) and request ids in its JSON log lines."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.gateway_helpers import api_metrics, chat_body, completion_body, wait_until
from tests.openapi_schema import validate

TIMEOUT = httpx.Timeout(300.0)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def send(server: RunningServer, path: str, body: object, **kwargs) -> httpx.Response:
    """POST `body`: bytes as they are, anything else as JSON."""
    if isinstance(body, bytes):
        kwargs.setdefault("headers", {}).setdefault("content-type", "application/json")
        return httpx.post(server.base_url + path, content=body, timeout=TIMEOUT, **kwargs)
    return httpx.post(server.base_url + path, json=body, timeout=TIMEOUT, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    """The `error` object of an OpenAI-shaped error response with `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    validate(body, "ErrorResponse")
    return body["error"]


# ------------------------------------------------------------------ 400: naming the parameter

BAD_REQUESTS = [
    # (id, path, body, param, code)
    ("temperature too high", CHAT, chat_body(temperature=5), "temperature", "invalid_value"),
    ("temperature a string", CHAT, chat_body(temperature="hot"), "temperature", "invalid_type"),
    ("bad tool name", CHAT, chat_body(tools=[{"type": "function", "function": {"name": "a b"}}]),
     "tools[0].function.name", "invalid_value"),
    ("tool_choice without tools", CHAT, chat_body(tool_choice="required"), "tool_choice",
     "invalid_value"),
    ("unknown response_format", CHAT, chat_body(response_format={"type": "xml"}),
     "response_format.type", "invalid_value"),
    ("schema that does not compile", CHAT, chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 3}}}),
     "response_format", "invalid_value"),
    ("regex that does not compile", COMPLETIONS,
     {"model": MODEL_ID, "prompt": "x", "structured_outputs": {"regex": "(a"}},
     "structured_outputs.regex", "invalid_value"),
    ("forced tool call with response_format", CHAT, chat_body(
        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
        response_format={"type": "json_object"}), "tool_choice", "invalid_value"),
    ("image part", CHAT,
     {"model": MODEL_ID, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0].type", "unsupported_value"),
    ("tool result answering no call", CHAT,
     {"model": MODEL_ID, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
     "messages[0].tool_call_id", "invalid_value"),
    ("unknown role", CHAT, {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role", "invalid_value"),
    ("no messages", CHAT, {"model": MODEL_ID, "messages": []}, "messages", "invalid_value"),
    ("messages a string", CHAT, {"model": MODEL_ID, "messages": "hi"}, "messages", "invalid_type"),
    ("missing model", CHAT, {"messages": [{"role": "user", "content": "x"}]},
     "model", "missing_required_parameter"),
    ("model not a string", COMPLETIONS, {"model": 5, "prompt": "x"}, "model", "invalid_type"),
    ("chat context length", CHAT, chat_body(max_tokens=40000),
     "max_tokens", "context_length_exceeded"),
    ("chat context length (new name)", CHAT, chat_body(max_completion_tokens=40000),
     "max_completion_tokens", "context_length_exceeded"),
    ("completion context length", COMPLETIONS, completion_body(max_tokens=40000),
     "max_tokens", "context_length_exceeded"),
    ("huge n", CHAT, chat_body(n=100000), "n", "invalid_value"),
    ("zero n", COMPLETIONS, completion_body(n=0), "n", "invalid_value"),
    ("negative max_tokens", COMPLETIONS, completion_body(max_tokens=-1), "max_tokens",
     "invalid_value"),
    ("fractional max_tokens", CHAT, chat_body(max_tokens=1.5), "max_tokens", "invalid_type"),
    ("fractional seed", CHAT, chat_body(seed=1.5), "seed", "invalid_type"),
    ("top_p too high", COMPLETIONS, completion_body(top_p=1.5), "top_p", "invalid_value"),
    ("too many logprobs", COMPLETIONS, completion_body(logprobs=6), "logprobs", "invalid_value"),
    ("top_logprobs alone", CHAT, chat_body(top_logprobs=2), "top_logprobs", "invalid_value"),
    ("stop not strings", CHAT, chat_body(stop=[1, 2]), "stop[0]", "invalid_type"),
    ("empty stop string", COMPLETIONS, completion_body(stop=[""]), "stop", "invalid_value"),
    ("logit_bias key", CHAT, chat_body(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
    ("stream_options without stream", COMPLETIONS,
     completion_body(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    ("negative token id", COMPLETIONS, completion_body([-1]), "prompt[0]", "invalid_value"),
    ("token id past the vocabulary", COMPLETIONS, completion_body([10**9]), "prompt",
     "invalid_value"),
    ("empty prompt list", COMPLETIONS, completion_body([]), "prompt", "invalid_value"),
    ("mixed prompt list", COMPLETIONS, completion_body(["a", 1]), "prompt", "invalid_value"),
    ("more prompts than the queue holds", COMPLETIONS, completion_body(["x"] * 300),
     "prompt", "invalid_value"),
    ("suffix", COMPLETIONS, completion_body(suffix="x"), "suffix", "unsupported_parameter"),
    ("min_tokens over max_tokens", COMPLETIONS, completion_body(max_tokens=2, min_tokens=5),
     "min_tokens", "invalid_value"),
    ("malformed JSON", CHAT, b'{"model": ', None, "invalid_json"),
    ("empty body", CHAT, b"", None, "invalid_json"),
    ("not JSON at all", COMPLETIONS, b"model=gemma", None, "invalid_json"),
    ("body an array", CHAT, b"[]", None, "invalid_type"),
    ("body null", COMPLETIONS, b"null", None, "invalid_type"),
    ("tokenize neither", "/tokenize", {"model": MODEL_ID}, "prompt", "invalid_value"),
    ("detokenize bad id", "/detokenize", {"tokens": [-5]}, "tokens[0]", "invalid_value"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_request_names_the_parameter(
    server: RunningServer, path: str, body: object, param: str | None, code: str
) -> None:
    error = error_of(send(server, path, body), 400)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"]


def test_context_length_message_gives_the_numbers(server: RunningServer) -> None:
    error = error_of(send(server, COMPLETIONS, completion_body("Hello", max_tokens=40000)), 400)
    assert "32768" in error["message"] and "40000" in error["message"]


# ------------------------------------------------------------------ 404, 405


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, chat_body()), (COMPLETIONS, completion_body())],
    ids=["chat", "completions"],
)
def test_unknown_model_is_404(server: RunningServer, path: str, body: dict) -> None:
    error = error_of(send(server, path, body | {"model": "gpt-4o"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "gpt-4o" in error["message"]


def test_unknown_model_retrieve_is_404(server: RunningServer) -> None:
    error = error_of(httpx.get(server.v1 + "/models/gpt-4o", timeout=30), 404)
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nope"), ("POST", "/v1/engines/x")])
def test_unknown_route_is_404(server: RunningServer, method: str, path: str) -> None:
    error = error_of(httpx.request(method, server.base_url + path, timeout=30), 404)
    assert error["code"] == "not_found" and path in error["message"]


def test_wrong_method_is_405(server: RunningServer) -> None:
    response = httpx.get(server.base_url + CHAT, timeout=30)
    error_of(response, 405)
    assert "POST" in response.headers["allow"]


# ------------------------------------------------------------------ never 500 for bad input


def _with_model(fields: str) -> bytes:
    """A raw JSON body naming our model, then `fields` verbatim (they may be invalid JSON)."""
    return f'{{"model": "{MODEL_ID}", {fields}}}'.encode()


USER_X = '"messages": [{"role": "user", "content": "x"}]'
NASTY_BODIES = [
    b"\xff\xfe\x00garbage",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": null, "prompt": null}',
    _with_model('"messages": [{"role": "user", "content": "\\ud800"}]'),
    _with_model('"prompt": [[1, 2], ["a"]]'),
    _with_model('"prompt": [[]]'),
    _with_model('"prompt": "x", "max_tokens": 1e400'),
    _with_model('"prompt": "x", "max_tokens": 99999999999999999999999'),
    _with_model('"prompt": "x", "temperature": NaN'),
    _with_model('"prompt": "x", "logit_bias": {"-1": 1}'),
    _with_model('"prompt": "x", "stop_token_ids": [999999999]'),
    _with_model('"messages": [{"role": "user", "content": [{"type": "text"}]}]'),
    _with_model('"messages": [{"role": "assistant", "content": "x"}]'),
    _with_model('"messages": [{"role": "system", "content": "x"}]'),
    _with_model('"messages": [{"role": "user"}]'),
    _with_model(USER_X + ', "n": 1, "n": "two"'),
    _with_model(USER_X + ', "max_tokens": true'),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize", "/detokenize"])
def test_bad_input_is_never_a_server_error(server: RunningServer, path: str) -> None:
    # /tokenize and /detokenize ignore the generation fields they do not know (UNKNOWN_FIELDS).
    lenient = path in ("/tokenize", "/detokenize")
    for body in NASTY_BODIES:
        response = send(server, path, body)
        if lenient and response.status_code == 200:
            continue
        assert 400 <= response.status_code < 500, (body[:120], response.text)
        validate(response.json(), "ErrorResponse")


def test_odd_but_valid_requests_succeed(server: RunningServer) -> None:
    """Inputs at the edges of what is allowed are served, not refused and not crashed on."""
    ok = [
        (COMPLETIONS, completion_body("", max_tokens=1)),
        (COMPLETIONS, completion_body(None, max_tokens=1)),
        (COMPLETIONS, completion_body([[2, 651], [2]], max_tokens=1, temperature=0)),
        (COMPLETIONS, completion_body("x", max_tokens=1, seed=-(2**63), priority=10**30)),
        (CHAT, chat_body("\u0000 ünïcödé ✓ 🙂", max_tokens=1, stop=["a"] * 8)),
        (CHAT, chat_body(max_tokens=1, top_k=10**9, logit_bias={"1": -100})),
    ]
    for path, body in ok:
        response = send(server, path, body)
        assert response.status_code == 200, (body, response.text)


# ------------------------------------------------------------------ a server with tight limits

KEYS = "alice:key-alice,key-bob"  # `name:key` names the tenant; the bare key's is "key-2"
BODY_LIMIT = 4096
KV_TOKENS = 4096  # far less than the 32768-token context
BLOCK_SIZE = 16  # KV_BLOCK_SIZE's default


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("tight"),
        API_KEYS=KEYS,
        MAX_BODY_BYTES=str(BODY_LIMIT),
        MAX_QUEUE_LEN="1",
        MAX_BATCH_SIZE="1",
        LOG_FORMAT="json",
        MAX_ACTIVE_KV_TOKENS=str(KV_TOKENS),
    )
    yield running
    stop_server(running)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        (bearer("key-mallory"), "invalid_api_key"),
        ({"Authorization": "Basic key-alice"}, "missing_api_key"),
        ({"Authorization": "Bearer"}, "missing_api_key"),
        (bearer("alice"), "invalid_api_key"),  # the tenant's name is not its key
    ],
    ids=["missing", "wrong", "wrong scheme", "empty", "name instead of key"],
)
def test_missing_or_wrong_key_is_401(tight: RunningServer, headers: dict, code: str) -> None:
    for response in (
        send(tight, CHAT, chat_body(max_tokens=1), headers=headers),
        httpx.get(tight.v1 + "/models", headers=headers, timeout=30),
    ):
        error = error_of(response, 401)
        assert error["code"] == code
        assert "key-alice" not in response.text


def test_valid_keys_work_and_name_the_tenant(tight: RunningServer) -> None:
    response = send(
        tight, CHAT, chat_body(max_tokens=2, ignore_eos=True, user="mallory"),
        headers=bearer("key-alice"),
    )  # fmt: skip
    assert response.status_code == 200, response.text
    models = httpx.get(tight.v1 + "/models", headers=bearer("key-bob"), timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_ID
    tenants = api_metrics(tight.base_url)["scheduler"]["tenants"]
    assert tenants["alice"]["output_tokens"] == 2  # the key names the tenant, not `user`
    assert "mallory" not in tenants


def test_ops_routes_stay_open_by_default_with_keys(tight: RunningServer) -> None:
    """OPS_AUTH defaults to none: scrapers and the dashboard read metrics without a key, as with
    vLLM, while driving the load generator still needs one."""
    for path in ("/metrics", "/api/metrics", "/api/loadgen/status", "/health"):
        assert httpx.get(tight.base_url + path, timeout=30).status_code == 200, path
    start = httpx.post(tight.base_url + "/api/loadgen/start", json={"num_requests": 1}, timeout=30)
    assert error_of(start, 401)["code"] == "missing_api_key"


def test_body_too_large_is_413(tight: RunningServer) -> None:
    big = chat_body("x" * BODY_LIMIT, max_tokens=1)
    error = error_of(send(tight, CHAT, big, headers=bearer("key-alice")), 413)
    assert error["code"] == "request_too_large" and str(BODY_LIMIT) in error["message"]

    def chunked():  # no Content-Length: the limit holds while the body streams in
        yield b'{"model": "' + MODEL_ID.encode() + b'", "prompt": "'
        for _ in range(BODY_LIMIT // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'

    response = httpx.post(
        tight.v1 + "/completions", content=chunked(), timeout=TIMEOUT,
        headers=bearer("key-alice") | {"content-type": "application/json"},
    )  # fmt: skip
    assert error_of(response, 413)["code"] == "request_too_large"


async def test_full_queue_is_429_with_retry_after(tight: RunningServer) -> None:
    """One running + one waiting fill the server; the rest are refused at once, and every
    accepted request still completes in full."""
    rejected_before = api_metrics(tight.base_url)["scheduler"]["rejected"].get("overloaded", 0)
    body = completion_body(max_tokens=6, ignore_eos=True, temperature=0)
    async with httpx.AsyncClient(timeout=TIMEOUT, headers=bearer("key-bob")) as client:
        responses = await asyncio.gather(
            *(client.post(tight.v1 + "/completions", json=body) for _ in range(6))
        )
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 1, statuses
    for response in responses:
        if response.status_code == 429:
            error = error_of(response, 429)
            assert error["code"] == "rate_limit_exceeded"
            assert int(response.headers["retry-after"]) >= 1
        else:
            completion = response.json()
            assert completion["usage"]["completion_tokens"] == 6
            assert completion["choices"][0]["finish_reason"] == "length"
    rejected = api_metrics(tight.base_url)["scheduler"]["rejected"].get("overloaded", 0)
    assert rejected - rejected_before == statuses.count(429)


def test_more_choices_than_the_queue_holds_is_400_not_429(tight: RunningServer) -> None:
    response = send(tight, CHAT, chat_body(max_tokens=1, n=2), headers=bearer("key-alice"))
    error = error_of(response, 400)  # a 429 would have the client retry forever
    assert (error["param"], error["code"]) == ("n", "invalid_value")


def test_unset_max_tokens_fits_a_small_kv_cache(tight: RunningServer) -> None:
    """A chat without max_tokens gets "the rest of the context" only as far as the KV cache
    holds it, instead of a 400 for a length the client never asked for."""
    body = chat_body(stream=True, temperature=0)
    with httpx.stream(
        "POST", tight.v1 + "/chat/completions", json=body, headers=bearer("key-alice"),
        timeout=TIMEOUT,
    ) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        first = next(response.iter_lines())
        assert first.startswith("data: ") and '"role":"assistant"' in first
    # MAX_ACTIVE_KV_TOKENS is a memory budget: sliding-window layers take only their window, so
    # one request's context (the pages left once its sliding layers hold a window) exceeds it.
    capacity = api_metrics(tight.base_url)["kv"]["max_blocks_per_sequence"] * BLOCK_SIZE
    assert KV_TOKENS < capacity < 32768
    too_long = chat_body(max_tokens=capacity + 100)
    error = error_of(send(tight, CHAT, too_long, headers=bearer("key-alice")), 400)
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert str(capacity) in error["message"]
    assert wait_until(lambda: api_metrics(tight.base_url)["scheduler"]["num_running"] == 0)


def _json_log_lines(log_path: Path) -> list[dict]:
    lines = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_log_lines_carry_the_request_id(tight: RunningServer) -> None:
    served = send(
        tight, COMPLETIONS, completion_body(max_tokens=2),
        headers=bearer("key-alice") | {"X-Request-Id": "req-served-1"},
    )  # fmt: skip
    assert served.status_code == 200
    refused = send(tight, COMPLETIONS, completion_body(), headers={"X-Request-Id": "req-refused-1"})
    assert refused.status_code == 401
    send(tight, COMPLETIONS, completion_body(max_tokens=1), headers=bearer("key-alice"))

    lines = _json_log_lines(tight.log_path)
    events = {(line.get("request_id"), line["event"]) for line in lines}
    assert ("req-served-1", "generation admitted") in events
    assert ("req-served-1", "generation finished") in events
    assert ("req-refused-1", "request refused") in events
    # Without the header the server makes one up.
    admitted = [line for line in lines if line["event"] == "generation admitted"]
    made_up = [line["request_id"] for line in admitted if line["request_id"] != "req-served-1"]
    assert made_up and all(re.fullmatch(r"[0-9a-f]{16}", rid) for rid in made_up)
    assert {line["tenant"] for line in admitted} >= {"alice"}
    assert all(line["level"] and line["timestamp"] for line in lines)


# ------------------------------------------------------------------ a KV cache under a prompt

SMALL_KV_TOKENS = 256


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("small-kv"), MAX_ACTIVE_KV_TOKENS=str(SMALL_KV_TOKENS)
    )
    yield running
    stop_server(running)


def _kv_capacity(server: RunningServer) -> int:
    """The most context one request may hold: what the server refuses past."""
    return api_metrics(server.base_url)["kv"]["max_blocks_per_sequence"] * BLOCK_SIZE


def _chat_prompt_tokens(server: RunningServer, body: dict) -> int:
    tokenized = httpx.post(
        server.base_url + "/tokenize", json={"messages": body["messages"]}, timeout=TIMEOUT
    )
    return tokenized.json()["count"]


def test_a_prompt_past_the_kv_cache_names_the_prompt(small_kv: RunningServer) -> None:
    """max_tokens 1 cannot be shortened: the prompt alone is too long, and the error says so as
    OpenAI's context_length_exceeded does (`prompt`, or `messages` for chat)."""
    capacity = _kv_capacity(small_kv)
    assert (
        send(small_kv, COMPLETIONS, completion_body([2] * capacity, max_tokens=1)).status_code
        == 200
    )
    too_long = send(small_kv, COMPLETIONS, completion_body([2] * (capacity + 1), max_tokens=1))
    assert error_of(too_long, 400) == {
        "message": f"This server's KV cache holds at most {capacity} tokens of one request's "
        f"context, but the prompt has {capacity + 1} tokens. Please reduce the length of the "
        "prompt.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    chat = chat_body("word " * capacity, max_completion_tokens=1)
    tokens = _chat_prompt_tokens(small_kv, chat)
    assert tokens > capacity
    assert error_of(send(small_kv, CHAT, chat), 400) == {
        "message": f"This server's KV cache holds at most {capacity} tokens of one request's "
        f"context, but the prompt has {tokens} tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert wait_until(lambda: api_metrics(small_kv.base_url)["scheduler"]["num_running"] == 0)


@pytest.mark.parametrize(
    ("path", "field"),
    [(COMPLETIONS, "max_tokens"), (CHAT, "max_tokens"), (CHAT, "max_completion_tokens")],
)
def test_a_prompt_that_fits_with_too_many_tokens_names_the_budget(
    small_kv: RunningServer, path: str, field: str
) -> None:
    """Prompt + max_tokens - 1 (the last token is never cached) past the KV cache: the budget
    is what to lower, named as the client spelled it."""
    capacity = _kv_capacity(small_kv)
    if path == CHAT:
        body = chat_body("Count to five.")
        prompt_tokens = _chat_prompt_tokens(small_kv, body)
    else:
        prompt_tokens = capacity - 4
        body = completion_body([2] * prompt_tokens)
    fits = capacity - prompt_tokens + 1
    served = send(small_kv, path, body | {field: fits, "temperature": 0})
    assert served.status_code == 200, served.text
    error = error_of(send(small_kv, path, body | {field: fits + 1}), 400)
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    assert error["message"] == (
        f"the request needs up to {capacity + 1} tokens of KV cache (prompt of {prompt_tokens} "
        f"tokens, max_tokens {fits + 1}) but the server holds at most {capacity}; shorten the "
        "prompt or lower max_tokens"
    )
