"""Two engine replicas of the embedded model on a real local Ray cluster (deploy/ray_serve.py),
driven through Ray Serve's HTTP proxy: the official `openai` client, session affinity seen in
`cached_tokens`, a WebSocket, each replica's own /metrics, and a replica killed mid-request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from websockets.sync.client import connect

from app.settings import Settings
from evals.clients import http_request, request_body
from evals.scaleout import free_port_run
from tests.conftest import MODEL_ID

pytestmark = pytest.mark.slow

REPLICA_CLASS = "ServeReplica:default:gemma"  # Ray's name for the engine replicas' actor class


@dataclass
class Cluster:
    base_url: str
    ops_urls: list[str]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    from deploy.ray_serve import PROXY_CALLBACK_ENV, ScaleOutArgs, build_app

    port = free_port_run(3)
    settings = Settings(PORT=port, MAX_ACTIVE_KV_TOKENS=8192)
    with pytest.MonkeyPatch.context() as env:
        env.delenv(PROXY_CALLBACK_ENV, raising=False)  # build_app sets it for the proxy
        application = build_app(ScaleOutArgs(replicas=2, num_cpus=1), settings)
        # The dashboard serves Ray's state API, which finds the replicas' processes.
        ray.init(address="local", num_cpus=2, include_dashboard=True, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(application, blocking=False)
            yield Cluster(
                f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + r}" for r in (1, 2)]
            )
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def test_completions_chat_and_streaming_through_the_proxy(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=8, temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content
    chunks = list(
        client.completions.create(
            model=MODEL_ID, prompt="Once upon a time", max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # Errors are the server's own, OpenAI-shaped.
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_session_turns_land_on_one_replica(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You answer questions about travel. " * 4}]
    previous = 0  # the last turn's prompt and reply, in tokens
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: what should I pack?"})
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=8, temperature=0,
            extra_headers={"X-Session-Id": "trip-42"},
        )  # fmt: skip
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        # The whole history (to a 16-token block) was kept on the replica that served it.
        assert cached >= previous - 16, (turn, cached, previous)
        previous = usage.prompt_tokens + usage.completion_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert previous > 64


def test_websocket_through_the_proxy(cluster: Cluster) -> None:
    with connect(cluster.base_url.replace("http", "ws", 1) + "/v1/ws") as ws:
        assert json.loads(ws.recv())["type"] == "ready"
        ws.send(json.dumps({"type": "generate", "id": "g", "model": MODEL_ID, "prompt": "Hi",
                            "max_tokens": 4, "ignore_eos": True}))  # fmt: skip
        events = [json.loads(ws.recv()) for _ in range(5)]
    assert [e["type"] for e in events] == ["delta"] * 4 + ["done"]
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_each_replica_serves_its_own_metrics(cluster: Cluster) -> None:
    for url in cluster.ops_urls:
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        assert "gemma_serve:" in httpx.get(url + "/metrics", timeout=10).text


def _replica_pids() -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", REPLICA_CLASS), ("state", "=", "ALIVE")])
    return sorted(a.pid for a in actors)


def _running(cluster: Cluster) -> list[int]:
    return [
        httpx.get(url + "/api/metrics", timeout=10).json()["scheduler"]["num_running"]
        for url in cluster.ops_urls
    ]


def test_a_killed_replica_fails_only_its_requests(cluster: Cluster) -> None:
    async def requests() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=120) as http:
            # Distinct prompts: no prefix to share, so load spreads them; streamed or not.
            bodies = [
                request_body("completions", list(range(1000 + 100 * i, 1032 + 100 * i)), 96)
                for i in range(6)
            ]
            tasks = [
                asyncio.create_task(http_request(http, "completions", body, stream=i % 3 > 0))
                for i, body in enumerate(bodies)
            ]
            deadline = time.monotonic() + 60
            while sum(await asyncio.to_thread(_running, cluster)) < 6:
                assert time.monotonic() < deadline, "the streams never all ran"
                await asyncio.sleep(0.1)
            os.kill(_replica_pids()[0], signal.SIGKILL)
            return sorted(o.kind for o in await asyncio.gather(*tasks))

    pids = _replica_pids()
    assert len(pids) == 2
    # Six requests spread three and three. The three on the killed replica end with an OpenAI
    # error: a stream with an error event (then [DONE]), never cut off; a plain request with
    # an OpenAI-shaped 500. The other three finish.
    assert asyncio.run(requests()) == ["completed"] * 3 + ["server_error"] * 3
    # New requests go to the survivor...
    for _ in range(3):
        reply = httpx.post(
            cluster.base_url + "/v1/completions",
            json={"model": MODEL_ID, "prompt": "After the crash", "max_tokens": 2},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    # ...and Ray Serve starts a replacement.
    deadline = time.monotonic() + 120
    while len(_replica_pids()) < 2 or _replica_pids() == pids:
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(1)
