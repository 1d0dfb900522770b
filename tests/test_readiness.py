"""Readiness and liveness, as Kubernetes probes them: /health answers 200 while the server takes
work; after SIGTERM, with a generation still streaming, /health turns 503 ("draining") at once
while /live answers 200 until the process stops listening, so the pod leaves its Service
without being restarted mid-drain; then the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, stop_server
from tests.gateway_helpers import sse_chunks
from tests.test_graceful_shutdown import TIMEOUT, read_stream, sse_body, start

pytestmark = pytest.mark.slow

GRACE_S = 3.0


def probe(server: RunningServer, path: str) -> tuple[int, dict]:
    """One probe on a fresh connection, as a kubelet sends it."""
    response = httpx.get(server.base_url + path, timeout=5)
    return response.status_code, response.json()


def probe_until_exit(server: RunningServer) -> list[tuple[float, tuple, tuple]]:
    """(seconds since called, /health, /live) until the server stops listening."""
    start_time = time.monotonic()
    seen = []
    while True:
        try:
            ready, alive = probe(server, "/health"), probe(server, "/live")
        except httpx.TransportError:
            return seen
        seen.append((time.monotonic() - start_time, ready, alive))
        time.sleep(0.05)


async def test_health_turns_503_while_live_stays_200_until_exit(tmp_path: Path) -> None:
    server = start(tmp_path, GRACE_S)
    try:
        assert probe(server, "/health") == (200, {"status": "ok"})
        async with httpx.AsyncClient(base_url=server.v1, timeout=TIMEOUT) as client:
            started = asyncio.Event()  # max_tokens 1000 outlasts the grace period
            stream = asyncio.create_task(read_stream(client, *sse_body(0, 1000), started))
            await asyncio.wait_for(started.wait(), 120)
            server.process.send_signal(signal.SIGTERM)
            seen = await asyncio.to_thread(probe_until_exit, server)
            chunks = sse_chunks(await stream)
        assert await asyncio.to_thread(server.process.wait, 60) == 0, server.log()
    finally:
        stop_server(server)
    assert all(alive == (200, {"status": "ok"}) for _, _, alive in seen), seen
    draining = [at for at, ready, _ in seen if ready == (503, {"status": "draining"})]
    # Every probe but those of the signal's first second says draining...
    assert all(ready[0] == 503 or at < 1.0 for at, ready, _ in seen), seen
    # ...and the drain (with /live 200) lasts the grace period the stream was cut at.
    assert draining and draining[-1] - draining[0] >= GRACE_S - 1.0, seen
    assert chunks[-1]["error"]["code"] == "server_shutting_down", chunks[-1]
