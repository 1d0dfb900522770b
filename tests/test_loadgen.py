"""The built-in load generator: its planning and validation, then real runs against the
`server` fixture over the JSON API (start, status, stop, 400 and 409)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import httpx
import pytest

from compat.errors import ApiError
from web.loadgen import (
    WORDS,
    LoadConfig,
    decode_load_config,
    make_prompt,
    plan_clients,
    request_body,
)

# ---------------------------------------------------------------------- pure logic


def test_plan_clients_without_keys_names_tenants_by_user_field() -> None:
    clients = plan_clients(5, 2, {})
    assert [c.tenant for c in clients] == [
        "loadgen-0", "loadgen-1", "loadgen-0", "loadgen-1", "loadgen-0",
    ]  # fmt: skip
    assert clients[3].user_field == "loadgen-1"
    assert clients[3].api_key is None
    assert clients[3].headers() == {"X-Session-Id": "loadgen-user-3"}


def test_plan_clients_with_keys_uses_one_key_per_configured_tenant() -> None:
    keys = {"k-a1": "alice", "k-a2": "alice", "k-b": "bob"}  # key -> tenant
    clients = plan_clients(4, 3, keys)
    # Only two tenants are configured, so the third wraps around to the first.
    assert [(c.tenant, c.api_key) for c in clients] == [
        ("alice", "k-a1"), ("bob", "k-b"), ("alice", "k-a1"), ("alice", "k-a1"),
    ]  # fmt: skip
    assert clients[1].user_field is None  # the key names the tenant
    assert clients[1].headers() == {"X-Session-Id": "loadgen-user-1", "Authorization": "Bearer k-b"}


def test_make_prompt_is_seeded_and_has_the_asked_word_count() -> None:
    first = make_prompt(random.Random(7), 12)
    assert first == make_prompt(random.Random(7), 12)
    assert first != make_prompt(random.Random(8), 12)
    words = first.split(" ")
    assert len(words) == 12
    assert set(words) <= set(WORDS)


def test_request_body_for_chat_puts_the_shared_prompt_in_a_system_message() -> None:
    config = LoadConfig(num_requests=1, max_tokens=5, system_prompt="Be brief.", temperature=0.5)
    client = plan_clients(1, 1, {})[0]
    path, body = request_body(config, "m", client, "hello world", seed=42)
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "m",
        "max_tokens": 5,
        "temperature": 0.5,
        "seed": 42,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "loadgen-0",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello world"},
        ],
    }


def test_request_body_for_completions_prefixes_the_shared_prompt() -> None:
    config = LoadConfig(num_requests=1, api="completions", system_prompt="Shared.")
    client = plan_clients(1, 1, {"key": "team"})[0]
    path, body = request_body(config, "m", client, "go", seed=1)
    assert path == "/v1/completions"
    assert body["prompt"] == "Shared.\n\ngo"
    assert "user" not in body
    assert "messages" not in body


def test_decode_load_config_reads_fields_and_defaults() -> None:
    config = decode_load_config(b'{"users": 3, "tenants": 3, "duration_s": 2.5}')
    assert config == LoadConfig(users=3, tenants=3, duration_s=2.5)
    assert (config.prompt_words, config.max_tokens, config.api, config.num_requests) == (
        32, 32, "chat", None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b'{"users": 0, "num_requests": 1}', "users", "invalid_value"),
        (b'{"users": 2}', "duration_s", "missing_required_parameter"),
        (b'{"users": 1, "tenants": 2, "num_requests": 1}', "tenants", "invalid_value"),
        (b'{"num_requests": 1, "colour": "red"}', "colour", "unknown_parameter"),
        (b'{"num_requests": "six"}', "num_requests", "invalid_type"),
        (b'{"num_requests": 1, "api": "embeddings"}', "api", "invalid_value"),
        (b'{"users": 2', None, "invalid_json"),
        (b"[1, 2]", None, "invalid_type"),
    ],
)
def test_decode_load_config_refuses_bad_config(body: bytes, param: str | None, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        decode_load_config(body)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


# ---------------------------------------------------------------------- against the server


def wait_for(fetch: Callable[[], dict], done: Callable[[dict], bool], timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def _get(server, path: str) -> dict:
    response = httpx.get(server.base_url + path, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _post(server, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body or {}, timeout=30)


def _tenant_tokens(server, name: str) -> tuple[int, int]:
    tenant = _get(server, "/api/metrics")["scheduler"]["tenants"].get(name)
    return (tenant["prompt_tokens"], tenant["output_tokens"]) if tenant else (0, 0)


@pytest.fixture
def stopped_after(server):
    """Leaves the shared server's load generator stopped whatever the test did."""
    yield server
    _post(server, "/api/loadgen/stop")


def test_run_completes_requests_for_both_tenants(stopped_after) -> None:
    server = stopped_after
    tenants = ["loadgen-0", "loadgen-1"]
    before = {name: _tenant_tokens(server, name) for name in tenants}
    retired_before = _get(server, "/api/metrics")["scheduler"]["retired_tenants"]
    config = {"users": 2, "tenants": 2, "max_tokens": 4, "num_requests": 6, "prompt_words": 8}

    started = _post(server, "/api/loadgen/start", config)
    assert started.status_code == 200, started.text
    assert started.json()["state"] == "running"
    assert started.json()["tenants"] == tenants
    assert started.json()["base_url"] == server.base_url

    status = wait_for(
        lambda: _get(server, "/api/loadgen/status"), lambda s: s["state"] != "running", 60
    )
    assert status["state"] == "finished", status
    counts = (status["sent"], status["completed"], status["failed"], status["in_flight"])
    assert counts == (6, 6, 0, 0)
    assert status["latency"]["e2e_s"]["count"] == 6
    assert status["latency"]["e2e_s"]["p50"] > 0
    assert 6 <= status["output_tokens"] <= 6 * 4
    per_tenant = status["per_tenant"]
    assert sum(t["completed"] for t in per_tenant.values()) == 6
    # An earlier test's run of these tenants is forgotten once they were idle TENANT_IDLE_S,
    # at the first step after that: possibly this run's first, after `before` was read.
    retired = _get(server, "/api/metrics")["scheduler"]["retired_tenants"] > retired_before
    for name in tenants:
        assert per_tenant[name]["completed"] >= 1
        # The server's own ledger saw exactly the tokens this tenant's clients were sent.
        prompt_tokens, output_tokens = _tenant_tokens(server, name)
        served = per_tenant[name]["output_tokens"]
        if retired and output_tokens == served:
            continue  # the ledger started again from this run
        assert output_tokens - before[name][1] == served
        assert prompt_tokens > before[name][0]


def test_stop_cancels_in_flight_requests_server_side(stopped_after) -> None:
    server = stopped_after
    aborted_before = _get(server, "/api/metrics")["scheduler"]["num_aborted"]
    config = {"users": 2, "tenants": 2, "max_tokens": 512, "duration_s": 120, "prompt_words": 8}
    assert _post(server, "/api/loadgen/start", config).status_code == 200

    def engine_busy(_: dict) -> bool:
        sched = _get(server, "/api/metrics")["scheduler"]
        return sched["num_running"] + sched["num_waiting"] >= 2

    wait_for(dict, engine_busy, 30)
    again = _post(server, "/api/loadgen/start", config)
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "loadgen_running"

    stopped = _post(server, "/api/loadgen/stop")
    assert stopped.status_code == 200
    status = stopped.json()
    assert status["state"] == "stopped"
    assert status["in_flight"] == 0
    assert status["cancelled"] >= 1

    sched = wait_for(
        lambda: _get(server, "/api/metrics")["scheduler"],
        lambda s: s["num_running"] + s["num_waiting"] == 0,
        10,
    )
    assert sched["num_running"] + sched["num_waiting"] == 0
    assert 1 <= sched["num_aborted"] - aborted_before <= status["cancelled"]
    # Stopping again is harmless and reports the same finished run.
    assert _post(server, "/api/loadgen/stop").json()["state"] == "stopped"


def test_bad_config_is_an_openai_shaped_400(server) -> None:
    response = _post(server, "/api/loadgen/start", {"users": 2, "tenants": 5, "num_requests": 1})
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "'tenants' (5) must not exceed 'users' (2): every tenant needs at least "
            "one user.",
            "type": "invalid_request_error",
            "param": "tenants",
            "code": "invalid_value",
        }
    }
    assert _get(server, "/api/loadgen/status")["state"] != "running"
