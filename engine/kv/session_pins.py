"""Session pins: the KV blocks a conversation keeps between its turns.

A finished turn of a session holds one reference on each block it pins, so other traffic cannot
reclaim them and the next turn, whose prompt extends this one, prefills only its new tokens. A
session's new pin replaces its old one. Pins yield whenever memory is needed: the least recently
used pin goes first (release_oldest), a tenant's pins beyond its quota are released oldest
first, and idle pins are released by release_idle(). A released pin's blocks stay in the prefix
cache, reclaimable: nothing is lost, at worst recomputed.

A pin may also carry what the KV manager kept of an evicted turn (`kept`, opaque here): the
blocks are then that turn's whole block state, which the session's next turn may take over
(take_kept).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.kv.block_pool import Block, BlockPool, PagePool

Kept = TypeVar("Kept")


@dataclass
class Pin(Generic[Kept]):
    """A session's pinned blocks (one reference each) and when its last turn ended."""

    tenant: str
    blocks: list[Block]
    last_used: float
    kept: Kept | None = None


class SessionPins(Generic[Kept]):
    """Every session's pin, least recently used first, over the manager's block pools.

    quota_blocks: the most primary-group blocks one tenant's pins may hold; None: no quota.
    """

    def __init__(
        self, pools: Mapping[str, BlockPool], primary: str, quota_blocks: int | None
    ) -> None:
        self._pools = pools
        self._primary = primary
        self.quota_blocks = quota_blocks
        self._pins: OrderedDict[tuple[str, str], Pin[Kept]] = OrderedDict()
        self.num_released = 0  # by pressure, quota or idleness (not by unpin())

    def __len__(self) -> int:
        return len(self._pins)

    def stats(self) -> dict[str, int]:
        return {
            "pinned_sessions": len(self._pins),
            "pinned_blocks": self.pinned_blocks(),
            "released_pins": self.num_released,
            "kept_sessions": self.num_kept,
        }

    def all_pins(self) -> list[Pin[Kept]]:
        """Every pin, least recently used first."""
        return list(self._pins.values())

    @property
    def num_kept(self) -> int:
        """Pins that carry an evicted turn's kept state."""
        return sum(pin.kept is not None for pin in self._pins.values())

    def pin(
        self, tenant: str, session: str, blocks: list[Block], now: float, kept: Kept | None
    ) -> None:
        """Pin `blocks` for the session, replacing its old pin; then release the tenant's
        oldest pins while it is over its quota. A pin larger than the whole quota is not made
        (the old one still goes)."""
        key = (tenant, session)
        old = self._pins.pop(key, None)
        if self.quota_blocks is not None and self._primary_count(blocks) > self.quota_blocks:
            blocks = []
        for block in blocks:
            self._pools[block.group].incref(block)
        if old is not None:
            self.drop(old)  # after the new references: blocks in both stay held
        if not blocks:
            return
        self._pins[key] = Pin(tenant, blocks, now, kept)
        if self.quota_blocks is None:
            return
        for other in [k for k, pin in self._pins.items() if pin.tenant == tenant]:
            if self.pinned_blocks(tenant) <= self.quota_blocks:
                break
            self.drop(self._pins.pop(other))  # this tenant's oldest first
            self.num_released += 1

    def take_kept(self, tenant: str, session: str) -> Pin[Kept] | None:
        """Remove and return the session's pin if it carries a kept state, its references
        passing to the caller (who adopts them, or hands the pin to drop())."""
        key = (tenant, session)
        pin = self._pins.get(key)
        if pin is None or pin.kept is None:
            return None
        del self._pins[key]
        return pin

    def unpin(self, tenant: str, session: str) -> bool:
        """Release a session's pin (its conversation ended); False if it had none."""
        pin = self._pins.pop((tenant, session), None)
        if pin is None:
            return False
        self.drop(pin)
        return True

    def release_oldest(self) -> bool:
        """Release the least recently used pin to make room; False if there is none."""
        if not self._pins:
            return False
        _, pin = self._pins.popitem(last=False)
        self.drop(pin)
        self.num_released += 1
        return True

    def release_idle(self, before: float) -> int:
        """Release the pins whose last turn ended before `before`; how many."""
        released = 0
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if pin.last_used >= before:
                break
            del self._pins[key]
            self.drop(pin)
            released += 1
        self.num_released += released
        return released

    def pinned_blocks(self, tenant: str | None = None) -> int:
        """Primary-group blocks held by pins (of one tenant, or of everyone)."""
        return sum(
            self._primary_count(pin.blocks)
            for pin in self._pins.values()
            if tenant is None or pin.tenant == tenant
        )

    def pages_only_pinned(self, page_pool: PagePool) -> int:
        """Pages of `page_pool` whose blocks nobody but pins holds: free on demand."""
        pin_refs: Counter[Block] = Counter(
            block
            for pin in self._pins.values()
            for block in pin.blocks
            if self._pools[block.group].page_pool is page_pool
        )
        return sum(len(b.pages) for b, refs in pin_refs.items() if b.ref_count == refs)

    def drop(self, pin: Pin[Kept]) -> None:
        """Release a pin's references (one no longer in the table, e.g. from take_kept())."""
        for block in reversed(pin.blocks):  # deepest first, as sequences release
            self._pools[block.group].decref(block)

    def _primary_count(self, blocks: list[Block]) -> int:
        return sum(block.group == self._primary for block in blocks)
