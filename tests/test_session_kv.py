"""Sessions keep their KV between turns through the real server, while concurrent traffic churns
the whole prefix cache: a WebSocket session of 20 turns and a chat with `X-Session-Id` (the
official openai client) prefill only their new tokens from the second turn on. A session with
`sink` eviction keeps its evicted cache: a history of several budgets in bounded memory."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server

pytestmark = pytest.mark.slow

BLOCK = 16
KV_TOKENS = 2048  # 128 blocks: a few load prompts fill it
LOAD_PROMPT_TOKENS = 320


@pytest.fixture(scope="module")
def small_server(tmp_path_factory) -> Iterator[RunningServer]:
    server = start_server(
        tmp_path_factory.mktemp("session-kv"),
        MAX_ACTIVE_KV_TOKENS=str(KV_TOKENS),
        KV_BLOCK_SIZE=str(BLOCK),
    )
    yield server
    stop_server(server)


async def kv_stats(server: RunningServer) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(server.base_url + "/api/metrics")).json()["kv"]


@contextlib.asynccontextmanager
async def churn(server: RunningServer) -> AsyncIterator[list[int]]:
    """Two clients sending distinct long prompts back to back until the block exits, so the
    prefix cache is refilled many times over; yields the list of finished load requests."""
    done: list[int] = []
    rng = random.Random(0)

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=server.v1, timeout=120) as client:
            while True:
                prompt = [rng.randrange(1000, 200_000) for _ in range(LOAD_PROMPT_TOKENS)]
                body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 1}
                response = await client.post("/completions", json=body)
                assert response.status_code == 200, response.text
                done.append(1)

    tasks = [asyncio.create_task(client_loop()) for _ in range(2)]
    try:
        yield done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def assert_history_cached(usages: list[dict[str, Any]]) -> None:
    """From the second turn on, the cache covered the previous turn's prompt and reply, but
    for the last (partial) block: all of it the previous turn computed."""
    for previous, current in itertools.pairwise(usages):
        history = previous["prompt_tokens"] + previous["completion_tokens"]
        cached = current["prompt_tokens_details"]["cached_tokens"]
        assert history - BLOCK <= cached <= current["prompt_tokens"], (previous, current)


async def test_a_websocket_session_keeps_its_kv_for_20_turns_under_churn(small_server):
    reclaimed_before = (await kv_stats(small_server))["groups"]["full"]["reclaimed"]
    usages = []
    async with connect(small_server.base_url.replace("http", "ws") + "/v1/ws") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "session.start", "session": "long-chat"}))
        assert json.loads(await ws.recv())["type"] == "session.started"
        async with churn(small_server) as load:
            for turn in range(20):
                text = f"Turn {turn}: tell me more."
                usages.append(await session_turn(ws, f"t{turn}", "long-chat", text, max_tokens=8))
                await asyncio.sleep(0.3)  # let the load run between turns
        pinned = await kv_stats(small_server)
        assert pinned["pinned_sessions"] >= 1
        await ws.send(json.dumps({"type": "session.end", "session": "long-chat"}))
        assert json.loads(await ws.recv())["type"] == "session.ended"
    assert len(load) >= 20
    after = await kv_stats(small_server)
    # The load refilled the 128-block cache several times over; the history stayed.
    assert (
        after["groups"]["full"]["reclaimed"] - reclaimed_before
        > 3 * after["max_blocks_per_sequence"]
    )
    assert usages[-1]["prompt_tokens"] > 20 * 8
    assert_history_cached(usages)
    for _ in range(50):  # the ended session's pin is released on the engine thread
        if (await kv_stats(small_server))["pinned_sessions"] == 0:
            break
        await asyncio.sleep(0.1)
    assert (await kv_stats(small_server))["pinned_sessions"] == 0


async def test_a_chat_with_a_session_header_keeps_its_kv_under_churn(small_server):
    client = openai.AsyncOpenAI(base_url=small_server.v1, api_key="unused", max_retries=0)
    headers = {"X-Session-Id": "http-conversation"}
    messages: list[dict[str, str]] = []
    usages = []
    async with churn(small_server):
        for turn in range(6):
            messages.append({"role": "user", "content": f"Question {turn}: and then?"})
            reply = await client.chat.completions.create(
                model=MODEL_ID, messages=messages, max_tokens=8, temperature=0,
                extra_headers=headers,
            )  # fmt: skip
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            usages.append(reply.usage.model_dump())
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            await asyncio.sleep(0.3)
    assert_history_cached(usages)
    await client.close()


async def session_turn(
    ws: ClientConnection, turn_id: str, session: str, text: str, max_tokens: int = 16
) -> dict[str, Any]:
    """One chat turn of `session`; the usage of its `done`."""
    await ws.send(json.dumps({
        "type": "generate", "id": turn_id, "session": session, "model": MODEL_ID,
        "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    }))  # fmt: skip
    while (event := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] not in (
        "done",
        "error",
    ):
        pass
    assert event["type"] == "done", event
    return event["usage"]


@pytest.fixture
def quiet_server(tmp_path) -> Iterator[RunningServer]:
    """A server of its own: no other session's pins in its KV counts."""
    server = start_server(tmp_path, MAX_ACTIVE_KV_TOKENS=str(KV_TOKENS), KV_BLOCK_SIZE=str(BLOCK))
    yield server
    stop_server(server)


async def test_a_session_with_eviction_keeps_its_evicted_cache_in_bounded_memory(quiet_server):
    budget_tokens = 256
    usages, held = [], []
    async with connect(quiet_server.base_url.replace("http", "ws") + "/v1/ws") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({
            "type": "session.start", "session": "streaming", "eviction_policy": "sink",
            "kv_tokens": budget_tokens,
        }))  # fmt: skip
        assert json.loads(await ws.recv())["type"] == "session.started"
        for turn in range(12):
            text = f"Turn {turn}. " + "Tell me one more thing about rivers and the sea. " * 6
            usages.append(await session_turn(ws, f"e{turn}", "streaming", text))
            held.append(await kv_stats(quiet_server))
        await ws.send(json.dumps({"type": "session.end", "session": "streaming"}))
        assert json.loads(await ws.recv())["type"] == "session.ended"
    # The history grew to several budgets. Once a turn computed more than the budget (and so
    # evicted), the next one prefilled only what it did not compute: its last sampled token and
    # the new message.
    assert usages[-1]["prompt_tokens"] > 3 * budget_tokens
    assert_history_cached(usages)
    evicting = []
    for previous, current in itertools.pairwise(usages):
        computed = previous["prompt_tokens"] + previous["completion_tokens"] - 1
        if computed > budget_tokens:
            evicting.append(current)
            assert current["prompt_tokens_details"]["cached_tokens"] == computed, previous
    assert len(evicting) >= 8
    assert held[-1]["resumed_kept"] == len(evicting)
    # Between turns the session holds its evicted cache: the budget, in bounded memory.
    for stats in held[-len(evicting) - 1 :]:
        assert stats["kept_sessions"] == 1
        assert stats["pinned_blocks"] == budget_tokens // BLOCK
        assert stats["groups"]["full"]["in_use"] == budget_tokens // BLOCK
    for _ in range(50):  # the ended session's pin is released on the engine thread
        if (await kv_stats(quiet_server))["pinned_sessions"] == 0:
            break
        await asyncio.sleep(0.1)
    after = await kv_stats(quiet_server)
    assert after["kept_sessions"] == after["pinned_blocks"] == 0
    assert after["groups"]["full"]["in_use"] == 0
