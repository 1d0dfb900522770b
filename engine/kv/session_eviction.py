"""Per-session KV eviction applied to a sequence's block tables: h2o's attention scores and
the policy's victims dropped once a sequence holds more than its KV budget
(engine.kv.eviction has the policies themselves)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

from engine.kv.block_tables import BlockTables, SeqBlocks
from engine.kv.eviction import EVICTION_POLICIES, EvictionPolicy, make_policy
from engine.request import Sequence


class _ToList(Protocol):
    """A 1-D tensor or array (engine.kv does not import torch)."""

    def tolist(self) -> list: ...


@dataclass(frozen=True)
class KeyMass:
    """The attention mass one sequence's keys received in a step, for h2o's scores: mass[i]
    went to the primary group's key in slot key_slots[i] (lists or 1-D tensors)."""

    key_slots: SequenceOf[int] | _ToList
    mass: SequenceOf[float] | _ToList


def evicts(seq: Sequence) -> bool:
    """Whether seq runs under an eviction policy with a KV budget."""
    return seq.eviction_policy != "none" and seq.max_kv_tokens is not None


class SessionEviction:
    """Applies each sequence's eviction policy to its tables (`tables`; budgets and scores
    count blocks of the `primary` group)."""

    def __init__(
        self, tables: BlockTables, primary: str, sink_tokens: int, h2o_recent_fraction: float
    ) -> None:
        self.tables = tables
        self.primary = primary
        self.block_size = tables.block_size
        self.policies: dict[str, EvictionPolicy] = {
            name: make_policy(name, self.block_size, sink_tokens, h2o_recent_fraction)
            for name in EVICTION_POLICIES
        }
        self.num_evicted_blocks = 0

    @staticmethod
    def wants_attention(seq: Sequence) -> bool:
        """Whether the runner should report attention mass for seq (h2o eviction)."""
        return seq.eviction_policy == "h2o" and seq.max_kv_tokens is not None

    def record(self, state: SeqBlocks, keyed: KeyMass) -> None:
        """Add the mass each key received in one step to its logical block's h2o score."""
        mass, key_slots = keyed.mass, keyed.key_slots
        masses = mass.tolist() if hasattr(mass, "tolist") else list(mass)
        slots = key_slots.tolist() if hasattr(key_slots, "tolist") else list(key_slots)
        if len(masses) != len(slots):
            raise ValueError(f"{len(masses)} attention masses for {len(slots)} key slots")
        table = state.tables[self.primary]
        logical = {b.block_id: index for index, b in enumerate(table) if b is not None}
        for value, slot in zip(masses, slots, strict=True):
            index = logical.get(slot // self.block_size)
            if index is not None:
                state.scores[index] = state.scores.get(index, 0.0) + value

    def evict(self, seq: Sequence, state: SeqBlocks) -> None:
        """Apply seq's eviction policy when it holds more than its KV budget.

        Block-granular: the budget is max_kv_tokens // block_size blocks of the primary
        group (at least the policy's minimum); a dropped logical block is released in every
        group, disappears from the layout, and its h2o score is forgotten.
        """
        if not evicts(seq):
            return
        assert seq.max_kv_tokens is not None
        policy = self.policies.get(seq.eviction_policy)
        if policy is None:
            raise ValueError(
                f"unknown eviction policy {seq.eviction_policy!r}; "
                f"expected one of {EVICTION_POLICIES}"
            )
        budget = max(seq.max_kv_tokens // self.block_size, policy.min_blocks)
        held = [i for i, block in enumerate(state.tables[self.primary]) if block is not None]
        if len(held) <= budget:
            return
        victims = policy.select_victims(held, budget, state.scores)
        for index in sorted(victims, reverse=True):
            self.tables.drop(state, index)
            state.scores.pop(index, None)
            self.num_evicted_blocks += 1
        if victims:
            lowest = min(victims)
            if state.first_evicted is None or lowest < state.first_evicted:
                state.first_evicted = lowest
