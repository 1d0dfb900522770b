"""An engine step that fails, through the real server (FAULT_INJECTION, a test-only setting):
the requests in that step end with an OpenAI-shaped 500 over each transport (HTTP 500, an SSE
error event then [DONE], a WebSocket `error` frame), requests not in the step complete, the
server keeps serving, and the failed requests' KV blocks are freed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from tests.conftest import RunningServer, start_server, stop_server
from tests.gateway_helpers import (
    api_metrics,
    chat_body,
    completion_body,
    sse_chunks,
    unique_prompt,
    wait_until,
)
from tests.openapi_schema import validate

FAIL_FORWARD = "FAIL-IN-FORWARD"  # a prompt with this fails its step as the forward runs
FAIL_STEP = "FAIL-IN-STEP"  # ... after sampling, at the end of the step
TIMEOUT = httpx.Timeout(120.0)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    # One sequence at a time, first come first served: a request is either the step's only
    # sequence or waiting in the queue, so which requests a failed step holds is known.
    running = start_server(
        tmp_path_factory.mktemp("faulty"),
        FAULT_INJECTION=f"forward:{FAIL_FORWARD},step:{FAIL_STEP}",
        MAX_BATCH_SIZE="1",
        SCHEDULING_POLICY="fcfs",
        OMP_NUM_THREADS="1",
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def idle_free_blocks(faulty: RunningServer) -> int:
    return api_metrics(faulty.base_url)["kv"]["num_free_blocks"]


def assert_back_to_idle(server: RunningServer, idle_free_blocks: int) -> None:
    """No sequence left running or waiting, and every KV block free again."""

    def idle() -> bool:
        snapshot = api_metrics(server.base_url)
        scheduler = snapshot["scheduler"]
        return (
            scheduler["num_running"] == 0
            and scheduler["num_waiting"] == 0
            and snapshot["kv"]["num_free_blocks"] == idle_free_blocks
        )

    assert wait_until(idle), api_metrics(server.base_url)


def assert_internal_error(error: dict[str, Any]) -> None:
    validate({"error": error}, "ErrorResponse")
    assert error["type"] == "server_error" and error["code"] == "internal_error", error


@pytest.mark.parametrize("marker", [FAIL_FORWARD, FAIL_STEP])
def test_a_failed_step_is_a_500(faulty: RunningServer, idle_free_blocks: int, marker: str) -> None:
    body = chat_body(f"{unique_prompt()} {marker}", max_tokens=8)
    response = httpx.post(faulty.v1 + "/chat/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 500, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert_internal_error(response.json()["error"])
    assert "engine step failed" in faulty.log()
    assert_back_to_idle(faulty, idle_free_blocks)


@pytest.mark.parametrize("marker", [FAIL_FORWARD, FAIL_STEP])
def test_a_failed_step_ends_an_sse_stream_with_an_error_event(
    faulty: RunningServer, idle_free_blocks: int, marker: str
) -> None:
    body = completion_body(f"{unique_prompt()} {marker}", max_tokens=8, stream=True)
    response = httpx.post(faulty.v1 + "/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200  # the stream had started
    chunks = sse_chunks(response.content)  # checks the framing, ending with [DONE]
    assert_internal_error(chunks[-1]["error"])
    assert all("error" not in chunk for chunk in chunks[:-1])

    # The official client raises it as an API error.
    with openai.OpenAI(base_url=faulty.v1, api_key="unused", max_retries=0) as client:
        stream = client.completions.create(**body)
        with pytest.raises(openai.APIError, match="engine failed"):
            list(stream)
    assert_back_to_idle(faulty, idle_free_blocks)


async def test_a_failed_step_is_an_error_frame_and_the_socket_goes_on(
    faulty: RunningServer, idle_free_blocks: int
) -> None:
    url = faulty.base_url.replace("http://", "ws://") + "/v1/ws"
    async with connect(url, proxy=None) as ws:

        async def generate(gid: str, content: str) -> dict[str, Any]:
            """The generation's last frame (`done` or `error`); exactly 4 tokens when it is
            `done` (ignore_eos: a sampled reply may otherwise end at <end_of_turn>)."""
            message = chat_body(content, max_tokens=4, ignore_eos=True) | {
                "type": "generate",
                "id": gid,
            }
            await ws.send(json.dumps(message))
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if frame["type"] in ("done", "error"):
                    return frame

        assert json.loads(await ws.recv())["type"] == "ready"
        failed = await generate("g1", f"{unique_prompt()} {FAIL_FORWARD}")
        assert failed["type"] == "error" and failed["id"] == "g1", failed
        assert_internal_error(failed["error"])
        done = await generate("g2", unique_prompt())
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 4, done
    assert_back_to_idle(faulty, idle_free_blocks)


async def test_requests_outside_the_failed_step_complete(
    faulty: RunningServer, idle_free_blocks: int
) -> None:
    """A long request runs alone (MAX_BATCH_SIZE=1) while a faulty one and then a good one
    queue behind it: the faulty one's step holds only itself, so the request before it and
    the one still queued when it fails both complete."""
    async with httpx.AsyncClient(base_url=faulty.v1, timeout=TIMEOUT) as client:

        async def stream(prompt: str, max_tokens: int, started: asyncio.Event) -> bytes:
            body = completion_body(
                prompt, max_tokens=max_tokens, stream=True, ignore_eos=True, temperature=0,
                stream_options={"include_usage": True},
            )  # fmt: skip
            raw = b""
            async with client.stream("POST", "/completions", json=body) as response:
                async for part in response.aiter_bytes():
                    raw += part
                    started.set()
            return raw

        def waiting(count: int) -> bool:
            return api_metrics(faulty.base_url)["scheduler"]["num_waiting"] == count

        first_token = asyncio.Event()
        long_run = asyncio.create_task(stream(unique_prompt(), 128, first_token))
        await asyncio.wait_for(first_token.wait(), 120)
        faulty_run = asyncio.create_task(
            stream(f"{unique_prompt()} {FAIL_FORWARD}", 8, asyncio.Event())
        )
        assert await asyncio.to_thread(wait_until, lambda: waiting(1))
        queued_run = asyncio.create_task(stream(unique_prompt(), 8, asyncio.Event()))
        assert await asyncio.to_thread(wait_until, lambda: waiting(2))
        assert not long_run.done()  # both queued while the long request still runs

        long_chunks, faulty_chunks, queued_chunks = (
            sse_chunks(raw) for raw in await asyncio.gather(long_run, faulty_run, queued_run)
        )
    assert_internal_error(faulty_chunks[-1]["error"])
    for chunks, max_tokens in ((long_chunks, 128), (queued_chunks, 8)):
        assert all("error" not in chunk for chunk in chunks)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert_back_to_idle(faulty, idle_free_blocks)


def test_fault_injection_is_off_by_default_and_checked(tmp_path: Path) -> None:
    from app.settings import load_settings

    env_file = tmp_path / ".env"
    assert load_settings(env_file).engine_config().faults == ()
    with pytest.raises(SystemExit, match="FAULT_INJECTION"):
        load_settings(env_file, FAULT_INJECTION="everywhere:x")
