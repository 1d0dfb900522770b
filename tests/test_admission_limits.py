"""Per-tenant and per-session admission limits through the real server: the request over the
limit gets a 429 with Retry-After, others are served, and the accepted ones complete."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.conftest import MODEL_ID, start_server, stop_server


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("limited"),
        MAX_INFLIGHT_PER_TENANT="1",
        MAX_INFLIGHT_PER_SESSION="1",
    )
    yield server
    stop_server(server)


def body(user: str | None = None, max_tokens: int = 24) -> dict:
    request = {"model": MODEL_ID, "prompt": "Count slowly:", "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True}  # fmt: skip
    return request | ({"user": user} if user else {})


async def test_second_request_of_a_tenant_is_refused_while_the_first_runs(limited):
    """The tenant's first request is streaming (so surely running, however fast decoding is:
    24 greedy tokens can finish in half a second) when its second arrives; another tenant's
    request is served meanwhile, and the first completes."""
    first_body = body("alice", 64) | {"stream": True, "stream_options": {"include_usage": True}}
    async with (
        httpx.AsyncClient(base_url=limited.v1, timeout=120) as client,
        client.stream("POST", "/completions", json=first_body) as first,
    ):
        assert first.status_code == 200
        lines = first.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass  # until the first token's chunk
        refused, other = await asyncio.gather(
            client.post("/completions", json=body("alice", 2)),
            client.post("/completions", json=body("bob", 2)),
        )
        chunks = [json.loads(line[6:]) async for line in lines if line.startswith("data: {")]
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "tenant 'alice'" in refused.json()["error"]["message"]
    assert other.status_code == 200
    assert chunks[-1]["usage"]["completion_tokens"] == 64


async def test_session_limit_counts_the_session_header(limited):
    """The first request of the session is streaming (so surely running, however fast or slow
    decoding is) when the second arrives; once its client leaves, the session may ask again."""
    headers = {"X-Session-Id": "conversation-1"}
    first_body = body("carol", 256) | {"stream": True}
    async with httpx.AsyncClient(base_url=limited.v1, timeout=120) as client:
        async with client.stream("POST", "/completions", json=first_body, headers=headers) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass  # until the first token's chunk
            refused = await client.post("/completions", json=body("dave", 2), headers=headers)
        assert refused.status_code == 429
        assert "session 'conversation-1'" in refused.json()["error"]["message"]
        # Leaving the stream aborted the first request, which frees the session's place.
        for _ in range(100):
            again = await client.post("/completions", json=body("dave", 2), headers=headers)
            if again.status_code != 429:
                break
            await asyncio.sleep(0.2)
        assert again.status_code == 200
