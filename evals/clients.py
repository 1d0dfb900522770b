"""Clients that use the server as real ones do, badly included: a request over SSE, plain
HTTP or the WebSocket that may hang up abruptly at a chosen point, and what became of it.

Each call returns an Outcome whose `kind` says how the request ended, from the client's side:
- "completed": the whole response arrived (every choice finished, then `[DONE]` or `done`);
- "aborted": this client hung up on purpose before the end (`hang_up_after`);
- "refused": 429 with a Retry-After header, or the WebSocket's `rate_limit_exceeded` error;
- "client_error": any other 4xx (or a WebSocket error frame for the request);
- "server_error": a 5xx, or an error event inside a stream;
- "lost": anything else: a stream cut without an error, a connection the server dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from websockets.asyncio.client import connect

MODEL = "gemma-3-270m"
TIMEOUT_S = 600.0


@dataclass
class Outcome:
    transport: str  # "sse", "http" or "ws"
    endpoint: str  # "completions" or "chat"
    kind: str
    status: int = 0  # HTTP status (101 for a WebSocket that opened)
    events: int = 0  # stream events (SSE data lines, WebSocket deltas) received
    detail: str = ""
    seconds: float = 0.0


def request_body(endpoint: str, prompt: list[int], max_tokens: int, n: int = 1) -> dict:
    """A request for `endpoint`; chat gets the prompt's tokens as words of one user message."""
    body: dict = {"model": MODEL, "max_tokens": max_tokens, "n": n, "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}]
    else:
        body["prompt"] = prompt
    return body


def _refusal(response: httpx.Response) -> bool:
    return response.status_code == 429 and "retry-after" in response.headers


async def http_request(
    client: httpx.AsyncClient, endpoint: str, body: dict, stream: bool,
    hang_up_after: int | None = None,
) -> Outcome:  # fmt: skip
    """One /v1 request, streamed as SSE or not; with `hang_up_after` (SSE only), the client
    closes the connection after that many data events (0: as soon as the headers arrive)."""
    transport = "sse" if stream else "http"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    outcome = Outcome(transport, endpoint, "lost")
    try:
        if not stream:
            response = await client.post(path, json=body)
            outcome.status = response.status_code
            outcome.kind = _kind_of_response(response, response.json().get("choices"))
            return outcome
        async with client.stream("POST", path, json=body | {"stream": True}) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.kind = _kind_of_response(response, None)
                return outcome
            outcome.kind = await _read_sse(response, body.get("n", 1), hang_up_after, outcome)
    except httpx.HTTPError as exc:
        outcome.kind, outcome.detail = "lost", repr(exc)
    finally:
        outcome.seconds = time.perf_counter() - start
    return outcome


def _kind_of_response(response: httpx.Response, choices: list | None) -> str:
    if _refusal(response):
        return "refused"
    if response.status_code >= 500:
        return "server_error"
    if response.status_code >= 400:
        return "client_error"
    return "completed" if choices and all(c.get("finish_reason") for c in choices) else "lost"


async def _read_sse(
    response: httpx.Response, n: int, hang_up_after: int | None, outcome: Outcome
) -> str:
    """Read a 200 SSE stream to its end or to the planned hang-up; returns the outcome kind."""
    if hang_up_after == 0:
        return "aborted"  # leaving the `stream` block closes the connection unread
    finished: set[int] = set()
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "completed" if len(finished) == n else "lost"
        event = json.loads(line[6:])
        if "error" in event:
            outcome.detail = json.dumps(event["error"])
            server_side = event["error"].get("type") == "server_error"
            return "server_error" if server_side else "client_error"
        outcome.events += 1
        finished.update(c["index"] for c in event.get("choices", []) if c.get("finish_reason"))
        if hang_up_after is not None and outcome.events >= hang_up_after:
            return "aborted"
    return "lost"  # the stream ended without [DONE]


async def ws_request(
    base_url: str, endpoint: str, body: dict, hang_up_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> Outcome:  # fmt: skip
    """One generation on its own WebSocket; with `hang_up_after`, the client drops the TCP
    connection (no close frame) after that many deltas (0: right after sending it)."""
    outcome = Outcome("ws", endpoint, "lost")
    start = time.perf_counter()
    url = base_url.replace("http", "ws", 1) + "/v1/ws"
    try:
        async with connect(url, additional_headers=headers, max_size=None) as ws:
            outcome.status = 101
            ready = json.loads(await ws.recv())
            if ready.get("type") != "ready":
                outcome.detail = json.dumps(ready)
                return outcome
            await ws.send(json.dumps({"type": "generate", "id": "g", "endpoint": endpoint, **body}))
            if hang_up_after == 0:
                ws.transport.abort()
                outcome.kind = "aborted"
                return outcome
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "delta":
                    outcome.events += 1
                    if hang_up_after is not None and outcome.events >= hang_up_after:
                        ws.transport.abort()
                        outcome.kind = "aborted"
                        return outcome
                elif event["type"] == "done":
                    outcome.kind = "completed"
                    return outcome
                elif event["type"] == "error":
                    error = event["error"]
                    outcome.detail = json.dumps(error)
                    if error.get("code") == "rate_limit_exceeded" and "retry_after" in event:
                        outcome.kind = "refused"
                    elif error.get("type") == "server_error":
                        outcome.kind = "server_error"
                    else:
                        outcome.kind = "client_error"
                    return outcome
    except Exception as exc:  # a dropped connection, a refused handshake
        if outcome.kind != "aborted":
            outcome.kind, outcome.detail = "lost", repr(exc)
    finally:
        outcome.seconds = time.perf_counter() - start
    return outcome


async def settled_metrics(client: httpx.AsyncClient, timeout_s: float = 120.0) -> dict:
    """/api/metrics once no request runs or waits and the KV manager holds no sequence (the
    server applies hang-ups between steps), or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = (await client.get("/api/metrics")).json()
        sched = snapshot["scheduler"]
        idle = sched["num_running"] == sched["num_waiting"] == snapshot["kv"]["num_sequences"] == 0
        if idle or time.monotonic() > deadline:
            return snapshot
        await asyncio.sleep(0.2)
