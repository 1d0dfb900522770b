"""The built-in load generator: closed-loop users that call this server's own HTTP API.

Each of N users sends one streaming request, reads it to the end, then sends the next (a
closed loop), so the offered load follows what the server can serve. Users are spread over K
tenants (by API key when auth is on, else by the OpenAI `user` field), which is what the fair
scheduler sees. Requests go over loopback through the whole stack, exactly like a client's.
Stopping cancels the in-flight requests; closing their connections aborts them server-side.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Annotated, Literal

import httpx
import msgspec
from msgspec import Meta

from compat.errors import ApiError, from_decode_error
from engine.metrics import percentile

# Common English words: prompts are random sequences of these, so their token counts are
# close to their word counts.
WORDS = [
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
    "child", "eye", "woman", "place", "work", "week", "case", "point", "government", "company",
    "number", "group", "problem", "fact", "be", "have", "do", "say", "get", "make", "go", "know",
    "take", "see", "come", "think", "look", "want", "give", "use", "find", "tell", "ask", "seem",
    "feel", "try", "leave", "call", "good", "new", "first", "last", "long", "great", "little",
    "own", "other", "old", "right", "big", "high", "different", "small", "large", "next", "early",
    "young", "important", "few", "public", "bad", "same", "able", "river", "mountain", "city",
    "garden", "window", "table", "letter", "story", "music", "water", "light", "stone", "forest",
    "ocean", "bridge", "road", "market", "school", "village", "winter", "summer", "morning",
    "evening", "cloud", "rain", "wind", "fire", "bread", "apple", "horse", "bird", "tree",
    "flower", "paper", "book", "question", "answer", "idea", "reason", "friend", "family",
    "history", "science", "language", "picture", "journey", "kitchen", "doctor", "teacher",
    "engine", "machine", "signal", "memory", "dream", "voice", "silence", "color", "north",
    "south", "east", "west", "quickly", "slowly", "quietly", "always", "never", "often",
    "together", "alone", "again",
]  # fmt: skip

MAX_LATENCY_SAMPLES = 2000  # client-side latency samples kept for percentiles
_RETRY_CAP_S = 2.0  # longest pause after a 429, whatever Retry-After says
_PAUSE_AFTER_FAILURE_S = 0.1  # keeps a user that always fails from spinning


class LoadConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One load-generation run, as POSTed to /api/loadgen/start."""

    users: Annotated[int, Meta(ge=1, le=256)] = 4
    tenants: Annotated[int, Meta(ge=1, le=64)] = 2
    prompt_words: Annotated[int, Meta(ge=1, le=8192)] = 32
    max_tokens: Annotated[int, Meta(ge=1, le=8192)] = 32
    # Stop after this many seconds or requests, whichever comes first (at least one is needed).
    duration_s: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    num_requests: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    # Sent as the system message (chat) or prompt prefix (completions) of every request, so
    # the prefix cache can share its KV blocks across users and tenants.
    system_prompt: Annotated[str, Meta(max_length=200_000)] = ""
    api: Literal["chat", "completions"] = "chat"
    temperature: Annotated[float, Meta(ge=0, le=2)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0


def decode_load_config(body: bytes) -> LoadConfig:
    """Parse and check a start request's JSON body; raises ApiError 400 naming the field."""
    try:
        config = msgspec.json.decode(body or b"{}", type=LoadConfig)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from exc
    if config.duration_s is None and config.num_requests is None:
        raise ApiError(
            "Set 'duration_s' or 'num_requests' so the run ends.",
            param="duration_s",
            code="missing_required_parameter",
        )
    if config.tenants > config.users:
        raise ApiError(
            f"'tenants' ({config.tenants}) must not exceed 'users' ({config.users}): "
            "every tenant needs at least one user.",
            param="tenants",
            code="invalid_value",
        )
    return config


@dataclass(frozen=True)
class ClientIdentity:
    """How one simulated user presents itself to the server."""

    tenant: str
    api_key: str | None  # set when the server requires keys: the key names the tenant
    session_id: str

    def headers(self) -> dict[str, str]:
        headers = {"X-Session-Id": self.session_id}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    @property
    def user_field(self) -> str | None:
        """The OpenAI `user` field: names the tenant only when no key does."""
        return None if self.api_key is not None else self.tenant


def plan_clients(
    num_users: int, num_tenants: int, api_keys: dict[str, str]
) -> list[ClientIdentity]:
    """User u belongs to tenant u mod K. Without auth, tenant i is "loadgen-i"; with auth
    (`api_keys`: key -> tenant), tenant i is the i-th configured tenant, wrapping around when
    fewer tenants are configured than asked for."""
    if api_keys:
        key_by_tenant: dict[str, str] = {}
        for api_key, tenant in api_keys.items():
            key_by_tenant.setdefault(tenant, api_key)  # a tenant's first key
        tenants = list(key_by_tenant.items())
    clients = []
    for user in range(num_users):
        index = user % num_tenants
        key: str | None = None
        if api_keys:
            tenant, key = tenants[index % len(tenants)]
        else:
            tenant = f"loadgen-{index}"
        clients.append(ClientIdentity(tenant, key, session_id=f"loadgen-user-{user}"))
    return clients


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def request_body(
    config: LoadConfig, model: str, client: ClientIdentity, prompt: str, seed: int
) -> tuple[str, dict]:
    """The API path and JSON body of one streaming request."""
    body: dict = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if client.user_field is not None:
        body["user"] = client.user_field
    if config.api == "chat":
        messages = [{"role": "user", "content": prompt}]
        if config.system_prompt:
            messages.insert(0, {"role": "system", "content": config.system_prompt})
        return "/v1/chat/completions", body | {"messages": messages}
    prefix = config.system_prompt + "\n\n" if config.system_prompt else ""
    return "/v1/completions", body | {"prompt": prefix + prompt}


class ServerUnreachable(RuntimeError):
    """The server refused the connection: it is shutting down, so the run ends."""


@dataclass
class TenantTally:
    completed: int = 0
    failed: int = 0
    output_tokens: int = 0


@dataclass
class RunState:
    config: LoadConfig
    base_url: str
    tenants: list[str]
    started_at: float = field(default_factory=time.time)
    started_monotonic: float = field(default_factory=time.monotonic)
    ended_monotonic: float | None = None
    state: Literal["running", "finished", "stopped", "failed"] = "running"
    sent: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    output_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    per_tenant: dict[str, TenantTally] = field(default_factory=dict)
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES))
    e2e_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES))

    @property
    def elapsed_s(self) -> float:
        end = self.ended_monotonic if self.ended_monotonic is not None else time.monotonic()
        return end - self.started_monotonic

    def claim(self, deadline: float | None) -> bool:
        """Take the next request slot, if the run has one left."""
        if self.config.num_requests is not None and self.sent >= self.config.num_requests:
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        self.sent += 1
        return True

    def record_failure(self, tenant: str, kind: str, message: str) -> None:
        self.failed += 1
        self.per_tenant[tenant].failed += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.last_error = message


def latency_summary(samples: deque[float] | list[float]) -> dict[str, float]:
    values = sorted(samples)
    return {
        "count": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


@dataclass
class _Outcome:
    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    error_kind: str = ""
    error: str = ""
    retry_after_s: float = 0.0


class LoadGenerator:
    """Runs at most one load-generation run at a time inside the server's event loop."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._run: RunState | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(
        self, config: LoadConfig, base_url: str, model: str, api_keys: dict[str, str]
    ) -> None:
        """Begin a run calling the API at `base_url`; the caller checks `running` first."""
        if self.running:
            raise RuntimeError("a load-generation run is already in progress")
        clients = plan_clients(config.users, config.tenants, api_keys)
        tenants = list(dict.fromkeys(c.tenant for c in clients))
        run = RunState(config, base_url.rstrip("/"), tenants)
        run.per_tenant = {name: TenantTally() for name in tenants}
        self._run = run
        self._task = asyncio.create_task(self._drive(run, model, clients), name="loadgen")

    async def stop(self) -> None:
        """Cancel the run and its in-flight requests; returns once they are gone."""
        if self._task is None or self._task.done():
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._run is not None and self._run.state == "running":  # cancelled before it began
            self._run.state = "stopped"

    def status(self) -> dict:
        run = self._run
        if run is None:
            return {"state": "idle", "config": None}
        elapsed = max(run.elapsed_s, 1e-9)
        finished = run.completed + run.failed + run.cancelled
        return {
            "state": run.state,
            "config": msgspec.to_builtins(run.config),
            "base_url": run.base_url,
            "tenants": run.tenants,
            "started_at": run.started_at,
            "elapsed_s": run.elapsed_s,
            "sent": run.sent,
            "completed": run.completed,
            "failed": run.failed,
            "cancelled": run.cancelled,
            "in_flight": run.sent - finished,
            "output_tokens": run.output_tokens,
            "requests_per_s": run.completed / elapsed,
            "output_tokens_per_s": run.output_tokens / elapsed,
            "latency": {"ttft_s": latency_summary(run.ttft_s), "e2e_s": latency_summary(run.e2e_s)},
            "per_tenant": {name: asdict(tally) for name, tally in run.per_tenant.items()},
            "errors": dict(run.errors),
            "last_error": run.last_error,
        }

    # ------------------------------------------------------------------ the run

    async def _drive(self, run: RunState, model: str, clients: list[ClientIdentity]) -> None:
        limits = httpx.Limits(
            max_connections=len(clients) + 2, max_keepalive_connections=len(clients)
        )
        timeout = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=None)
        deadline = run.started_monotonic + run.config.duration_s if run.config.duration_s else None
        async with httpx.AsyncClient(base_url=run.base_url, limits=limits, timeout=timeout) as http:
            users = [
                asyncio.create_task(self._user(http, run, model, client, index, deadline))
                for index, client in enumerate(clients)
            ]
            try:
                done, _ = await asyncio.wait(users, return_when=asyncio.FIRST_EXCEPTION)
                failures = [t.exception() for t in done if t.exception() is not None]
                if failures:
                    run.state = "failed"
                    run.last_error = str(failures[0])
                else:
                    run.state = "finished"
            except asyncio.CancelledError:
                run.state = "stopped"
                raise
            finally:
                for task in users:
                    task.cancel()
                await asyncio.gather(*users, return_exceptions=True)
                run.ended_monotonic = time.monotonic()

    async def _user(
        self, http: httpx.AsyncClient, run: RunState, model: str, client: ClientIdentity,
        index: int, deadline: float | None,
    ) -> None:  # fmt: skip
        rng = random.Random(run.config.seed * 1_000_003 + index)
        while run.claim(deadline):
            prompt = make_prompt(rng, run.config.prompt_words)
            path, body = request_body(run.config, model, client, prompt, rng.randrange(2**31))
            started = time.monotonic()
            try:
                outcome = await self._send(http, path, body, client.headers(), started)
            except asyncio.CancelledError:
                run.cancelled += 1
                raise
            except httpx.ConnectError as exc:
                run.record_failure(client.tenant, "connect", f"cannot reach the server: {exc}")
                raise ServerUnreachable(f"cannot reach {run.base_url}: {exc}") from exc
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                kind, message = type(exc).__name__, str(exc) or repr(exc)
                outcome = _Outcome(False, error_kind=kind, error=message)
            if outcome.ok:
                run.completed += 1
                run.output_tokens += outcome.output_tokens
                tally = run.per_tenant[client.tenant]
                tally.completed += 1
                tally.output_tokens += outcome.output_tokens
                if outcome.ttft_s is not None:
                    run.ttft_s.append(outcome.ttft_s)
                run.e2e_s.append(time.monotonic() - started)
            else:
                run.record_failure(client.tenant, outcome.error_kind, outcome.error)
                await asyncio.sleep(max(outcome.retry_after_s, _PAUSE_AFTER_FAILURE_S))

    @staticmethod
    async def _send(
        http: httpx.AsyncClient, path: str, body: dict, headers: dict[str, str], started: float
    ) -> _Outcome:
        """One streaming request, read to its end."""
        async with http.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return _Outcome(
                    False,
                    error_kind=str(response.status_code),
                    error=_error_message(response),
                    retry_after_s=_retry_after_s(response),
                )
            ttft = None
            content_chunks = 0
            usage_tokens = None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    tokens = usage_tokens if usage_tokens is not None else content_chunks
                    return _Outcome(True, output_tokens=tokens, ttft_s=ttft)
                chunk = msgspec.json.decode(data)
                if "error" in chunk:
                    return _Outcome(False, error_kind="stream", error=str(chunk["error"]))
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text:
                        content_chunks += 1
                        if ttft is None:
                            ttft = time.monotonic() - started
            return _Outcome(False, error_kind="truncated", error="the stream ended before [DONE]")


def _retry_after_s(response: httpx.Response) -> float:
    """The pause a 429 asks for (seconds form only), capped so a run stays responsive."""
    try:
        return min(float(response.headers.get("retry-after", 0)), _RETRY_CAP_S)
    except ValueError:
        return 0.0


def _error_message(response: httpx.Response) -> str:
    try:
        return f"{response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}: {response.text[:200]}"
