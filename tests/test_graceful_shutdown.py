"""SIGTERM with 16 SSE streams and 2 WebSocket generations open: while the server drains,
/health and new generations answer 503 (/live stays 200: tests/test_readiness.py); the open
streams finish within SHUTDOWN_GRACE_S or end with an error event then [DONE] (never cut
without one); then the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as connect_sync

from tests.conftest import RunningServer, start_server, stop_server
from tests.gateway_helpers import chat_body, completion_body, sse_chunks, unique_prompt

NUM_STREAMS = 16
NUM_WS = 2
TIMEOUT = httpx.Timeout(120.0)


def sse_body(i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """Half chat, half completions; ignore_eos so each runs its whole max_tokens."""
    fields = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    if i % 2:
        return "/chat/completions", chat_body(unique_prompt(), **fields)
    return "/completions", completion_body(unique_prompt(), **fields)


async def read_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], started: asyncio.Event
) -> bytes:
    raw = b""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for part in response.aiter_bytes():
            raw += part
            if raw.count(b"\n\n") >= 3:  # a few events in: generating
                started.set()
    return raw


async def ws_generation(url: str, max_tokens: int, started: asyncio.Event) -> list[dict]:
    """Every frame of one generation; then the server closes the socket, once drained."""
    frames: list[dict] = []
    async with connect(url, proxy=None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await _generate(ws, "g1", max_tokens)
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            started.set()
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012  # restarting
    return frames


async def _generate(ws: ClientConnection, gid: str, max_tokens: int) -> None:
    body = chat_body(unique_prompt(), max_tokens=max_tokens, ignore_eos=True, temperature=0)
    await ws.send(json.dumps(body | {"type": "generate", "id": gid}))


async def drain_under_load(
    server: RunningServer, max_tokens: int
) -> tuple[list[list[dict]], list[list[dict]], float]:
    """Open the streams, send SIGTERM once all have output, check the drain refuses new work;
    returns each SSE stream's chunks, each WebSocket generation's frames, and the seconds
    from SIGTERM to the process's exit (which must be 0)."""
    url = server.base_url.replace("http://", "ws://") + "/v1/ws"
    started = [asyncio.Event() for _ in range(NUM_STREAMS + NUM_WS)]
    async with httpx.AsyncClient(base_url=server.v1, timeout=TIMEOUT) as client:
        sse = [
            asyncio.create_task(read_stream(client, *sse_body(i, max_tokens), started[i]))
            for i in range(NUM_STREAMS)
        ]
        ws = [
            asyncio.create_task(ws_generation(url, max_tokens, started[NUM_STREAMS + i]))
            for i in range(NUM_WS)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 180)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.to_thread(assert_refusing_while_draining, server)
        raw_streams = await asyncio.gather(*sse)
        ws_frames = await asyncio.gather(*ws)
    status = await asyncio.to_thread(server.process.wait, 60)
    assert status == 0, server.log()
    return [sse_chunks(raw) for raw in raw_streams], ws_frames, time.monotonic() - signalled


def assert_refusing_while_draining(server: RunningServer) -> None:
    """/health turns 503 within a second of the signal, and new generations get a 503, over
    HTTP and over a new WebSocket."""
    deadline = time.monotonic() + 1.0
    while (health := httpx.get(server.base_url + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 while draining"
        time.sleep(0.02)
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    body = completion_body("Hello", max_tokens=4)
    refused = httpx.post(server.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    url = server.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect_sync(url, proxy=None) as ws:
        assert json.loads(ws.recv(30))["type"] == "ready"
        ws.send(json.dumps(chat_body("Hello", max_tokens=4) | {"type": "generate", "id": "late"}))
        frame = json.loads(ws.recv(30))
    assert frame["type"] == "error" and frame["id"] == "late", frame
    assert frame["error"]["code"] == "server_shutting_down"


def start(tmp_path: Path, grace_s: float) -> RunningServer:
    return start_server(tmp_path, SHUTDOWN_GRACE_S=str(grace_s), OMP_NUM_THREADS="1")


async def test_streams_past_the_grace_period_end_with_an_error_event(tmp_path: Path) -> None:
    grace_s = 3.0
    server = start(tmp_path, grace_s)
    try:
        streams, generations, seconds = await drain_under_load(server, max_tokens=1000)
    finally:
        stop_server(server)
    for chunks in streams:  # sse_chunks checked the framing and the closing [DONE]
        error = chunks[-1]["error"]
        assert error["code"] == "server_shutting_down", error
        assert all("error" not in chunk for chunk in chunks[:-1])
    for frames in generations:
        assert frames[-1]["type"] == "error", frames[-1]
        assert frames[-1]["error"]["code"] == "server_shutting_down"
    assert grace_s <= seconds < grace_s + 15, seconds
    assert f"cut_requests={NUM_STREAMS + NUM_WS}" in server.log()


async def test_streams_within_the_grace_period_all_finish(tmp_path: Path) -> None:
    server = start(tmp_path, grace_s=120.0)
    try:
        streams, generations, seconds = await drain_under_load(server, max_tokens=32)
    finally:
        stop_server(server)
    for chunks in streams:
        assert all("error" not in chunk for chunk in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for frames in generations:
        assert frames[-1]["type"] == "done", frames[-1]
        assert frames[-1]["usage"]["completion_tokens"] == 32
    assert seconds < 60
    assert "cut_requests=0" in server.log()
