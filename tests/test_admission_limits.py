"""Per-tenant and per-session admission limits through the real server: the request over the
limit gets a 429 with Retry-After, others are served, and the accepted ones complete."""

from __future__ import annotations

import asyncio

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
    async with httpx.AsyncClient(base_url=limited.v1, timeout=120) as client:
        first = asyncio.create_task(client.post("/completions", json=body("alice")))
        await asyncio.sleep(0.5)  # let the first one be accepted
        refused, other = await asyncio.gather(
            client.post("/completions", json=body("alice", 2)),
            client.post("/completions", json=body("bob", 2)),
        )
        done = await first
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "tenant 'alice'" in refused.json()["error"]["message"]
    assert other.status_code == 200 and done.status_code == 200
    assert done.json()["usage"]["completion_tokens"] == 24


async def test_session_limit_counts_the_session_header(limited):
    async with httpx.AsyncClient(base_url=limited.v1, timeout=120) as client:
        headers = {"X-Session-Id": "conversation-1"}
        first = asyncio.create_task(
            # Long enough to be still running when the second arrives, however fast decoding is.
            client.post("/completions", json=body("carol", 256), headers=headers)
        )
        await asyncio.sleep(0.5)
        refused = await client.post("/completions", json=body("dave", 2), headers=headers)
        assert (await first).status_code == 200
    assert refused.status_code == 429
    assert "session 'conversation-1'" in refused.json()["error"]["message"]
