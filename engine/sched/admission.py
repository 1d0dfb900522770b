"""Admission and backpressure: what `Scheduler.add()` answers, per-tenant / per-session
concurrency counts, and the Retry-After estimate for refused requests."""

from __future__ import annotations

import enum
import math
from collections import Counter, deque
from dataclasses import dataclass

from engine.request import Sequence


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
