"""Scheduling policies: which waiting sequence is admitted next, who gets a step's prefill
tokens first, and who is charged for service.

The scheduler owns the queues; a policy only orders them and keeps whatever per-tenant
accounting it needs. Policies are chosen by name (`make_policy`):

- "fcfs":     queue order, i.e. arrival order (a preempted sequence goes back to the front).
              Priority is ignored.
- "priority": the most urgent first (lowest `Sequence.priority`), then queue order.
- "vtc":      the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
              Models" (OSDI 2024), Algorithm 2: admit and prefill for the backlogged tenant
              with the smallest counter once the request is served (its finish tag); within
              a tenant, most urgent priority first, then queue order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import ClassVar

from engine.request import Sequence


@dataclass(frozen=True)
class TokenCost:
    """The service cost of tokens: w_p per prompt token computed, w_q per output token.

    Output tokens weigh more by default (decoding is the scarcer resource per token),
    as in the paper's experiments (w_q = 2 w_p).
    """

    prompt_weight: float = 1.0
    output_weight: float = 2.0

    def __post_init__(self) -> None:
        if self.prompt_weight < 0 or self.output_weight < 0:
            raise ValueError(f"token weights must be >= 0, got {self}")

    def __call__(self, num_prompt_tokens: int, num_output_tokens: int) -> float:
        return self.prompt_weight * num_prompt_tokens + self.output_weight * num_output_tokens


class Policy(ABC):
    """What the scheduler asks a policy. Every hook but `select` defaults to doing nothing
    (their bodies are empty on purpose, hence `noqa: B027`)."""

    name: ClassVar[str]

    def on_arrival(self, seq: Sequence, queued: SequenceOf[Sequence]) -> None:  # noqa: B027
        """A new request is about to join the waiting queue. `queued`: the sequences waiting
        for prefill tokens before it joins (the waiting queue, then running sequences whose
        prompt is not all computed).

        Not called when a preempted sequence returns to the queue: that is not new work.
        """

    @abstractmethod
    def select(self, waiting: SequenceOf[Sequence]) -> Sequence:
        """The sequence to admit next from `waiting` (non-empty, in queue order)."""

    def prefill_rank(self, seq: Sequence) -> tuple[float, int]:
        """Which sequence gets a step's prefill tokens first, lowest first, whether it is
        running or the pick from the waiting queue. Equal ranks (the default) leave the
        scheduler's order: running sequences before admissions, most urgent first."""
        return (0.0, 0)

    def on_prefilled(self, seq: Sequence) -> None:  # noqa: B027
        """The last of `seq`'s prompt is scheduled: it no longer waits for prefill tokens."""

    def charge(  # noqa: B027
        self, tenant: str, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:
        """`tenant` is served these tokens in the step being scheduled."""

    def counters(self) -> dict[str, float]:
        """The policy's per-tenant counters (empty for policies that keep none)."""
        return {}

    def forget(self, tenant: str) -> None:  # noqa: B027
        """`tenant` has been idle long enough to be retired: drop what is kept for it."""


class FcfsPolicy(Policy):
    """First come, first served: the head of the queue."""

    name = "fcfs"

    def select(self, waiting: SequenceOf[Sequence]) -> Sequence:
        return waiting[0]


class PriorityPolicy(Policy):
    """Lowest `priority` value first (most urgent); ties in queue order."""

    name = "priority"

    def select(self, waiting: SequenceOf[Sequence]) -> Sequence:
        # min() keeps the first of equal keys, so ties stay in queue order.
        return min(waiting, key=lambda seq: seq.priority)


class VtcPolicy(Policy):
    """Virtual Token Counter (Sheng et al., OSDI 2024, Algorithm 2), over chunked prefill.

    Each tenant u has a counter c_u, charged w_p per prompt token computed and w_q per
    output token as they are served. The paper's queue Q holds requests not yet prefilled;
    its server prefills a prompt whole on admission. Ours prefills in chunks under a step
    budget, so Q here is every sequence still waiting for prefill tokens: the waiting queue
    and the running sequences whose prompt is not all computed.

    Which request in Q gets the step's prefill tokens (`prefill_rank`; a chunk is a piece of
    the paper's admission) and which is admitted from the waiting queue (`select`): the one
    with the smallest virtual finish tag, its tenant's counter plus the cost of the prompt
    tokens it still waits for (`finish_tag`), each tenant represented by its most urgent
    request (priority, then queue order); ties go to the tenant nearest the head. The paper
    ranks by the counter alone (a start tag). Counters are charged as before; the finish tag
    changes the order, as weighted fair queueing does: a short prompt is not queued behind
    another tenant's long one that would finish later anyway, so two short prompts a tenant
    sends together are both prefilled in the next step instead of the second waiting until
    everyone else's counter has passed the first's charge. The price: a tenant may be served
    while its counter is above a backlogged one's by up to that one's remaining prompt cost
    (at most w_p * L_input <= U), so the paper's worst-case gap 2U becomes 3U.

    Counter lift, as in the paper's monitoring stream: when a request of u arrives and u has
    no request in Q,
      - if Q is empty:      c_u <- max(c_u, c_l), l the tenant whose request last left Q;
      - else:               c_u <- max(c_u, min{c_i : i has a request in Q}).
    So a tenant that was idle (or only had decoding requests) banks no credit for that time.
    A request leaves Q when the last of its prompt is scheduled (an aborted request leaving
    Q does not update l).
    """

    name = "vtc"

    def __init__(self, cost: TokenCost | None = None) -> None:
        self.cost = cost or TokenCost()
        self._counters: dict[str, float] = {}
        self._last_left: str | None = None  # tenant of the request that last left Q
        self._retired_last_left = 0.0  # c_l when l itself was retired since

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def on_arrival(self, seq: Sequence, queued: SequenceOf[Sequence]) -> None:
        tenant = seq.tenant
        current = self.counter(tenant)
        self._counters[tenant] = current
        if any(other.tenant == tenant for other in queued):
            return
        if not queued:
            c_l = (
                self._retired_last_left
                if self._last_left is None
                else self.counter(self._last_left)
            )
            self._counters[tenant] = max(current, c_l)
        else:
            floor = min(self.counter(other.tenant) for other in queued)
            self._counters[tenant] = max(current, floor)

    def finish_tag(self, seq: Sequence) -> float:
        """seq's tenant's counter once the rest of seq's prompt is charged: c_u + w_p * the
        prompt tokens not computed yet (prefix-cache hits, unknown before admission, count)."""
        rest = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        return self.counter(seq.tenant) + self.cost(rest, 0)

    def select(self, waiting: SequenceOf[Sequence]) -> Sequence:
        # Each tenant's most urgent request, tenants in order of their first request in the
        # queue, so that min() gives ties to the head.
        candidates: dict[str, Sequence] = {}
        for seq in waiting:
            best = candidates.get(seq.tenant)
            if best is None or seq.priority < best.priority:
                candidates[seq.tenant] = seq
        return min(candidates.values(), key=self.finish_tag)

    def prefill_rank(self, seq: Sequence) -> tuple[float, int]:
        """The finish tag: prefill chunks, like admissions, go to the request in Q whose
        tenant's counter is smallest once that request's prompt is served. On equal tags the
        shorter rest of a prompt goes first: it leaves Q sooner."""
        return (self.finish_tag(seq), seq.num_tokens - seq.num_computed_tokens)

    def on_prefilled(self, seq: Sequence) -> None:
        self._last_left = seq.tenant

    def charge(self, tenant: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        cost = self.cost(num_prompt_tokens, num_output_tokens)
        self._counters[tenant] = self.counter(tenant) + cost

    def counters(self) -> dict[str, float]:
        return dict(self._counters)

    def forget(self, tenant: str) -> None:
        if tenant == self._last_left:
            self._retired_last_left, self._last_left = self.counter(tenant), None
        self._counters.pop(tenant, None)


SCHEDULING_POLICIES = ("fcfs", "priority", "vtc")


def make_policy(name: str, cost: TokenCost | None = None) -> Policy:
    """The policy called `name` ("fcfs", "priority" or "vtc"); `cost` weights vtc's counters."""
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "vtc":
        return VtcPolicy(cost)
    raise ValueError(f"unknown scheduling policy {name!r}; expected one of {SCHEDULING_POLICIES}")
