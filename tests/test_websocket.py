"""WS /v1/ws against a real server: concurrent generations, cancel, sessions that reuse the
prefix cache, malformed and oversized frames, auth, overload, and disconnect freeing KV."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server

RECV_TIMEOUT_S = 120  # one message; generous for a loaded 2-core machine
MAX_BODY_BYTES = 1_000_000  # the server's default frame limit
LONG = 256  # max_tokens of generations that are cancelled or dropped long before the end


def ws_url(server: RunningServer) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/ws"


def chat(gid: str, text: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "type": "generate", "id": gid, "model": MODEL_ID, "temperature": 0,
        "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}], **extra,
    }  # fmt: skip


def completion(gid: str, prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "type": "generate", "id": gid, "model": MODEL_ID, "temperature": 0,
        "max_tokens": max_tokens, "prompt": prompt, **extra,
    }  # fmt: skip


async def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))


async def send(ws: ClientConnection, message: dict[str, Any] | str | bytes) -> None:
    await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))


async def open_ready(server: RunningServer, **kwargs: Any) -> ClientConnection:
    ws = await connect(ws_url(server), proxy=None, **kwargs)
    ready = await recv(ws)
    assert ready["type"] == "ready", ready
    return ws


async def until_finished(ws: ClientConnection, ids: set[str]) -> list[dict[str, Any]]:
    """Every message received until each id got its `done` or `error`."""
    messages, pending = [], set(ids)
    while pending:
        message = await recv(ws)
        messages.append(message)
        if message["type"] in ("done", "error") and message.get("id") in pending:
            pending.discard(message["id"])
    return messages


def text_of(messages: list[dict[str, Any]], gid: str, choice: int = 0) -> str:
    return "".join(
        m["text"] for m in messages if m["type"] == "delta" and m["id"] == gid
        and m["choice"] == choice
    )  # fmt: skip


def final(messages: list[dict[str, Any]], gid: str) -> dict[str, Any]:
    return next(m for m in messages if m["type"] in ("done", "error") and m.get("id") == gid)


async def api_metrics(server: RunningServer) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        return (await client.get(server.base_url + "/api/metrics", timeout=30)).json()


async def wait_idle(server: RunningServer, timeout_s: float = 60) -> dict[str, Any]:
    """/api/metrics once nothing runs or waits and no sequence holds KV blocks."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        snapshot = await api_metrics(server)
        sched, kv = snapshot["scheduler"], snapshot["kv"]
        idle = sched["num_running"] == 0 and sched["num_waiting"] == 0
        if idle and kv["num_sequences"] == 0 and sched["kv_usage"] == 0.0:
            return snapshot
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the engine did not go idle: {sched} {kv}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def ws(server: RunningServer) -> AsyncIterator[ClientConnection]:
    connection = await open_ready(server)
    yield connection
    await connection.close()


# --- the handshake ---------------------------------------------------------------------------


async def test_ready_names_the_model_and_the_frame_limit(server: RunningServer) -> None:
    async with connect(ws_url(server), proxy=None) as ws:
        ready = await recv(ws)
        # Without API_KEYS an `auth` message (as a browser client sends) is just acknowledged.
        await send(ws, {"type": "auth", "api_key": "anything"})
        assert await recv(ws) == ready
    assert ready["type"] == "ready"
    assert ready["model"] == MODEL_ID
    assert ready["max_message_bytes"] == MAX_BODY_BYTES
    assert ready["connection_id"].startswith("ws-")


# --- generations -----------------------------------------------------------------------------


async def test_two_concurrent_generations_interleave_and_match_http(
    server: RunningServer, ws: ClientConnection
) -> None:
    # ignore_eos: both run the full 8 tokens, so they share decode steps.
    chat_message = chat("a", "Name three colours.", ignore_eos=True)
    completion_message = completion("b", "The capital of France is", ignore_eos=True)
    await send(ws, chat_message)
    await send(ws, completion_message)
    messages = await until_finished(ws, {"a", "b"})

    order = [m["id"] for m in messages if m["type"] == "delta"]
    assert set(order) == {"a", "b"}
    first_done = next(i for i, m in enumerate(messages) if m["type"] == "done")
    assert {m["id"] for m in messages[:first_done] if m["type"] == "delta"} == {"a", "b"}
    for gid in ("a", "b"):
        done = final(messages, gid)
        assert done["type"] == "done"
        assert done["finish_reason"] == "length"
        assert done["finish_reasons"] == ["length"]
        assert done["usage"]["completion_tokens"] == 8
        assert "session" not in done

    # Greedy decoding: the same text and usage as the HTTP endpoints give for the same bodies.
    # Each runs alone on both sides: under the approximate kernels a sequence's last bits, and
    # so a near tie between two tokens, can depend on what shares its step (the padding of the
    # fused attention), so a pair run together is not compared with one run alone.
    def http_body(message: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in message.items() if k not in ("type", "id")}

    alone = {}
    for message in (chat_message, completion_message):
        await send(ws, message)
        alone[message["id"]] = await until_finished(ws, {message["id"]})
    async with httpx.AsyncClient(timeout=RECV_TIMEOUT_S) as client:
        http_chat = await client.post(server.v1 + "/chat/completions", json=http_body(chat_message))
        http_completion = await client.post(
            server.v1 + "/completions", json=http_body(completion_message)
        )
    assert text_of(alone["a"], "a") == http_chat.json()["choices"][0]["message"]["content"]
    ws_usage, http_usage = final(messages, "a")["usage"], http_chat.json()["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert ws_usage[key] == http_usage[key]
    assert text_of(alone["b"], "b") == http_completion.json()["choices"][0]["text"]


async def test_n_choices_and_echo_stream_per_choice(ws: ClientConnection) -> None:
    await send(ws, completion("e", "Once upon a time", max_tokens=4, n=2, echo=True,
                              ignore_eos=True))  # fmt: skip
    messages = await until_finished(ws, {"e"})
    done = final(messages, "e")
    assert done["finish_reasons"] == ["length", "length"]
    assert done["usage"]["completion_tokens"] == 8
    for choice in (0, 1):
        first = next(m for m in messages if m["type"] == "delta" and m["choice"] == choice)
        assert first["text"] == "Once upon a time"
    # Greedy: both choices are the same text.
    assert text_of(messages, "e", 0) == text_of(messages, "e", 1)


async def test_logprobs_come_in_the_endpoints_shape(ws: ClientConnection) -> None:
    await send(ws, completion("lc", "Hello", max_tokens=3, logprobs=2, ignore_eos=True))
    await send(ws, chat("lh", "Hello", max_tokens=3, logprobs=True, top_logprobs=2,
                        ignore_eos=True))  # fmt: skip
    messages = await until_finished(ws, {"lc", "lh"})
    legacy = [m["logprobs"] for m in messages if m["type"] == "delta" and m["id"] == "lc"]
    assert sum(len(lp["tokens"]) for lp in legacy) == 3
    offsets = [o for lp in legacy for o in lp["text_offset"]]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert "".join(t for lp in legacy for t in lp["tokens"]) == text_of(messages, "lc")
    content = [c for m in messages if m["type"] == "delta" and m["id"] == "lh"
               for c in m["logprobs"]["content"]]  # fmt: skip
    assert len(content) == 3
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert "logprobs" not in next(m for m in messages if m["type"] == "done")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


async def test_tool_calls_and_structured_outputs_over_the_socket(ws: ClientConnection) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    await send(ws, chat("call", "Weather in Paris?", max_tokens=60, tools=[WEATHER_TOOL],
                        tool_choice=named))  # fmt: skip
    await send(ws, completion("pick", "My favourite colour is", max_tokens=5,
                              structured_outputs={"choice": ["red", "green", "blue"]}))  # fmt: skip
    messages = await until_finished(ws, {"call", "pick"})
    assert final(messages, "call")["finish_reason"] == "tool_calls"
    parts = [c for m in messages if m["type"] == "delta" and m["id"] == "call"
             for c in m.get("tool_calls", [])]  # fmt: skip
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert all("id" not in p and "name" not in p["function"] for p in parts[1:])
    arguments = json.loads("".join(p["function"]["arguments"] for p in parts))
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert len(arguments["city"]) <= 20
    assert text_of(messages, "call") == ""
    assert final(messages, "pick")["finish_reason"] == "stop"
    assert text_of(messages, "pick") in ("red", "green", "blue")


async def test_a_session_keeps_a_tool_call_turn_in_its_history(ws: ClientConnection) -> None:
    await send(ws, {"type": "session.start", "session": "agent"})
    assert (await recv(ws))["type"] == "session.started"
    named = {"type": "function", "function": {"name": "get_weather"}}
    await send(ws, chat("t1", "Weather in Paris?", max_tokens=60, session="agent",
                        tools=[WEATHER_TOOL], tool_choice=named))  # fmt: skip
    messages = await until_finished(ws, {"t1"})
    [first] = [c for m in messages if m["type"] == "delta" for c in m.get("tool_calls", [])][:1]
    # The next turn answers the call by its id: the server kept the assistant's tool call.
    result = {"role": "tool", "tool_call_id": first["id"], "content": "18 degrees"}
    await send(ws, {**chat("t2", "", max_tokens=4, session="agent", tools=[WEATHER_TOOL]),
                    "messages": [result]})  # fmt: skip
    done = final(await until_finished(ws, {"t2"}), "t2")
    assert done["type"] == "done", done
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_generation_id_in_flight_cannot_be_reused(ws: ClientConnection) -> None:
    await send(ws, completion("dup", "Hello", max_tokens=LONG, ignore_eos=True))
    await send(ws, completion("dup", "Hello again"))
    messages = []
    while not any(m["type"] == "error" for m in messages):
        messages.append(await recv(ws))
    error = next(m for m in messages if m["type"] == "error")
    assert error["id"] is None  # "dup" still runs: its one end is still to come
    assert error["error"]["code"] == "duplicate_id"
    assert error["error"]["param"] == "id"
    await send(ws, {"type": "cancel", "id": "dup"})
    done = final(await until_finished(ws, {"dup"}), "dup")
    assert done["type"] == "done" and done["finish_reason"] == "abort"


async def test_cancel_ends_with_abort_and_frees_the_sequence(
    server: RunningServer, ws: ClientConnection
) -> None:
    await send(ws, completion("c", "Count: one, two, three,", max_tokens=LONG, ignore_eos=True))
    first = await recv(ws)
    assert first["type"] == "delta" and first["id"] == "c"
    await send(ws, {"type": "cancel", "id": "c"})
    messages = await until_finished(ws, {"c"})
    done = final(messages, "c")
    assert done["type"] == "done"
    assert done["finish_reason"] == "abort"
    assert 1 <= done["usage"]["completion_tokens"] < LONG
    await wait_idle(server)
    # Cancelling again: nothing of that id is in flight any more.
    await send(ws, {"type": "cancel", "id": "c"})
    error = await recv(ws)
    assert error["type"] == "error" and error["id"] == "c"
    assert error["error"]["code"] == "not_found" and error["error"]["param"] == "id"


# --- sessions --------------------------------------------------------------------------------


async def test_session_turns_reuse_the_cached_prefix(
    server: RunningServer, ws: ClientConnection
) -> None:
    await send(ws, {"type": "session.start", "session": "trip"})
    assert await recv(ws) == {"type": "session.started", "session": "trip"}
    hits_before = (await api_metrics(server))["kv"]["prefix_cache"]["hit_tokens"]

    turns = ["My name is Ada and I am planning a trip.", "Where should I go in spring?",
             "What should I pack?"]  # fmt: skip
    history: list[dict[str, str]] = []
    usages = []
    for i, text in enumerate(turns):
        await send(ws, chat(f"t{i}", text, session="trip"))
        messages = await until_finished(ws, {f"t{i}"})
        done = final(messages, f"t{i}")
        assert done["type"] == "done", done
        assert done["session"] == "trip"
        usages.append(done["usage"])
        # The server's prompt is the whole conversation: the same count /tokenize gives.
        history.append({"role": "user", "content": text})
        async with httpx.AsyncClient(timeout=30) as client:
            tokenized = await client.post(
                server.base_url + "/tokenize", json={"model": MODEL_ID, "messages": history}
            )
        assert done["usage"]["prompt_tokens"] == tokenized.json()["count"]
        history.append({"role": "assistant", "content": text_of(messages, f"t{i}")})

    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    prompts = [u["prompt_tokens"] for u in usages]
    assert prompts[0] < prompts[1] < prompts[2]
    assert 0 < cached[1] < cached[2]  # each turn reuses the last turn's prompt + reply
    assert cached[1] >= prompts[0] - 16 and cached[2] >= prompts[1] - 16  # all but a block
    hits_after = (await api_metrics(server))["kv"]["prefix_cache"]["hit_tokens"]
    assert hits_after - hits_before == sum(cached)
    async with httpx.AsyncClient(timeout=30) as client:
        prom = (await client.get(server.base_url + "/metrics")).text
    hits_line = next(line for line in prom.splitlines()
                     if line.startswith("gemma_serve:prefix_cache_hits_total{"))  # fmt: skip
    assert float(hits_line.split()[-1]) == hits_after

    await send(ws, {"type": "session.end", "session": "trip"})
    assert await recv(ws) == {"type": "session.ended", "session": "trip"}
    await send(ws, chat("late", "Anyone there?", session="trip"))
    error = await recv(ws)
    assert error["id"] == "late" and error["error"]["code"] == "not_found"
    assert error["error"]["param"] == "session"


async def test_a_session_chooses_its_own_kv_eviction(
    server: RunningServer, ws: ClientConnection
) -> None:
    """A sink session with a 64-token KV budget generates 160 tokens: its blocks are evicted as
    it goes (the server default is no eviction) and the turn completes."""
    evicted_before = (await api_metrics(server))["kv"]["evicted_blocks"]
    await send(ws, {"type": "session.start", "session": "long", "eviction_policy": "sink",
                    "kv_tokens": 64})  # fmt: skip
    assert await recv(ws) == {"type": "session.started", "session": "long"}
    await send(ws, chat("s0", "Tell me everything.", max_tokens=160, ignore_eos=True,
                        session="long"))  # fmt: skip
    done = final(await until_finished(ws, {"s0"}), "s0")
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 160
    snapshot = await wait_idle(server)
    # Over ~170 tokens in 16-token blocks with a 4-block budget: at least 6 blocks dropped.
    assert snapshot["kv"]["evicted_blocks"] - evicted_before >= 6

    for bad, param in (({"eviction_policy": "fifo"}, "eviction_policy"),
                       ({"eviction_policy": "lru", "kv_tokens": 0}, "kv_tokens")):  # fmt: skip
        await send(ws, {"type": "session.start", **bad})
        error = await recv(ws)
        assert error["type"] == "error" and error["error"]["param"] == param


async def test_session_refusals(server: RunningServer, ws: ClientConnection) -> None:
    await send(ws, {"type": "session.start"})
    started = await recv(ws)
    name = started["session"]
    assert started["type"] == "session.started" and name.startswith("sess-")

    await send(ws, {"type": "session.start", "session": name})
    assert (await recv(ws))["error"]["code"] == "session_exists"
    # Names are echoed in every event and logged: bounded like `user` (256 characters).
    await send(ws, {"type": "session.start", "session": "s" * 257})
    error = await recv(ws)
    assert (error["id"], error["error"]["param"], error["error"]["message"]) == (
        None, "session", "Invalid value for 'session': expected string of length <= 256."
    )  # fmt: skip
    await send(ws, completion("i" * 257, "Hi"))
    error = await recv(ws)
    assert (error["id"], error["error"]["param"]) == (None, "id")
    await send(ws, completion("p", "Hi", session=name))
    error = await recv(ws)
    assert error["error"]["param"] == "session" and error["error"]["code"] == "invalid_value"
    await send(ws, chat("n2", "Hi", session=name, n=2))
    assert (await recv(ws))["error"]["param"] == "n"

    # One turn at a time; a refused or cancelled turn is not recorded in the history.
    await send(ws, chat("busy1", "Tell me a long story.", max_tokens=LONG, ignore_eos=True,
                        session=name))  # fmt: skip
    await send(ws, chat("busy2", "And another.", session=name))
    messages = []
    while not any(m["type"] == "error" for m in messages):
        messages.append(await recv(ws))
    error = next(m for m in messages if m["type"] == "error")
    assert error["id"] == "busy2" and error["error"]["code"] == "session_busy"
    await send(ws, {"type": "cancel", "id": "busy1"})
    messages = await until_finished(ws, {"busy1"})
    assert final(messages, "busy1")["finish_reason"] == "abort"
    await send(ws, chat("first", "Hello!", max_tokens=2, session=name))
    done = final(await until_finished(ws, {"first"}), "first")
    async with httpx.AsyncClient(timeout=30) as client:
        tokenized = await client.post(
            server.base_url + "/tokenize",
            json={"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello!"}]},
        )
    assert done["usage"]["prompt_tokens"] == tokenized.json()["count"]


# --- malformed, invalid and oversized messages -----------------------------------------------


async def test_malformed_messages_get_errors_and_the_socket_stays_usable(
    ws: ClientConnection,
) -> None:
    cases: list[tuple[dict[str, Any] | str | bytes, str | None, str | None, str | None]] = [
        # (frame, expected id, code, param)
        ("not json {", None, "invalid_json", None),
        ("[1, 2]", None, "invalid_type", None),
        ({"id": "x"}, "x", "missing_required_parameter", "type"),
        ({"type": 7}, None, "invalid_type", "type"),
        ({"type": "dance"}, None, "invalid_value", "type"),
        ({"type": "generate", "model": MODEL_ID, "prompt": "x"}, None,
         "missing_required_parameter", "id"),
        ({"type": "generate", "id": "g"}, "g", "missing_required_parameter", "messages"),
        ({**completion("g", "x"), "temperature": 5}, "g", "invalid_value", "temperature"),
        ({k: v for k, v in completion("g", "x").items() if k != "model"}, "g",
         "missing_required_parameter", "model"),
        ({**completion("g", "x"), "model": "gpt-4"}, "g", "model_not_found", "model"),
        ({**chat("g", "x"), "messages": [{"role": "robot", "content": "x"}]}, "g",
         "invalid_value", "messages[0].role"),
        ({**completion("g", "x"), "endpoint": "images"}, "g", "invalid_value", "endpoint"),
        ({**completion("g", "x"), "max_tokens": 10**9}, "g", "context_length_exceeded",
         "max_tokens"),
        ({"type": "cancel"}, None, "missing_required_parameter", "id"),
        ({"type": "session.end", "session": "nope"}, None, "not_found", "session"),
    ]  # fmt: skip
    for frame, gid, code, param in cases:
        await send(ws, frame)
        message = await recv(ws)
        assert message["type"] == "error", (frame, message)
        assert message["id"] == gid, (frame, message)
        error = message["error"]
        assert (error["code"], error["param"]) == (code, param), (frame, error)
        assert error["type"] == "invalid_request_error"
        assert error["message"]

    # A binary frame carrying JSON is read like a text frame; the socket still works.
    await send(ws, json.dumps(completion("ok", "Hello", max_tokens=3)).encode())
    done = final(await until_finished(ws, {"ok"}), "ok")
    assert done["type"] == "done" and done["usage"]["completion_tokens"] >= 1


async def test_an_oversized_frame_is_refused_and_the_socket_stays_usable(
    ws: ClientConnection,
) -> None:
    await send(ws, "x" * (MAX_BODY_BYTES + 1))
    error = await recv(ws)
    assert error["type"] == "error" and error["id"] is None
    assert error["error"]["code"] == "request_too_large"
    assert str(MAX_BODY_BYTES) in error["error"]["message"]
    # A frame just under the limit (padded with JSON whitespace) is served as usual.
    body = json.dumps(completion("big", "Hello", max_tokens=2))
    await send(ws, body + " " * (MAX_BODY_BYTES - len(body)))
    done = final(await until_finished(ws, {"big"}), "big")
    assert done["type"] == "done", done


# --- disconnect ------------------------------------------------------------------------------


async def test_closing_the_socket_aborts_its_generations_and_frees_kv(
    server: RunningServer,
) -> None:
    baseline = await wait_idle(server)
    aborted_before = baseline["scheduler"]["num_aborted"]
    ws = await open_ready(server)
    for gid in ("x1", "x2"):
        await send(ws, completion(gid, f"Story {gid}:", max_tokens=LONG, ignore_eos=True))
    seen: set[str] = set()
    while seen != {"x1", "x2"}:
        message = await recv(ws)
        assert message["type"] == "delta", message
        seen.add(message["id"])
    running = (await api_metrics(server))["scheduler"]
    assert running["num_running"] + running["num_waiting"] == 2
    await ws.close()
    after = await wait_idle(server)
    assert after["scheduler"]["num_aborted"] - aborted_before == 2
    # Back to the baseline: no block held by a sequence (published ones stay cached; blocks
    # pinned by earlier tests' sessions stay pinned, and count as free).
    assert after["kv"]["usage"] == baseline["kv"]["usage"] == 0.0
    assert after["kv"]["num_free_blocks"] == after["kv"]["groups"]["full"]["total"]
    in_use = {name: group["in_use"] for name, group in after["kv"]["groups"].items()}
    assert in_use == {name: group["in_use"] for name, group in baseline["kv"]["groups"].items()}
    assert after["kv"]["pinned_sessions"] == baseline["kv"]["pinned_sessions"]


# --- auth and overload (a server of their own) -----------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """API keys on, and room for one running and one waiting request only."""
    running = start_server(
        tmp_path_factory.mktemp("keyed"), API_KEYS="alice:sk-alice,sk-bob",
        MAX_BATCH_SIZE="1", MAX_QUEUE_LEN="1",
    )  # fmt: skip
    yield running
    stop_server(running)


async def refused(server: RunningServer, first: dict | None, **kwargs: Any) -> tuple[dict, int]:
    """The error message and close code of a socket that is refused authentication."""
    async with connect(ws_url(server), proxy=None, **kwargs) as ws:
        if first is not None:
            await send(ws, first)
        error = await recv(ws)
        with pytest.raises(ConnectionClosed):
            await recv(ws)
        assert ws.close_code is not None
        return error, ws.close_code


async def test_auth_refusals_close_with_4401(keyed_server: RunningServer) -> None:
    cases = [
        (completion("g", "x"), {}, "missing_api_key"),
        ({"type": "auth"}, {}, "missing_api_key"),
        ({"type": "auth", "api_key": "sk-wrong"}, {}, "invalid_api_key"),
        (None, {"additional_headers": {"Authorization": "Bearer sk-wrong"}}, "invalid_api_key"),
        (None, {"additional_headers": {"Authorization": "Basic sk-alice"}}, "missing_api_key"),
    ]
    for first, kwargs, code in cases:
        error, close_code = await refused(keyed_server, first, **kwargs)
        assert close_code == 4401, (first, kwargs)
        assert error["type"] == "error" and error["id"] is None
        assert error["error"]["code"] == code, (first, kwargs, error)
        assert error["error"]["type"] == "invalid_request_error"
        assert "sk-wrong" not in error["error"]["message"]


async def test_auth_by_header_or_first_message_names_the_tenant(
    keyed_server: RunningServer,
) -> None:
    headers = {"Authorization": "Bearer sk-alice"}
    ws = await open_ready(keyed_server, additional_headers=headers)
    await send(ws, {"type": "auth", "api_key": "sk-alice"})
    assert (await recv(ws))["error"]["code"] == "already_authenticated"
    await send(ws, completion("a", "Hi", max_tokens=2, user="mallory"))
    assert final(await until_finished(ws, {"a"}), "a")["type"] == "done"
    await ws.close()

    async with connect(ws_url(keyed_server), proxy=None) as ws:
        await send(ws, {"type": "auth", "api_key": "sk-bob"})
        assert (await recv(ws))["type"] == "ready"
        await send(ws, completion("b", "Hi", max_tokens=2))
        assert final(await until_finished(ws, {"b"}), "b")["type"] == "done"

    tenants = (await api_metrics(keyed_server))["scheduler"]["tenants"]
    assert {"alice", "key-2"} <= set(tenants)  # a bare key is named by its place, not itself
    assert "mallory" not in tenants  # the key names the tenant, not the user field


async def test_overload_is_rate_limit_exceeded_with_retry_after(
    keyed_server: RunningServer,
) -> None:
    ws = await open_ready(keyed_server, additional_headers={"Authorization": "Bearer sk-alice"})
    ids = {"q1", "q2", "q3"}
    for gid in sorted(ids):
        await send(ws, completion(gid, "Busy busy", max_tokens=16, ignore_eos=True))
    messages = await until_finished(ws, ids)
    finals = {gid: final(messages, gid) for gid in ids}
    limited = [m for m in finals.values() if m["type"] == "error"]
    assert limited, "one running + one waiting: the third is refused"
    for error in limited:
        assert error["error"]["code"] == "rate_limit_exceeded"
        assert error["error"]["type"] == "rate_limit_exceeded"
        assert isinstance(error["retry_after"], int) and error["retry_after"] >= 1
    assert finals["q1"]["type"] == "done"
    assert finals["q1"]["usage"]["completion_tokens"] == 16
    await ws.close()
