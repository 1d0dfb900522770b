"""Scale-out logic without Ray: route keys, the prefix table, the choice of replica
(deploy/routing.py), the proxy's middlewares (deploy/proxy.py) and VTC shared across replicas
(deploy/fairness.py, Scheduler.charge_remote), with exact expected values."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from deploy.fairness import ServedSince, ServiceLedger
from deploy.proxy import (
    REPLICA_FAILED,
    ReplicaFailureMiddleware,
    RouteKeysMiddleware,
    proxy_middlewares,
)
from deploy.routing import (
    ROUTE_SCOPE_KEY,
    AffinityPolicy,
    PrefixTable,
    RouteKeys,
    chunk_hashes,
    prompt_text,
    rendezvous,
    route_keys,
)
from tests.sched_driver import make_scheduler, make_seq, run_step

# ---------------------------------------------------------------- keys


def test_chunk_hashes_chain_whole_chunks_and_the_salt_seeds_the_chain():
    assert chunk_hashes("x" * 128) == ("852bb77eefd687cf",)
    assert chunk_hashes("x" * 128, salt="s") == ("18b7a8a2b5529778",)
    assert chunk_hashes("x" * 127) == ()  # a partial chunk is never cached, so never matched
    assert len(chunk_hashes("x" * 300)) == 2
    ab, ac = chunk_hashes("a" * 128 + "b" * 128), chunk_hashes("a" * 128 + "c" * 128)
    assert ab[0] == ac[0] and ab[1] != ac[1]
    # Each hash covers everything before it: equal second chunks after different first ones differ.
    assert chunk_hashes("a" * 128 + "b" * 128)[1] != chunk_hashes("z" * 128 + "b" * 128)[1]


def test_prompt_text_of_chats_and_completions():
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    }
    assert prompt_text(chat) == "system\x1fBe brief.\x1euser\x1fHi!\x1e"
    # The next turn resends the history: its text extends the last one's.
    turn = {"messages": [*chat["messages"], {"role": "assistant", "content": "Hello."}]}
    assert prompt_text(turn).startswith(prompt_text(chat))
    assert prompt_text({"prompt": "Once upon"}) == "Once upon"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 22, 333]}) == "1,22,333"
    assert prompt_text({"prompt": [[7, 8], [9]]}) == "7,8"
    assert prompt_text({}) == ""


def test_route_keys_session_from_the_header_else_the_user_field():
    body = json.dumps({"user": "u1", "prompt": "p" * 256}).encode()
    assert route_keys("s1", body) == RouteKeys("s1", chunk_hashes("p" * 256))
    assert route_keys(None, body).session == "u1"
    assert route_keys(None, json.dumps({"prompt": "p" * 256}).encode()).session is None
    salted = json.dumps({"prompt": "p" * 256, "cache_salt": "tenant-a"}).encode()
    assert route_keys(None, salted).prefix == chunk_hashes("p" * 256, salt="tenant-a")
    # A body the replica will refuse routes on the header alone.
    assert route_keys("s1", b"{not json") == RouteKeys("s1")
    assert route_keys(None, b"[1, 2]") == RouteKeys()
    assert route_keys(None, None) == RouteKeys()


# ---------------------------------------------------------------- the prefix table


def test_prefix_table_longest_live_match_and_lru_bound():
    table = PrefixTable(capacity=4)
    table.record(["h1", "h2", "h3"], "a")
    table.record(["h1", "h2"], "b")
    assert table.longest(["h1", "h2", "h3", "h4"], ["a", "b"]) == (3, ["a"])
    assert table.longest(["h1", "h2", "h3"], ["b"]) == (2, ["b"])  # a is gone
    assert table.longest(["h1", "x2"], ["a", "b"]) == (1, ["a", "b"])
    assert table.longest(["x1", "h2"], ["a", "b"]) == (0, [])  # a chain breaks at a miss
    table.record(["g1", "g2"], "c")  # 5 hashes > 4: the least recently recorded (h3) goes
    assert len(table) == 4
    assert table.longest(["h1", "h2", "h3"], ["a", "b", "c"]) == (2, ["a", "b"])


# ---------------------------------------------------------------- the choice


def test_rendezvous_moves_only_the_sessions_of_a_lost_replica():
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    three = {s: rendezvous(s, ["r1", "r2", "r3"]) for s in names}
    two = {s: rendezvous(s, ["r1", "r2"]) for s in names}
    assert three == {
        "alice": "r1", "bob": "r1", "carol": "r2", "dave": "r1", "erin": "r2", "frank": "r3",
        "grace": "r2", "heidi": "r3",
    }  # fmt: skip
    assert {s for s in names if three[s] != two[s]} == {"frank", "heidi"}
    assert rendezvous("frank", ["r3", "r2", "r1"]) == "r3"  # order does not matter


def test_a_session_goes_where_it_went_before_else_where_it_hashes():
    policy = AffinityPolicy()
    idle = {"r1": 0, "r2": 0, "r3": 0}
    assert policy.rank(RouteKeys("carol"), idle) == [["r2"], ["r1", "r3"]]
    policy.record(RouteKeys("carol"), "r3")  # sent elsewhere once (r2 was full): stays there
    assert policy.rank(RouteKeys("carol"), {"r1": 0, "r2": 0, "r3": 50}) == [["r3"], ["r1", "r2"]]
    # Its replica gone: it hashes among the live ones.
    assert policy.rank(RouteKeys("carol"), {"r1": 5, "r2": 0}) == [["r2"], ["r1"]]
    assert policy.rank(RouteKeys("carol"), {"r1": 0}) == [["r1"]]
    assert policy.rank(RouteKeys("carol"), {}) == []


def test_no_session_goes_to_the_longest_prefix_unless_that_replica_is_far_behind():
    policy = AffinityPolicy(imbalance=4)
    policy.record(RouteKeys(None, ("h1",)), "r1")
    policy.record(RouteKeys(None, ("h1", "h2", "h3")), "r2")
    keys = RouteKeys(None, ("h1", "h2", "h3", "h4"))
    assert policy.rank(keys, {"r1": 0, "r2": 4, "r3": 0}) == [["r2"], ["r1", "r3"]]
    assert policy.rank(keys, {"r1": 0, "r2": 5, "r3": 0}) == [["r1"], ["r3", "r2"]]
    # A prefix both hold (a shared system prompt) goes to the less loaded of the two.
    assert policy.rank(RouteKeys(None, ("h1",)), {"r1": 3, "r2": 2, "r3": 0}) == [
        ["r2"],
        ["r3", "r1"],
    ]
    # Nothing matches: the least loaded, ties by name.
    assert policy.rank(RouteKeys(None, ("zz",)), {"r2": 1, "r1": 1, "r3": 2}) == [
        ["r1"],
        ["r2", "r3"],
    ]


def test_requests_in_flight_count_at_once_so_a_burst_spreads():
    policy = AffinityPolicy()
    reported = {"r1": 0, "r2": 0}  # the replicas' reports lag: all still say idle
    firsts = []
    for request in ("q1", "q2", "q3", "q4"):
        first = policy.rank(RouteKeys(), reported)[0][0]
        policy.aim(request, first)
        firsts.append(first)
    assert firsts == ["r1", "r2", "r1", "r2"]
    policy.aim("q1", "r2")  # q1 actually went to r2
    assert dict(policy.inflight) == {"r1": 1, "r2": 3}
    for request in ("q1", "q2", "q3"):
        policy.done(request)
    policy.done("q1")  # a second completion of one request changes nothing
    assert dict(policy.inflight) == {"r1": 0, "r2": 1}
    # A replica's report counts when it is above this router's own count (others' requests).
    assert policy.rank(RouteKeys(), {"r1": 3, "r2": 0}) == [["r2"], ["r1"]]


def test_requests_never_completed_stop_counting_past_the_bound():
    policy = AffinityPolicy(max_requests=2)
    for request in ("q1", "q2", "q3"):
        policy.aim(request, "r1")
    assert policy.inflight["r1"] == 2


# ---------------------------------------------------------------- the proxy's middlewares


async def _call(app, scope: dict, messages: list[dict]) -> list[dict]:
    """Run an ASGI app on `messages` as the client's; returns what it sent."""
    pending = list(messages)
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _http(path: str, method: str = "POST", headers: tuple = ()) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": list(headers)}


def test_route_keys_middleware_reads_the_body_and_replays_it_unchanged():
    seen: dict = {}

    async def proxy(scope, receive, send) -> None:
        seen["keys"] = scope[ROUTE_SCOPE_KEY]
        seen["messages"] = [await receive(), await receive()]

    body = json.dumps({"user": "u1", "prompt": "p" * 128}).encode()
    parts = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.request", "body": body[10:], "more_body": False},
    ]
    scope = _http("/v1/completions", headers=((b"X-Session-Id", b"s1"),))
    asyncio.run(_call(RouteKeysMiddleware(proxy), scope, parts))
    assert seen == {"keys": RouteKeys("s1", chunk_hashes("p" * 128)), "messages": parts}

    # Over the limit: not parsed, still replayed; other routes' bodies are not read.
    asyncio.run(
        _call(RouteKeysMiddleware(proxy, max_body_bytes=20), _http("/v1/completions"), parts)
    )
    assert seen == {"keys": RouteKeys(), "messages": parts}
    asyncio.run(_call(RouteKeysMiddleware(proxy), _http("/tokenize"), parts))
    assert seen["keys"] == RouteKeys() and seen["messages"] == parts
    # A WebSocket handshake routes on its X-Session-Id.
    ws = {"type": "websocket", "path": "/v1/ws", "headers": [(b"x-session-id", b"s2")]}
    asyncio.run(_call(RouteKeysMiddleware(proxy), ws, parts))
    assert seen["keys"] == RouteKeys("s2")


def _start(status: int, media_type: bytes) -> dict:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", media_type)],
    }


def test_a_stream_cut_by_a_dead_replica_ends_with_an_openai_error_event():
    async def cut(scope, receive, send) -> None:
        await send(_start(200, b"text/event-stream"))
        await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True})

    sent = _guarded(cut)
    error = {"error": {"message": REPLICA_FAILED, "type": "server_error", "param": None,
                       "code": "internal_error"}}  # fmt: skip
    assert sent[-1] == {
        "type": "http.response.body",
        "body": b"data: " + msgspec.json.encode(error) + b"\n\ndata: [DONE]\n\n",
        "more_body": False,
    }
    assert len(sent) == 3

    async def whole(scope, receive, send) -> None:
        await send(_start(200, b"text/event-stream"))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    assert (
        len(asyncio.run(_call(ReplicaFailureMiddleware(whole), _http("/v1/completions"), []))) == 2
    )


def _guarded(app, path: str = "/v1/completions") -> list[dict]:
    return asyncio.run(_call(ReplicaFailureMiddleware(app), _http(path), []))


def _answer(status: int, media_type: bytes, body: bytes):
    async def app(scope, receive, send) -> None:
        await send(_start(status, media_type))
        await send({"type": "http.response.body", "body": body})

    return app


def test_a_request_left_unanswered_gets_an_openai_500():
    async def silent(scope, receive, send) -> None:
        return None

    async def failing(scope, receive, send) -> None:
        raise RuntimeError("the proxy failed")

    error = {"message": REPLICA_FAILED, "type": "server_error", "param": None,
             "code": "internal_error"}  # fmt: skip
    sent = _guarded(silent)
    assert (sent[0]["status"], json.loads(sent[1]["body"])) == (500, {"error": error})
    answered: list[dict] = []

    async def send(message: dict) -> None:
        answered.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    with pytest.raises(RuntimeError, match="the proxy failed"):  # still raised, for the logs
        asyncio.run(ReplicaFailureMiddleware(failing)(_http("/v1/completions"), receive, send))
    assert answered[0]["status"] == 500


def test_the_proxys_plain_text_errors_become_openai_errors_and_the_apps_pass():
    sent = _guarded(_answer(500, b"text/plain; charset=utf-8", b"Internal Server Error"))
    assert sent[0]["status"] == 500
    assert json.loads(sent[1]["body"])["error"] == {
        "message": REPLICA_FAILED, "type": "server_error", "param": None, "code": "internal_error"
    }  # fmt: skip
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(sent[1]["body"])).encode()
    sent = _guarded(_answer(503, b"text/plain", b"No replicas."), "/health")
    assert (sent[0]["status"], json.loads(sent[1]["body"])["error"]["message"]) == (
        503,
        "No replicas.",
    )
    # The app's own errors are OpenAI's already: passed as they are.
    own = _answer(500, b"application/json", b'{"error": {}}')
    assert [m.get("body") for m in _guarded(own)] == [None, b'{"error": {}}']


def test_proxy_middlewares_take_the_replicas_body_limit(monkeypatch):
    monkeypatch.setenv("MAX_BODY_BYTES", "2048")
    route, failure = proxy_middlewares()
    assert route.cls is RouteKeysMiddleware and route.kwargs == {"max_body_bytes": 2048}
    assert failure.cls is ReplicaFailureMiddleware


# ---------------------------------------------------------------- fairness across replicas


def test_the_ledger_tells_each_replica_what_the_others_served_since_it_last_asked():
    ledger = ServiceLedger(stale_s=10)
    assert ledger.exchange("a", {"heavy": (100, 10)}, now=0) == {}
    assert ledger.exchange("b", {"light": (5, 1)}, now=0) == {}  # b joins: nothing owed yet
    assert ledger.exchange("a", {"heavy": (50, 5)}, now=1) == {"light": (5, 1)}
    assert ledger.exchange("b", {}, now=1) == {"heavy": (50, 5)}
    assert ledger.exchange("b", {}, now=2) == {}
    # a stops exchanging (gone): dropped after stale_s, so nothing accumulates for it.
    assert ledger.exchange("b", {"light": (1, 1)}, now=20) == {}
    assert ledger.exchange("a", {}, now=21) == {}


def test_served_since_turns_running_totals_into_deltas():
    served = ServedSince()
    assert served.delta({"t": (10, 2), "u": (0, 0)}) == {"t": (10, 2)}
    assert served.delta({"t": (15, 2), "u": (3, 1)}) == {"t": (5, 0), "u": (3, 1)}
    assert served.delta({"t": (15, 2)}) == {}
    assert served.delta({"t": (4, 1)}) == {"t": (4, 1)}  # t was retired and came back


def test_charge_remote_raises_known_tenants_counters_only():
    sched = make_scheduler(policy="vtc", max_num_batched_tokens=8)
    sched.add(make_seq(4, max_tokens=1, tenant="x"))
    run_step(sched)
    assert sched.policy.counters() == {"x": 4.0 + 2.0}
    sched.charge_remote({"x": (10, 3), "stranger": (100, 100)})
    assert sched.policy.counters() == {"x": 6.0 + 10.0 + 6.0}  # w_p = 1, w_q = 2
    assert sched.ledger.service("x") == 6.0  # this replica's own service
    fcfs = make_scheduler(policy="fcfs")
    fcfs.charge_remote({"x": (10, 3)})
    assert fcfs.policy.counters() == {}
