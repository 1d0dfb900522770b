"""Admission and backpressure: what `Scheduler.add()` answers, per-tenant / per-session
concurrency counts, and the Retry-After estimate for refused requests."""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from dataclasses import dataclass

from engine.request import Sequence
from engine.sched.config import SchedulerConfig


class AdmissionStatus(str, enum.Enum):
    ACCEPTED = "accepted"
    OVERLOADED = "overloaded"  # the waiting queue is full: HTTP 429 + Retry-After
    LIMITED = "limited"  # the tenant or session has too many requests in flight: 429 + Retry-After
    TOO_LARGE = "too_large"  # can never fit the KV cache: HTTP 400, retrying cannot help


@dataclass(frozen=True)
class AddResult:
    """The outcome of offering one request to the scheduler."""

    status: AdmissionStatus
    message: str = ""
    retry_after_s: int | None = None  # whole seconds, for the Retry-After header

    @property
    def accepted(self) -> bool:
        return self.status is AdmissionStatus.ACCEPTED


class InflightCounts:
    """Requests accepted and not yet finished, per tenant and per session."""

    def __init__(self) -> None:
        self.by_tenant: Counter[str] = Counter()
        self.by_session: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        self.by_tenant[seq.tenant] += 1
        if seq.session_id is not None:
            self.by_session[seq.session_id] += 1

    def remove(self, seq: Sequence) -> None:
        self.by_tenant[seq.tenant] -= 1
        if self.by_tenant[seq.tenant] <= 0:
            del self.by_tenant[seq.tenant]
        if seq.session_id is not None:
            self.by_session[seq.session_id] -= 1
            if self.by_session[seq.session_id] <= 0:
                del self.by_session[seq.session_id]


class CompletionRate:
    """Requests completed per second over a sliding window, for Retry-After hints.

    A refused request can be retried once one slot frees up; slots free up at the rate
    requests complete, so the hint is 1 / rate, rounded up and clamped to
    [min_retry_s, max_retry_s]. With no completion in the window the hint is
    `default_retry_s`.
    """

    def __init__(
        self,
        window_s: float = 30.0,
        default_retry_s: int = 1,
        min_retry_s: int = 1,
        max_retry_s: int = 60,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.default_retry_s = default_retry_s
        self.min_retry_s = min_retry_s
        self.max_retry_s = max_retry_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._expire(now)

    def per_second(self, now: float) -> float:
        self._expire(now)
        return len(self._times) / self.window_s

    def retry_after_s(self, now: float) -> int:
        rate = self.per_second(now)
        if rate == 0.0:
            return self.default_retry_s
        return min(self.max_retry_s, max(self.min_retry_s, math.ceil(1.0 / rate)))

    def _expire(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()


def kv_tokens_needed(seq: Sequence, config: SchedulerConfig) -> int:
    """The most KV seq can hold at once: prompt + max_tokens - 1 (the last sampled token is
    never computed), or, under a per-session eviction budget, that budget plus one step's
    chunk (eviction trims after each step)."""
    need = seq.num_prompt_tokens + max(seq.sampling.max_tokens - 1, 0)
    if seq.eviction_policy != "none" and seq.max_kv_tokens is not None:
        need = min(need, seq.max_kv_tokens + config.max_num_batched_tokens)
    return need


def refusal(
    seq: Sequence,
    capacity: int,
    inflight: InflightCounts,
    num_waiting: int,
    config: SchedulerConfig,
) -> tuple[AdmissionStatus, str] | None:
    """Why `seq` is refused, or None when it is accepted: it needs more KV (kv_tokens_needed)
    than one sequence can hold, `capacity` tokens (TOO_LARGE); its tenant or session is at its
    in-flight limit (LIMITED); or `num_waiting` requests already fill the queue (OVERLOADED)."""
    need = kv_tokens_needed(seq, config)
    if need > capacity:
        return (
            AdmissionStatus.TOO_LARGE,
            f"the request needs up to {need} tokens of KV cache (prompt of "
            f"{seq.num_prompt_tokens} tokens, max_tokens {seq.sampling.max_tokens}) but the "
            f"server holds at most {capacity}; shorten the prompt or lower max_tokens",
        )
    limit = config.max_inflight_per_tenant
    if limit is not None and inflight.by_tenant[seq.tenant] >= limit:
        return (
            AdmissionStatus.LIMITED,
            f"tenant {seq.tenant!r} already has {limit} requests in flight (the limit)",
        )
    limit = config.max_inflight_per_session
    if (
        limit is not None
        and seq.session_id is not None
        and inflight.by_session[seq.session_id] >= limit
    ):
        return (
            AdmissionStatus.LIMITED,
            f"session {seq.session_id!r} already has {limit} requests in flight (the limit)",
        )
    if num_waiting >= config.max_queue_len:
        return (
            AdmissionStatus.OVERLOADED,
            f"the server is overloaded: {num_waiting} requests are waiting (the limit)",
        )
    return None


class Admission:
    """The scheduler's door: refuses what cannot or may not run now (refusal), counts what is
    in flight, and hints when a refused request may retry (the completion rate)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.inflight = InflightCounts()
        self.completions = CompletionRate(window_s=config.retry_window_s)
        self.rejected: Counter[str] = Counter()  # AdmissionStatus value -> refusals

    def offer(self, seq: Sequence, capacity: int, num_waiting: int, now: float) -> AddResult:
        """Accept seq (counting it in flight) or say why not, with a Retry-After hint where
        retrying can help."""
        refused = refusal(seq, capacity, self.inflight, num_waiting, self.config)
        if refused is None:
            self.inflight.add(seq)
            return AddResult(AdmissionStatus.ACCEPTED)
        status, message = refused
        self.rejected[status.value] += 1
        if status is AdmissionStatus.TOO_LARGE:
            return AddResult(status, message)  # retrying cannot help
        return AddResult(status, message, self.completions.retry_after_s(now))

    def retired(self, seq: Sequence, now: float) -> bool:
        """seq left the scheduler; True when its tenant has nothing left in flight."""
        self.inflight.remove(seq)
        self.completions.record(now)
        return seq.tenant not in self.inflight.by_tenant
