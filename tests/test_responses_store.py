"""The stored responses' bounds: per-tenant and total quotas (least recently used first), idle
expiry, tenant isolation, and a chain's KV pin released with its latest response."""

from __future__ import annotations

from app.response_store import ResponseStore, StoredResponse
from compat.responses_types import Response, TextConfig, TextFormatText


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(response_id: str, tenant: str = "t", chain: str = "c") -> StoredResponse:
    response = Response(
        id=response_id, created_at=0, status="completed", model="m", output=[],
        instructions=None, tools=[], tool_choice="auto", parallel_tool_calls=True,
        temperature=1.0, top_p=1.0, metadata={}, text=TextConfig(format=TextFormatText()),
        store=True,
    )  # fmt: skip
    return StoredResponse(response, tenant, chain, [], [1, 2, 3], "")


def _store(
    per_tenant: int = 10, total: int = 100, idle_s: float = 60.0
) -> tuple[ResponseStore, Clock, list[tuple[str, str]]]:
    released: list[tuple[str, str]] = []
    clock = Clock()
    store = ResponseStore(
        per_tenant, total, idle_s, lambda t, c: released.append((t, c)), clock=clock
    )
    return store, clock, released


def test_tenant_sees_only_its_own() -> None:
    store, _, _ = _store()
    store.put(_record("a", tenant="alice"))
    assert store.get("bob", "a") is None
    assert not store.delete("bob", "a")
    assert store.get("alice", "a") is not None


def test_per_tenant_quota_drops_least_recently_used() -> None:
    store, clock, _ = _store(per_tenant=2)
    for name in ("a", "b"):
        store.put(_record(name, chain=name))
        clock.now += 1
    store.get("t", "a")  # now b is the least recently used
    store.put(_record("c", chain="c"))
    assert store.get("t", "b") is None
    assert store.get("t", "a") is not None and store.get("t", "c") is not None
    store.put(_record("d", tenant="other"))  # another tenant's quota is its own
    assert len(store) == 3


def test_total_quota() -> None:
    store, _, _ = _store(total=2)
    for i, tenant in enumerate(("x", "y", "z")):
        store.put(_record(str(i), tenant=tenant))
    assert len(store) == 2 and store.get("x", "0") is None


def test_idle_records_expire() -> None:
    store, clock, released = _store(idle_s=10)
    store.put(_record("a"))
    clock.now = 9
    assert store.get("t", "a") is not None  # used: idle again from now
    clock.now = 20
    assert store.get("t", "a") is None
    assert released == [("t", "c")]


def test_pin_goes_with_the_chains_latest_only() -> None:
    store, _, released = _store()
    store.put(_record("first"))
    store.put(_record("second"))  # the same chain, now its latest
    assert store.delete("t", "first")
    assert released == []
    assert store.delete("t", "second")
    assert released == [("t", "c")]
