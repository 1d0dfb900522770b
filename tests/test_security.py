"""The security review against the real server: keys never leave it (logs, errors, metrics),
WebSocket handshakes from foreign origins are refused, OPS_AUTH=keys closes the operational
routes, the prefix cache is shared across tenants unless `cache_salt` differs, and request
sizes have limits that are 400s naming the field."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from app.origin import origin_allowed
from compat.limits import (
    MAX_IDENTIFIER_LENGTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_SAFETY_IDENTIFIER_LENGTH,
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
)
from tests.conftest import RunningServer, start_server, stop_server
from tests.gateway_helpers import chat_body, completion_body, unique_prompt, wait_until

TIMEOUT = httpx.Timeout(300.0)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KEY_ALICE = "sk-alice-3f9d2c7a51e04b86"  # named: its tenant is "alice"
KEY_BARE = "sk-bare-8e41b0c2d97f5a13"  # bare, second in the list: its tenant is "key-2"
WRONG_KEY = "sk-wrong-5c7e9a1f3b2d4068"
SECRETS = (KEY_ALICE, KEY_BARE, WRONG_KEY)
LISTED_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(
        tmp_path_factory.mktemp("keyed"),
        API_KEYS=f"alice:{KEY_ALICE},{KEY_BARE}",
        LOG_FORMAT="json",
        OPS_AUTH="keys",
        WS_ALLOWED_ORIGINS=LISTED_ORIGIN,
    )
    yield running
    stop_server(running)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ws_url(server: RunningServer) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/ws"


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ------------------------------------------------------------------ keys are never logged


async def test_keys_never_appear_in_logs_or_responses(keyed: RunningServer) -> None:
    bodies: list[str] = []

    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=TIMEOUT) as client:

        async def call(method: str, path: str, status: int, **kwargs: Any) -> httpx.Response:
            response = await client.request(method, path, **kwargs)
            assert response.status_code == status, (path, kwargs, response.text)
            bodies.append(response.text)
            return response

        for key in (KEY_ALICE, KEY_BARE):
            await call("POST", COMPLETIONS, 200, json=completion_body(max_tokens=2),
                       headers=bearer(key))  # fmt: skip
        basic = base64.b64encode(f"alice:{KEY_ALICE}".encode()).decode()
        for header in (
            f"Bearer {WRONG_KEY}",
            KEY_ALICE,  # no scheme
            f"Token {KEY_ALICE}",
            f"Bearer{KEY_ALICE}",  # no space
            f"Basic {basic}",
        ):
            await call("POST", CHAT, 401, json=chat_body(max_tokens=1),
                       headers={"Authorization": header})  # fmt: skip
        # The key in the body: a field we do not know (ignored, and logged by its name alone),
        # the tenant field of a bad request, and a body that is not even JSON.
        await call("POST", CHAT, 200, json=chat_body(api_key=KEY_ALICE, max_tokens=1),
                   headers=bearer(KEY_ALICE))  # fmt: skip
        await call("POST", CHAT, 400, json=chat_body(user=KEY_BARE, temperature="hot"),
                   headers=bearer(KEY_BARE))  # fmt: skip
        await call("POST", COMPLETIONS, 400, content=f'{{"api_key": "{KEY_ALICE}"'.encode(),
                   headers=bearer(KEY_ALICE) | {"content-type": "application/json"})  # fmt: skip
        for path in ("/metrics", "/api/metrics", "/api/loadgen/status", "/v1/models"):
            await call("GET", path, 200, headers=bearer(KEY_BARE))
        snapshot = (await call("GET", "/api/metrics", 200, headers=bearer(KEY_ALICE))).json()

    async with connect(ws_url(keyed), proxy=None) as ws:  # a wrong key in the auth message
        await ws.send(json.dumps({"type": "auth", "api_key": WRONG_KEY}))
        bodies.append(str(await ws.recv()))
    async with connect(ws_url(keyed), proxy=None, additional_headers=bearer(KEY_BARE)) as ws:
        bodies.append(str(await ws.recv()))

    # Tenants are named without their keys: the bare key's tenant is its place in the list.
    assert {"alice", "key-2"} <= set(snapshot["scheduler"]["tenants"])
    log = keyed.log()
    assert '"request refused"' in log and '"tenant": "key-2"' in log  # the JSON log is here
    for secret in SECRETS:
        assert secret not in log, secret
        assert not any(secret in body for body in bodies), secret


# ------------------------------------------------------------------ WebSocket origins


async def _handshake_status(server: RunningServer, **kwargs: Any) -> int:
    """101 when the socket opens, else the HTTP status that refused the handshake."""
    try:
        async with connect(ws_url(server), proxy=None, **kwargs):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def test_foreign_origins_cannot_open_the_websocket(server: RunningServer) -> None:
    """A server without keys: any page could otherwise drive it from the visitor's browser."""
    assert await _handshake_status(server) == 101  # no Origin: not a browser
    assert await _handshake_status(server, origin=server.base_url) == 101  # the dashboard
    assert await _handshake_status(server, origin="http://evil.example") == 403
    # Same host, other port: another site (and another origin) all the same.
    other_port = server.base_url.rsplit(":", 1)[0] + ":1"
    assert await _handshake_status(server, origin=other_port) == 403
    assert await _handshake_status(server, origin=LISTED_ORIGIN) == 403  # not listed here
    async with connect(ws_url(server), proxy=None, origin=server.base_url) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"


async def test_a_listed_origin_opens_the_websocket(keyed: RunningServer) -> None:
    assert await _handshake_status(keyed, origin="http://evil.example") == 403
    async with connect(
        ws_url(keyed), proxy=None, origin=LISTED_ORIGIN, additional_headers=bearer(KEY_ALICE)
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"


@pytest.mark.parametrize(
    ("origin", "host", "allowed", "expected"),
    [
        (None, "127.0.0.1:8000", frozenset(), True),
        ("http://127.0.0.1:8000", "127.0.0.1:8000", frozenset(), True),
        ("HTTP://LOCALHOST:8000/", "localhost:8000", frozenset(), True),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", frozenset(), False),
        ("null", "127.0.0.1:8000", frozenset(), False),
        ("http://evil.example", None, frozenset(), False),
        ("https://App.Example", "127.0.0.1:8000", frozenset({"https://app.example"}), True),
        ("http://app.example", "127.0.0.1:8000", frozenset({"https://app.example"}), False),
        ("http://evil.example", "127.0.0.1:8000", frozenset({"*"}), True),
    ],
)
def test_origin_rules(
    origin: str | None, host: str | None, allowed: frozenset, expected: bool
) -> None:
    assert origin_allowed(origin, host, allowed) is expected


# ------------------------------------------------------------------ OPS_AUTH=keys

OPS_ROUTES = [
    ("GET", "/metrics", None),
    ("GET", "/api/metrics", None),
    ("GET", "/api/loadgen/status", None),
    ("POST", "/api/loadgen/start", {"users": 1, "tenants": 1, "max_tokens": 1, "num_requests": 1}),
    ("POST", "/api/loadgen/stop", {}),
]


@pytest.mark.parametrize(("method", "path", "body"), OPS_ROUTES, ids=[r[1] for r in OPS_ROUTES])
def test_ops_routes_need_the_key(
    keyed: RunningServer, method: str, path: str, body: dict | None
) -> None:
    url = keyed.base_url + path
    assert error_of(httpx.request(method, url, json=body, timeout=TIMEOUT), 401)["code"] == (
        "missing_api_key"
    )
    wrong = httpx.request(method, url, json=body, headers=bearer(WRONG_KEY), timeout=TIMEOUT)
    assert error_of(wrong, 401)["code"] == "invalid_api_key"
    ok = httpx.request(method, url, json=body, headers=bearer(KEY_BARE), timeout=TIMEOUT)
    assert ok.status_code == 200, ok.text
    if path == "/api/loadgen/start":
        stopped = httpx.post(keyed.base_url + "/api/loadgen/stop", json={},
                             headers=bearer(KEY_BARE), timeout=TIMEOUT)  # fmt: skip
        assert stopped.status_code == 200


@pytest.mark.parametrize("path", ["/health", "/live", "/", "/static/app.js"])
def test_health_and_the_page_stay_open(keyed: RunningServer, path: str) -> None:
    """Probes carry no key (/health, /live); the page holds no data and asks for the key."""
    assert httpx.get(keyed.base_url + path, timeout=TIMEOUT).status_code == 200


# ------------------------------------------------------------------ the prefix cache


def _cached_tokens(server: RunningServer, prompt: str, key: str, **fields: str) -> int:
    body = completion_body(prompt, max_tokens=1, temperature=0, **fields)
    response = httpx.post(server.v1 + "/completions", json=body, headers=bearer(key),
                          timeout=TIMEOUT)  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_share_the_prefix_cache_unless_salted(keyed: RunningServer) -> None:
    """As in vLLM: one prefix cache for everyone; a cache_salt per tenant isolates them."""
    shared = unique_prompt(words=48)  # several KV blocks
    assert _cached_tokens(keyed, shared, KEY_ALICE) == 0
    assert _cached_tokens(keyed, shared, KEY_BARE) > 0  # another tenant hits alice's blocks

    salted = unique_prompt(words=48)
    assert _cached_tokens(keyed, salted, KEY_ALICE, cache_salt="alice") == 0
    assert _cached_tokens(keyed, salted, KEY_BARE, cache_salt="key-2") == 0
    assert _cached_tokens(keyed, salted, KEY_BARE) == 0  # unsalted never sees salted blocks
    assert _cached_tokens(keyed, salted, KEY_ALICE, cache_salt="alice") > 0


# ------------------------------------------------------------------ request limits


def _stops(count: int, length: int = 8) -> list[str]:
    """`count` distinct stop strings of `length` characters the model will not produce."""
    return [f"\x01{i:04d}".ljust(length, "\x02") for i in range(count)]


def _bias(entries: int) -> dict[str, float]:
    return {str(token): 0.0 for token in range(entries)}


LIMITS = [
    # (id, path, fields at the limit, fields just past it, param)
    ("n", CHAT, {"n": MAX_N}, {"n": MAX_N + 1}, "n"),
    ("best_of", COMPLETIONS, {"n": MAX_N, "best_of": MAX_N}, {"best_of": MAX_N + 1}, "best_of"),
    ("stop count", CHAT, {"stop": _stops(MAX_STOP_SEQUENCES)},
     {"stop": _stops(MAX_STOP_SEQUENCES + 1)}, "stop"),
    ("stop length", COMPLETIONS, {"stop": _stops(1, MAX_STOP_LENGTH)[0]},
     {"stop": _stops(1, MAX_STOP_LENGTH + 1)[0]}, "stop"),
    ("stop length in a list", COMPLETIONS, {"stop": ["\x03", *_stops(1, MAX_STOP_LENGTH)]},
     {"stop": ["\x03", *_stops(1, MAX_STOP_LENGTH + 1)]}, "stop[1]"),
    ("logit_bias", CHAT, {"logit_bias": _bias(MAX_LOGIT_BIAS_ENTRIES)},
     {"logit_bias": _bias(MAX_LOGIT_BIAS_ENTRIES + 1)}, "logit_bias"),
    # `user` names the tenant: without a bound, unique megabyte names filled /metrics and logs.
    ("user", COMPLETIONS, {"user": "u" * MAX_IDENTIFIER_LENGTH},
     {"user": "u" * (MAX_IDENTIFIER_LENGTH + 1)}, "user"),
    ("user on chat", CHAT, {"user": "\u00e9" * MAX_IDENTIFIER_LENGTH},
     {"user": "\u00e9" * (MAX_IDENTIFIER_LENGTH + 1)}, "user"),
    ("safety_identifier", CHAT, {"safety_identifier": "s" * MAX_SAFETY_IDENTIFIER_LENGTH},
     {"safety_identifier": "s" * (MAX_SAFETY_IDENTIFIER_LENGTH + 1)}, "safety_identifier"),
]  # fmt: skip


def _body(path: str, **fields: Any) -> dict[str, Any]:
    make = chat_body if path == CHAT else completion_body
    return make(max_tokens=1, temperature=0, **fields)


@pytest.mark.parametrize(
    ("path", "at_limit", "past_limit", "param"),
    [case[1:] for case in LIMITS],
    ids=[case[0] for case in LIMITS],
)
def test_limits_are_served_at_the_limit_and_refused_past_it(
    server: RunningServer, path: str, at_limit: dict, past_limit: dict, param: str
) -> None:
    served = httpx.post(server.base_url + path, json=_body(path, **at_limit), timeout=TIMEOUT)
    assert served.status_code == 200, served.text
    refused = httpx.post(server.base_url + path, json=_body(path, **past_limit), timeout=TIMEOUT)
    error = error_of(refused, 400)
    assert (error["param"], error["code"], error["type"]) == (
        param, "invalid_value", "invalid_request_error"
    )  # fmt: skip
    assert error["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_session_header_is_bounded_like_user(server: RunningServer, path: str) -> None:
    def post(session: str) -> httpx.Response:
        return httpx.post(server.base_url + path, json=_body(path), timeout=TIMEOUT,
                          headers={"X-Session-Id": session})  # fmt: skip

    served = post("s" * MAX_IDENTIFIER_LENGTH)
    assert served.status_code == 200, served.text
    assert error_of(post("s" * (MAX_IDENTIFIER_LENGTH + 1)), 400) == {
        "message": "Invalid value for 'X-Session-Id': expected string of length <= 256.",
        "type": "invalid_request_error",
        "param": "X-Session-Id",
        "code": "invalid_value",
    }


MAX_TOKENS_FIELDS = [(COMPLETIONS, "max_tokens"), (CHAT, "max_tokens"),
                     (CHAT, "max_completion_tokens")]  # fmt: skip


@pytest.mark.parametrize(("path", "field"), MAX_TOKENS_FIELDS, ids=lambda v: v)
def test_max_tokens_is_bounded_by_the_context(server: RunningServer, path: str, field: str) -> None:
    """The limit is what the context holds next to the prompt: `max_model_len` - prompt."""
    max_model_len = httpx.get(server.v1 + "/models", timeout=TIMEOUT).json()["data"][0][
        "max_model_len"
    ]
    prompt = unique_prompt()
    make = chat_body if path == CHAT else completion_body
    probe = httpx.post(server.base_url + path, json=make(prompt, max_tokens=1), timeout=TIMEOUT)
    limit = max_model_len - probe.json()["usage"]["prompt_tokens"]

    at_limit = make(prompt, stream=True, **{field: limit})
    with httpx.stream("POST", server.base_url + path, json=at_limit, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        assert next(response.iter_lines()).startswith("data: ")  # then hang up: it is aborted
    past = httpx.post(server.base_url + path, json=make(prompt, **{field: limit + 1}),
                      timeout=TIMEOUT)  # fmt: skip
    error = error_of(past, 400)
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    assert wait_until(
        lambda: (
            httpx.get(server.base_url + "/api/metrics", timeout=30).json()["scheduler"][
                "num_running"
            ]
            == 0
        )
    )


def test_a_huge_logit_bias_is_a_fast_400(server: RunningServer) -> None:
    bias = {str(token): 0 for token in range(100_000)}
    body = json.dumps(chat_body(max_tokens=1, logit_bias=bias), separators=(",", ":")).encode()
    assert len(body) < 1_000_000  # under MAX_BODY_BYTES: the limit, not the body size, refuses
    started = time.perf_counter()
    response = httpx.post(server.v1 + "/chat/completions", content=body, timeout=TIMEOUT,
                          headers={"content-type": "application/json"})  # fmt: skip
    elapsed = time.perf_counter() - started
    assert error_of(response, 400)["param"] == "logit_bias"
    assert elapsed < 3.0, elapsed
