"""Raw HTTP against a real server (the session `server`): exact SSE framing, disconnects that
free KV blocks, Prometheus and JSON metrics, health and schema, tokenize round trips,
cache_salt isolation and tenant attribution."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.gateway_helpers import (
    api_metrics,
    chat_body,
    completion_body,
    sse_chunks,
    unique_prompt,
    wait_until,
)
from tests.openapi_schema import COMPLETION_CHUNK, validate

TIMEOUT = httpx.Timeout(300.0)


def post(server: RunningServer, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=TIMEOUT, **kwargs)


def post_stream(server: RunningServer, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=TIMEOUT) as response:
        return response, response.read()


# ------------------------------------------------------------------ SSE framing


def test_chat_stream_exact_framing(server: RunningServer) -> None:
    body = chat_body(
        max_tokens=4, temperature=0, ignore_eos=True, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    response, raw = post_stream(server, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    chunks = sse_chunks(raw)
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL_ID
    assert len({(c["id"], c["created"]) for c in chunks}) == 1

    first, *content, finish, usage = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    assert content, "no content deltas"
    for chunk in content:
        [choice] = chunk["choices"]
        assert set(choice["delta"]) == {"content"} and choice["finish_reason"] is None
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    assert all(c["usage"] is None for c in chunks[:-1])  # null until the usage chunk


def test_completion_stream_exact_framing(server: RunningServer) -> None:
    body = completion_body(
        max_tokens=3, temperature=0, ignore_eos=True, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    response, raw = post_stream(server, "/v1/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *text_chunks, usage = sse_chunks(raw)
    for chunk in text_chunks:
        validate(chunk, COMPLETION_CHUNK)
        assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    validate(usage, COMPLETION_CHUNK)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_stream_without_include_usage_sends_no_usage(server: RunningServer) -> None:
    _, raw = post_stream(
        server, "/v1/chat/completions", chat_body(max_tokens=2, temperature=0, stream=True)
    )
    chunks = sse_chunks(raw)
    assert all("usage" not in chunk and chunk["choices"] for chunk in chunks)


def test_chat_stream_n2_starts_every_choice_with_its_role(server: RunningServer) -> None:
    body = chat_body(max_tokens=2, n=2, seed=1, ignore_eos=True, stream=True)
    _, raw = post_stream(server, "/v1/chat/completions", body)
    chunks = sse_chunks(raw)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert sorted(c["choices"][0]["index"] for c in chunks[:2]) == [0, 1]
    finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # nothing after the finishes


# ------------------------------------------------------------------ disconnects free blocks


def _idle(base_url: str) -> bool:
    snapshot = api_metrics(base_url)
    sched = snapshot["scheduler"]
    return sched["num_running"] == 0 and sched["num_waiting"] == 0 and snapshot["kv"]["usage"] == 0


def test_disconnect_mid_stream_frees_blocks(server: RunningServer) -> None:
    assert wait_until(lambda: _idle(server.base_url))
    aborted_before = api_metrics(server.base_url)["scheduler"]["num_aborted"]
    body = completion_body(
        unique_prompt(), max_tokens=4000, ignore_eos=True, temperature=0, stream=True
    )
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        events = response.iter_raw()
        received = b""
        while received.count(b"\n\n") < 2:
            received += next(events)
        busy = api_metrics(server.base_url)
        assert busy["scheduler"]["num_running"] == 1 and busy["kv"]["usage"] > 0
    # Leaving the block closed the connection mid-stream.
    assert wait_until(lambda: _idle(server.base_url), timeout_s=10)
    assert api_metrics(server.base_url)["scheduler"]["num_aborted"] == aborted_before + 1


async def test_disconnect_during_non_streamed_request_frees_blocks(server: RunningServer) -> None:
    assert wait_until(lambda: _idle(server.base_url))
    aborted_before = api_metrics(server.base_url)["scheduler"]["num_aborted"]
    body = completion_body(unique_prompt(), max_tokens=4000, ignore_eos=True, temperature=0)
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        request = asyncio.create_task(client.post(server.v1 + "/completions", json=body))

        async def running() -> bool:
            metrics = (await client.get(server.base_url + "/api/metrics")).json()
            return metrics["scheduler"]["num_running"] == 1

        for _ in range(300):
            if await running():
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the request never started running")
        request.cancel()  # the client gives up: its connection is closed
        with pytest.raises(asyncio.CancelledError):
            await request
    assert wait_until(lambda: _idle(server.base_url), timeout_s=10)
    assert api_metrics(server.base_url)["scheduler"]["num_aborted"] == aborted_before + 1


# ------------------------------------------------------------------ metrics, health, schema


def _prometheus(base_url: str) -> dict[tuple[str, frozenset], float]:
    response = httpx.get(base_url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL_ID, **labels}.items()))]


def test_prometheus_metrics(server: RunningServer) -> None:
    tenant = f"prom-{uuid.uuid4().hex[:8]}"
    before = _prometheus(server.base_url)
    body = completion_body(unique_prompt(), max_tokens=3, ignore_eos=True, user=tenant)
    usage = post(server, "/v1/completions", body).json()["usage"]
    after = {}

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - before.get(
            (name, frozenset({"model_name": MODEL_ID, **labels}.items())), 0.0
        )

    def recorded() -> bool:  # the engine thread records a finish just after delivering it
        after.update(_prometheus(server.base_url))
        return delta("gemma_serve:generation_tokens_total") >= 3

    assert wait_until(recorded, timeout_s=5)
    assert delta("gemma_serve:generation_tokens_total") == 3
    assert delta("gemma_serve:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("gemma_serve:time_to_first_token_seconds_count") == 1
    assert _value(after, "gemma_serve:time_to_first_token_seconds_bucket", le="+Inf") >= 1
    assert delta("gemma_serve:request_success_total", finished_reason="length") == 1
    assert delta("gemma_serve:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert (
        delta("gemma_serve:prefix_cache_hits_total")
        == (usage["prompt_tokens_details"]["cached_tokens"])
    )
    assert _value(after, "gemma_serve:num_requests_running") == 0
    assert _value(after, "gemma_serve:num_requests_waiting") == 0
    assert _value(after, "gemma_serve:kv_cache_usage_perc") == 0
    assert delta("gemma_serve:num_preemptions_total") == 0  # one request, a roomy KV cache
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    served = computed + 3
    assert _value(after, "gemma_serve:tenant_tokens_served_total", tenant=tenant) == served
    # VTC charges w_p = 1 per prompt token computed and w_q = 2 per output token, on top of the
    # lift a new tenant's counter may get to the last tenant's (engine.sched.policy.VtcPolicy).
    counter = _value(after, "gemma_serve:tenant_virtual_token_counter", tenant=tenant)
    assert counter >= computed + 2 * 3


def test_prometheus_totals_are_counters(server: RunningServer) -> None:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    types = {family.name: family.type for family in text_string_to_metric_families(text)}
    totals = (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "tenant_tokens_served",
    )
    assert {types[f"gemma_serve:{name}"] for name in totals} == {"counter"}
    # The parser names a counter's family without `_total`: one keeping it was typed otherwise.
    assert [name for name in types if name.endswith("_total")] == []


@pytest.fixture(scope="module")
def two_tenants_shown(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("shown"), METRICS_MAX_TENANTS="2")
    yield running
    stop_server(running)


def test_api_metrics_lists_the_tenants_prometheus_exports(two_tenants_shown: RunningServer) -> None:
    """Clients name tenants freely: /api/metrics shows at most METRICS_MAX_TENANTS of them, the
    ones /metrics has series for (the most served here, none in flight), and counts them all."""
    server = two_tenants_shown
    # Prompts of 41, 21 and 2 tokens sharing no block: service = 41 + 2 * 1, 21 + 2, 2 + 2.
    for user, length in (("heavy", 40), ("light", 1), ("mid", 20)):
        body = completion_body([2] + [1000 + length] * length, max_tokens=1, user=user)
        assert post(server, "/v1/completions", body).status_code == 200
    snapshot = api_metrics(server.base_url)
    scheduler, fairness = snapshot["scheduler"], snapshot["fairness"]
    assert scheduler["num_tenants"] == 3
    assert {name: t["prompt_tokens"] for name, t in scheduler["tenants"].items()} == {
        "heavy": 41,
        "mid": 21,
    }
    assert {name: t["service"] for name, t in fairness["tenants"].items()} == {
        "heavy": 43.0,
        "mid": 23.0,
    }
    samples = _prometheus(server.base_url)
    labels = {value for _, pairs in samples for key, value in pairs if key == "tenant"}
    assert labels == {"heavy", "mid"}


def test_api_metrics_json_percentiles(server: RunningServer) -> None:
    post(server, "/v1/completions", completion_body(max_tokens=3, ignore_eos=True))
    assert wait_until(lambda: api_metrics(server.base_url)["metrics"]["tpot_s"]["count"] >= 1)
    snapshot = api_metrics(server.base_url)
    assert snapshot["model"] == MODEL_ID
    for window in ("ttft_s", "tpot_s"):
        summary = snapshot["metrics"][window]
        assert summary["count"] >= 1
        assert 0 < summary["p50"] <= summary["p95"] <= summary["p99"]
    assert {"num_running", "num_waiting", "tenants"} <= snapshot["scheduler"].keys()
    assert {"usage", "max_blocks_per_sequence", "prefix_cache"} <= snapshot["kv"].keys()
    # Where step time goes, by phase; every phase ran in the requests above.
    profile = snapshot["step_profile"]
    assert profile["steps"] >= 3
    assert list(profile["phases"]) == [
        "schedule", "batch", "forward", "sample", "detokenize", "deliver",
    ]  # fmt: skip
    assert all(phase["ms"] > 0 for phase in profile["phases"].values())
    assert sum(phase["ms"] for phase in profile["phases"].values()) == pytest.approx(
        profile["step_ms"]
    )
    assert sum(phase["share"] for phase in profile["phases"].values()) == pytest.approx(1)


def test_health_and_schema(server: RunningServer) -> None:
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert httpx.get(server.base_url + "/schema", timeout=30).status_code == 200
    spec = httpx.get(server.base_url + "/schema/openapi.json", timeout=30)
    assert spec.status_code == 200
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= spec.json()["paths"].keys()


# ------------------------------------------------------------------ tokenize


def test_tokenize_detokenize_round_trip(server: RunningServer) -> None:
    text = "Hello world, ünïcödé ✓ and tabs\tnewlines\n"
    tokens = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 32768
    back = post(server, "/detokenize", {"model": MODEL_ID, "tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}

    with_bos = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert with_bos["tokens"][1:] == tokens["tokens"]  # BOS first, as a request adds it
    assert len(with_bos["token_strs"]) == with_bos["count"]


def test_tokenize_counts_match_usage(server: RunningServer) -> None:
    prompt = "Count these tokens, please."
    count = post(server, "/tokenize", {"prompt": prompt}).json()["count"]
    usage = post(server, "/v1/completions", completion_body(prompt, max_tokens=1)).json()["usage"]
    assert usage["prompt_tokens"] == count

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    count = post(server, "/tokenize", {"messages": messages}).json()["count"]
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 1}
    assert post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"] == count


# ------------------------------------------------------------------ cache_salt, tenants


def test_cache_salt_isolates_prefix_cache(server: RunningServer) -> None:
    prompt = unique_prompt(words=48)  # several KV blocks

    def cached(**fields: str) -> int:
        body = completion_body(prompt, max_tokens=1, temperature=0, **fields)
        return post(server, "/v1/completions", body).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    assert cached(cache_salt="salt-a") == 0
    assert cached(cache_salt="salt-b") == 0  # same prompt, other salt: nothing shared
    assert cached(cache_salt="salt-a") > 0  # same salt: the prefix is reused
    assert cached() == 0  # unsalted requests never see salted blocks


def test_user_field_is_the_tenant(server: RunningServer) -> None:
    tenant = f"user-{uuid.uuid4().hex[:8]}"
    body = completion_body(max_tokens=2, ignore_eos=True, user=tenant)
    assert post(server, "/v1/completions", body).status_code == 200
    body = chat_body(max_tokens=3, ignore_eos=True, user=tenant)
    response = post(server, "/v1/chat/completions", body, headers={"X-Session-Id": "conv-1"})
    assert response.status_code == 200
    stats = api_metrics(server.base_url)["scheduler"]["tenants"][tenant]
    assert stats["output_tokens"] == 5
    assert stats["running"] == stats["waiting"] == 0


def test_session_header_alone_keeps_the_default_tenant(server: RunningServer) -> None:
    session = f"session-{uuid.uuid4().hex[:8]}"
    before = api_metrics(server.base_url)["scheduler"]["tenants"].get("default", {})
    body = completion_body(max_tokens=2, ignore_eos=True)
    response = post(server, "/v1/completions", body, headers={"X-Session-Id": session})
    assert response.status_code == 200
    tenants = api_metrics(server.base_url)["scheduler"]["tenants"]
    assert session not in tenants
    assert tenants["default"]["output_tokens"] == before.get("output_tokens", 0) + 2
