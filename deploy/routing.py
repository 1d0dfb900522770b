"""Which replica serves a request, chosen to keep each replica's KV cache warm (no Ray here).

Policy, in order:
1. A request with a session (`X-Session-Id`, else the OpenAI `user` field; a WebSocket's
   handshake header) goes to the replica that served that session last, or, for a session not
   seen yet (or whose replica is gone), to the one a rendezvous hash of the session picks among
   the live replicas. Its history, pinned or cached there, is then prefilled only once.
2. Otherwise the replica that holds the longest prefix of the prompt: the router remembers,
   for each chain hash of a prompt's fixed-size chunks, which replicas were sent a prompt with
   that prefix (bounded, least recently used dropped). A replica that is `imbalance` queued
   requests behind the least loaded one is passed over: one shared system prompt must not pull
   every request onto one replica.
3. Otherwise the least loaded replica.
Every rank is followed by the other replicas, so that a full replica (Ray Serve's
`max_ongoing_requests`) sends the request on rather than making it wait.

The keys come from the request's body, which Ray Serve's HTTP proxy has not read yet when it
routes: deploy/proxy.py's middleware, installed in the proxy, reads the body of a generation
request first and stores its `route_keys` in the ASGI scope under ROUTE_SCOPE_KEY, where the
router (deploy/ray_serve.py) finds them.

Fairness is not the router's job: tenants are not pinned to replicas (a single tenant, or the
keyless `default` one, could then never use more than one replica, and pinning would override
the session and prefix choices above). Each replica runs VTC over its own queue with counters
shared across replicas (deploy/fairness.py).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

ROUTE_SCOPE_KEY = "gemma_serve.route"
CHUNK_CHARS = 128  # about two 16-token KV blocks of English text
MAX_CHUNKS = 1024  # prefixes past 128 KB of text route as their first 128 KB


@dataclass(frozen=True)
class RouteKeys:
    """What routing looks at: the session, and the chain hashes of the prompt's chunks."""

    session: str | None = None
    prefix: tuple[str, ...] = ()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def chunk_hashes(text: str, salt: str = "", chunk_chars: int = CHUNK_CHARS) -> tuple[str, ...]:
    """One hash per whole `chunk_chars`-character chunk of `text` (a partial last chunk has
    none, as a partial KV block is never cached), each over the previous hash and its chunk:
    equal i-th hashes mean equal first i+1 chunks. The salt (`cache_salt`) seeds the chain:
    prompts with different salts share no cache, so they match no prefix either."""
    digest = _digest(salt.encode())
    hashes = []
    end = min(len(text), chunk_chars * MAX_CHUNKS)
    for start in range(0, end - chunk_chars + 1, chunk_chars):
        digest = _digest(digest + text[start : start + chunk_chars].encode())
        hashes.append(digest.hex())
    return tuple(hashes)


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    # Separators no chat text holds, so that [user: "ab"] and [user: "a", user: "b"] differ.
    return f"{message.get('role', '')}\x1f{content if isinstance(content, str) else ''}\x1e"


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text whose prefixes routing compares: a chat's messages in order, or a completion's
    prompt (the first of a batch; token ids as comma-separated numbers). A chat's next turn
    resends the history with the reply and a new message appended, so its text extends the
    last turn's."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return ",".join(str(token) for token in prompt)
    return ""


def route_keys(session_header: str | None, body: bytes | None) -> RouteKeys:
    """The keys of a request: its `X-Session-Id`, and when `body` is a generation request's
    JSON, its `user` field (the session without the header) and its prompt's chunk hashes."""
    parsed: Any = None
    if body:
        try:
            parsed = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            parsed = None  # the replica answers the 400; routing needs no keys for that
    if not isinstance(parsed, dict):
        return RouteKeys(session_header or None)
    user = parsed.get("user")
    salt = parsed.get("cache_salt")
    return RouteKeys(
        session_header or (user if isinstance(user, str) and user else None),
        chunk_hashes(prompt_text(parsed), salt if isinstance(salt, str) else ""),
    )


class LruMap(OrderedDict):
    """An OrderedDict that drops its least recently set key past `capacity`."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: str, value: Any) -> tuple[str, Any] | None:
        """Set `key`; returns the (key, value) dropped to make room, if any."""
        self[key] = value
        self.move_to_end(key)
        return self.popitem(last=False) if len(self) > self.capacity else None


class PrefixTable:
    """chain hash -> the replicas that were sent a prompt with that prefix; at most `capacity`
    hashes, the least recently recorded dropped first."""

    def __init__(self, capacity: int = 65536) -> None:
        self._holders = LruMap(capacity)

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, hashes: Iterable[str], replica: str) -> None:
        for h in hashes:
            holders = self._holders.get(h, set())
            holders.add(replica)
            self._holders.put(h, holders)

    def longest(self, hashes: Iterable[str], live: Iterable[str]) -> tuple[int, list[str]]:
        """(chunks matched, live replicas holding them) for the longest recorded prefix."""
        alive = set(live)
        depth, best = 0, []
        for i, h in enumerate(hashes):
            holders = sorted(self._holders.get(h, set()) & alive)
            if not holders:
                break
            depth, best = i + 1, holders
        return depth, best


def rendezvous(session: str, replicas: Iterable[str]) -> str:
    """The replica a session hashes to (highest random weight): stable while that replica
    lives, and losing a replica moves only the sessions that hashed to it."""
    return max(replicas, key=lambda r: _digest(f"{session}\x00{r}".encode()))


class AffinityPolicy:
    """The choice of replica (module docstring), as ranks of replica ids, best first.

    A replica's load is the larger of the requests this policy aimed at it that have not
    completed (`aim` when choosing, `done` on completion: exact at once, even within a burst)
    and the queue it last reported (which also counts other routers' requests, but lags)."""

    def __init__(
        self, imbalance: float = 8, max_sessions: int = 65536, max_prefixes: int = 65536,
        max_requests: int = 65536,
    ) -> None:  # fmt: skip
        self.imbalance = imbalance
        self.sessions = LruMap(max_sessions)  # session -> the replica that served it last
        self.prefixes = PrefixTable(max_prefixes)
        self.inflight: Counter[str] = Counter()
        self._aimed = LruMap(max_requests)  # request id -> the replica counted in `inflight`

    def rank(self, keys: RouteKeys, reported: Mapping[str, float]) -> list[list[str]]:
        """`reported` maps each live replica to the queued work it last reported."""
        if not reported:
            return []
        load = {r: max(self.inflight[r], queued) for r, queued in reported.items()}
        by_load = sorted(load, key=lambda r: (load[r], r))
        if keys.session is not None:
            home = self.sessions.get(keys.session)
            first = home if home in load else rendezvous(keys.session, by_load)
        else:
            depth, holders = self.prefixes.longest(keys.prefix, by_load)
            first = by_load[0]
            if depth:
                warm = min(holders, key=lambda r: (load[r], r))
                if load[warm] - load[first] <= self.imbalance:
                    first = warm
        rest = [r for r in by_load if r != first]
        return [[first], rest] if rest else [[first]]

    def record(self, keys: RouteKeys, replica: str) -> None:
        """The request went to `replica`: its session and prefix are there now."""
        if keys.session is not None:
            self.sessions.put(keys.session, replica)
        self.prefixes.record(keys.prefix, replica)

    def aim(self, request: str, replica: str) -> None:
        """Count `request` in flight at `replica`, instead of where it was aimed before."""
        self.done(request)
        dropped = self._aimed.put(request, replica)
        self.inflight[replica] += 1
        if dropped is not None:  # never completed (cancelled while routing): uncount it
            self.inflight[dropped[1]] -= 1

    def done(self, request: str) -> None:
        replica = self._aimed.pop(request, None)
        if replica is not None:
            self.inflight[replica] -= 1
