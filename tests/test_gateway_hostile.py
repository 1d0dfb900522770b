"""Hostile input against a real server: each is refused with a 4xx in OpenAI's shape (or served,
where it is valid), never a 5xx, and the server stays alive with its memory bounded.

Bodies the plain bad-input test already sends (tests/test_gateway_errors.py, NASTY_BODIES) are
not repeated; these add numbers past every range, non-finite literals, surrogates and invalid
UTF-8 in strings, deep nesting inside fields, a huge logit_bias, the n x max_tokens limits,
then oversized headers, a slow body and hostile WebSocket frames.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from evals.harness import rss_bytes
from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.gateway_helpers import api_metrics, wait_until
from tests.openapi_schema import validate

TIMEOUT = httpx.Timeout(120.0)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WS_MAX_SIZE = 16 * 2**20  # uvicorn's default --ws-max-size
RSS_GROWTH_LIMIT_KB = 100 * 1024


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("hostile"), OMP_NUM_THREADS="1")
    yield running
    stop_server(running)


def rss_kb(server: RunningServer) -> int:
    return rss_bytes(server.process.pid) // 1024


@pytest.fixture(scope="module")
def baseline_rss_kb(hostile: RunningServer) -> int:
    """The server's RSS once every kind of request has been served once (lazy allocations)."""
    for path, body in ((COMPLETIONS, completion(max_tokens=2)), (CHAT, chat(max_tokens=2))):
        assert httpx.post(hostile.base_url + path, json=body, timeout=TIMEOUT).status_code == 200
    return rss_kb(hostile)


def assert_alive(server: RunningServer) -> None:
    assert server.process.poll() is None, server.log()[-3000:]
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def completion(prompt: str = "Hello", **fields: object) -> dict[str, object]:
    return {"model": MODEL_ID, "prompt": prompt, **fields}


def chat(content: str = "Hello", **fields: object) -> dict[str, object]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], **fields}


def raw(fields: str) -> bytes:
    """A body naming our model, then `fields` verbatim (they need not be valid JSON)."""
    return f'{{"model": "{MODEL_ID}", {fields}}}'.encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


PROMPT, USER = '"prompt": "x"', '"messages": [{"role": "user", "content": "x"}]'
BIG = str(10**100)
HOSTILE_BODIES = [
    # (id, path, body, param)
    ("max_tokens 10**100", COMPLETIONS, raw(f'{PROMPT}, "max_tokens": {BIG}'), "max_tokens"),
    ("seed 10**100", COMPLETIONS, raw(f'{PROMPT}, "seed": {BIG}'), "seed"),
    ("temperature 10**100", CHAT, raw(f'{USER}, "temperature": {BIG}'), "temperature"),
    ("n 10**100", CHAT, raw(f'{USER}, "n": {BIG}'), "n"),
    ("seed 1e400", CHAT, raw(f'{USER}, "seed": 1e400'), "seed"),
    ("temperature -1e400", COMPLETIONS, raw(f'{PROMPT}, "temperature": -1e400'), "temperature"),
    ("logit_bias value 1e400", CHAT, raw(f'{USER}, "logit_bias": {{"1": 1e400}}'), "logit_bias"),
    ("Infinity", COMPLETIONS, raw(f'{PROMPT}, "temperature": Infinity'), None),
    ("-Infinity", CHAT, raw(f'{USER}, "top_p": -Infinity'), None),
    ("NaN in a list", COMPLETIONS, raw('"prompt": [1, NaN]'), None),
    ("lone high surrogate in prompt", COMPLETIONS, raw('"prompt": "a\\ud800"'), None),
    ("lone low surrogate in prompt", COMPLETIONS, raw('"prompt": "\\udc00b"'), None),
    ("lone surrogate in a content part", CHAT,
     raw('"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]'),
     None),
    ("lone surrogate in a tokenize prompt", "/tokenize", b'{"prompt": "\\ud800"}', None),
    ("invalid UTF-8 in prompt", COMPLETIONS, raw('"prompt": "a') + b'\xff\xfe"}', None),
    ("invalid UTF-8 in content", CHAT,
     raw('"messages": [{"role": "user", "content": "') + b'\xc3\x28"}]}', None),
    ("UTF-8 encoded surrogate", COMPLETIONS, raw('"prompt": "') + b'\xed\xa0\x80"}', None),
    ("100k nested arrays in prompt", COMPLETIONS, raw(f'"prompt": {nested(100_000)}'),
     "prompt[0][0]"),
    ("100k nested arrays in metadata", CHAT, raw(f'{USER}, "metadata": {nested(100_000)}'),
     None),
    ("100k nested arrays in tool_calls", CHAT,
     raw(f'"messages": [{{"role": "user", "content": "x", "tool_calls": {nested(100_000)}}}]'),
     None),
    ("100k nested objects in response_format", CHAT,
     raw(f'{USER}, "response_format": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000), None),
    ("100k-entry logit_bias", COMPLETIONS,
     raw(f'{PROMPT}, "logit_bias": {{' + ",".join(f'"{i}":0' for i in range(100_000)) + "}"),
     "logit_bias"),
    ("n=128 x max_tokens past the context", COMPLETIONS,
     json.dumps(completion(n=128, best_of=128, max_tokens=32_768)).encode(), "max_tokens"),
    # Once an int64 overflow in the sampler: a 500 for every request in the batch.
    ("top_k 10**100", CHAT, raw(f'{USER}, "top_k": {BIG}'), "top_k"),
    ("stop_token_ids 10**100", COMPLETIONS, raw(f'{PROMPT}, "stop_token_ids": [{BIG}]'),
     "stop_token_ids"),
    ("logit_bias key 10**100", CHAT, raw(f'{USER}, "logit_bias": {{"{BIG}": 1}}'), "logit_bias"),
    ("detokenize 10**100", "/detokenize", f'{{"tokens": [{BIG}]}}'.encode(), "tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [case[1:] for case in HOSTILE_BODIES],
    ids=[case[0] for case in HOSTILE_BODIES],
)
def test_hostile_body_is_an_openai_shaped_4xx(
    hostile: RunningServer, baseline_rss_kb: int, path: str, body: bytes, param: str | None
) -> None:
    response = httpx.post(
        hostile.base_url + path, content=body, timeout=TIMEOUT,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert 400 <= response.status_code < 500, response.text[:500]
    error = response.json()
    validate(error, "ErrorResponse")
    if param is not None:
        assert error["error"]["param"] == param, error
    assert_alive(hostile)


VALID_AT_THE_EDGES = [
    ("n=128 x best_of=128 x 1 token", COMPLETIONS, completion(n=128, best_of=128, max_tokens=1)),
    ("priority 10**100", COMPLETIONS, completion(max_tokens=1, priority=10**100)),
    ("top_k at the int64 edge", CHAT, chat(max_tokens=1, top_k=2**63 - 1)),
    ("min_tokens 10**100", COMPLETIONS, completion(max_tokens=1, min_tokens=10**100)),
    ("seed at the int64 edges", CHAT, chat(max_tokens=1, seed=2**63 - 1)),
]


@pytest.mark.parametrize(
    ("path", "body"),
    [case[1:] for case in VALID_AT_THE_EDGES],
    ids=[case[0] for case in VALID_AT_THE_EDGES],
)
def test_values_at_the_edges_are_served_or_refused_never_a_5xx(
    hostile: RunningServer, baseline_rss_kb: int, path: str, body: dict[str, object]
) -> None:
    response = httpx.post(hostile.base_url + path, json=body, timeout=TIMEOUT)
    assert response.status_code < 500, response.text[:500]
    if response.status_code != 200:
        validate(response.json(), "ErrorResponse")
    assert_alive(hostile)


def test_n_x_max_tokens_past_the_kv_cache_ends_when_the_client_gives_up(
    hostile: RunningServer, baseline_rss_kb: int
) -> None:
    """Each choice fits the context, so this is admitted (choices share the KV cache by taking
    turns); a client that stops waiting has every choice aborted, freeing the engine."""
    body = completion(n=128, best_of=128, max_tokens=32_000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(hostile.base_url + COMPLETIONS, json=body, timeout=httpx.Timeout(3.0))

    def idle() -> bool:
        scheduler = api_metrics(hostile.base_url)["scheduler"]
        return scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0

    assert wait_until(idle, timeout_s=60)
    assert_alive(hostile)


# ------------------------------------------------------------------ the transport


def _raw_exchange(
    server: RunningServer,
    request: bytes,
    piece: int | None = None,
    pause_s: float = 0.0,
    half_close: bool = True,
) -> bytes:
    """Send `request` over a plain socket (in `piece`-byte pieces `pause_s` apart), then (with
    `half_close`) shut the sending side, and read the answer until the server closes or 30 s
    pass."""
    host, port = server.base_url.removeprefix("http://").split(":")
    piece = piece or len(request)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for start in range(0, len(request), piece):
            sock.sendall(request[start : start + piece])
            time.sleep(pause_s)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return answer


def _status(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


@pytest.mark.parametrize(
    "headers",
    [
        {"x-padding": "a" * 100_000},
        {"authorization": "Bearer " + "k" * 100_000},
        {f"x-h{i}": "v" for i in range(2000)},
    ],
    ids=["100 KB header", "100 KB authorization", "2000 headers"],
)
def test_oversized_headers_are_refused_or_closed(
    hostile: RunningServer, baseline_rss_kb: int, headers: dict[str, str]
) -> None:
    body = json.dumps(completion(max_tokens=1)).encode()
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{lines}connection: close\r\n\r\n"
    ).encode() + body
    status = _status(_raw_exchange(hostile, request))
    # h11 answers 431 past its header limit; a closed connection (None) is as good.
    assert status is None or status < 500, status
    assert_alive(hostile)


def test_a_slow_body_is_still_served(hostile: RunningServer, baseline_rss_kb: int) -> None:
    body = json.dumps(completion(max_tokens=1)).encode()
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body
    started = time.monotonic()
    # No half-close after the body: to the server's disconnect watch, an EOF is a client that
    # hung up (httptools reports it as such), and the answer would race the cancellation.
    answer = _raw_exchange(hostile, request, piece=8, pause_s=0.1, half_close=False)  # ~3 s
    assert time.monotonic() - started > 2
    assert _status(answer) == 200, answer[:300]
    assert b'"text_completion"' in answer
    assert_alive(hostile)


def test_a_body_that_stops_midway_is_dropped(hostile: RunningServer, baseline_rss_kb: int) -> None:
    """A client that promises more body than it sends, then hangs up: nothing is generated."""
    request = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "content-length: 100000\r\n\r\n"
    ).encode() + b'{"model": "'
    status = _status(_raw_exchange(hostile, request))
    assert status is None or status < 500, status
    assert_alive(hostile)


# ------------------------------------------------------------------ WebSocket frames


def _ws_url(server: RunningServer) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/ws"


async def _ready_socket(server: RunningServer, max_size: int | None = 2**20) -> ClientConnection:
    ws = await connect(_ws_url(server), proxy=None, max_size=max_size)
    assert json.loads(await asyncio.wait_for(ws.recv(), 60))["type"] == "ready"
    return ws


async def _error_code(ws: ClientConnection, frame: str | bytes) -> str:
    await ws.send(frame)
    message = json.loads(await asyncio.wait_for(ws.recv(), 60))
    assert message["type"] == "error", message
    return message["error"]["code"]


def _generate(gid: str) -> dict[str, object]:
    return {"type": "generate", "id": gid, **completion(max_tokens=2, temperature=0)}


async def _done(ws: ClientConnection, gid: str) -> dict[str, object]:
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if message["type"] in ("done", "error") and message.get("id") == gid:
            return message


async def test_hostile_websocket_frames_get_errors(
    hostile: RunningServer, baseline_rss_kb: int
) -> None:
    ws = await _ready_socket(hostile)
    try:
        assert await _error_code(ws, b"\xff\xfe\x00 not utf-8") == "invalid_json"
        assert await _error_code(ws, b"") == "invalid_json"
        # Deep nesting used to escape as a RecursionError: an internal_error event.
        assert await _error_code(ws, nested(100_000)) == "invalid_json"
        deep = json.dumps(_generate("d"))[:-1] + f', "metadata": {nested(100_000)}}}'
        assert await _error_code(ws, deep) == "invalid_json"
        # A message in several continuation frames is one message.
        whole = json.dumps(_generate("frag"))
        await ws.send(whole[i : i + 7] for i in range(0, len(whole), 7))
        assert (await _done(ws, "frag"))["type"] == "done"
        pieces = [part.encode() for part in (whole[:10], whole[10:20], whole[20:])]
        await ws.send(iter([pieces[0], pieces[1], pieces[2].replace(b'"frag"', b'"bin"')]))
        assert (await _done(ws, "bin"))["type"] == "done"
    finally:
        await ws.close()
    assert_alive(hostile)


async def test_a_frame_over_the_socket_limit_closes_with_1009(
    hostile: RunningServer, baseline_rss_kb: int
) -> None:
    ws = await _ready_socket(hostile, max_size=None)
    try:
        await ws.send(b"x" * (WS_MAX_SIZE + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 60)
    finally:
        await ws.close()
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.MESSAGE_TOO_BIG
    # The server still takes new sockets.
    ws = await _ready_socket(hostile)
    await ws.send(json.dumps(_generate("after")))
    assert (await _done(ws, "after"))["type"] == "done"
    await ws.close()
    assert_alive(hostile)


def test_memory_stays_bounded_after_the_hostile_batch(
    hostile: RunningServer, baseline_rss_kb: int
) -> None:
    """Runs last in this module: nothing above may leave the server much larger."""
    assert_alive(hostile)
    grown = rss_kb(hostile) - baseline_rss_kb
    assert grown < RSS_GROWTH_LIMIT_KB, f"RSS grew by {grown / 1024:.0f} MB"
    assert "unhandled error" not in hostile.log()
