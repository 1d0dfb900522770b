"""Per-session KV eviction policies for a sequence whose context outgrows its KV budget.

All policies are block-granular: a whole block (block_size consecutive positions) is the
unit that is kept or dropped, and the budget is a number of blocks. A policy only picks
which logical blocks to drop; the manager releases them. Kept keys keep their original
positions (RoPE is already applied), so generation continues past the budget with bounded
memory. Every policy keeps the most recent block, the one being written.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import ceil

EVICTION_POLICIES = ("none", "lru", "sink", "h2o")


class EvictionPolicy:
    """Chooses the blocks to drop so that at most `budget` blocks remain."""

    name = "none"
    min_blocks = 1  # smallest budget the policy can honour; smaller budgets are raised to it

    def select_victims(
        self, held: list[int], budget: int, scores: Mapping[int, float]
    ) -> list[int]:
        """Logical indices to drop, ascending.

        held: logical indices of the blocks the sequence holds, ascending (the last one is
        being written). budget: blocks to keep (>= min_blocks). scores: accumulated
        attention mass per logical block (only h2o reads it).
        """
        return []


class NoEviction(EvictionPolicy):
    """`none`: never drop anything; the scheduler caps the context instead."""


class LRUEviction(EvictionPolicy):
    """`lru`: the oldest context goes first; keep the `budget` most recent blocks."""

    name = "lru"

    def select_victims(
        self, held: list[int], budget: int, scores: Mapping[int, float]
    ) -> list[int]:
        return held[: max(0, len(held) - budget)]


class SinkEviction(EvictionPolicy):
    """`sink`: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with
    Attention Sinks"): keep the block(s) holding the first `sink_tokens` tokens, where
    attention concentrates regardless of content, plus the most recent blocks."""

    name = "sink"

    def __init__(self, sink_tokens: int, block_size: int) -> None:
        self.sink_blocks = max(1, ceil(sink_tokens / block_size))
        self.min_blocks = self.sink_blocks + 1

    def select_victims(
        self, held: list[int], budget: int, scores: Mapping[int, float]
    ) -> list[int]:
        if len(held) <= budget:
            return []
        sinks = [i for i in held if i < self.sink_blocks]
        recent = held[len(held) - (budget - len(sinks)) :]
        keep = set(sinks) | set(recent)
        return [i for i in held if i not in keep]


class H2OEviction(EvictionPolicy):
    """`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient
    Generative Inference of Large Language Models"): keep a recent window of
    ceil(budget * recent_fraction) blocks plus, among the older blocks, those with the most
    accumulated attention mass (ties keep the earlier block)."""

    name = "h2o"
    min_blocks = 2

    def __init__(self, recent_fraction: float) -> None:
        if not 0.0 < recent_fraction <= 1.0:
            raise ValueError(f"h2o recent_fraction must be in (0, 1], got {recent_fraction}")
        self.recent_fraction = recent_fraction

    def select_victims(
        self, held: list[int], budget: int, scores: Mapping[int, float]
    ) -> list[int]:
        if len(held) <= budget:
            return []
        num_recent = min(budget, max(1, ceil(budget * self.recent_fraction)))
        older = held[: len(held) - num_recent]
        heavy = sorted(older, key=lambda i: (-scores.get(i, 0.0), i))[: budget - num_recent]
        keep = set(heavy)
        return [i for i in older if i not in keep]


def make_policy(
    name: str, block_size: int, sink_tokens: int = 4, h2o_recent_fraction: float = 0.5
) -> EvictionPolicy:
    """The policy called `name` (one of EVICTION_POLICIES)."""
    if name == "none":
        return NoEviction()
    if name == "lru":
        return LRUEviction()
    if name == "sink":
        return SinkEviction(sink_tokens, block_size)
    if name == "h2o":
        return H2OEviction(h2o_recent_fraction)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {EVICTION_POLICIES}")
