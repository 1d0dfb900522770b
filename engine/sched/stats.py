"""Scheduler statistics: per-tenant service ledger and a JSON-able snapshot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from engine.request import Sequence as EngineSequence
from engine.sched.policy import Policy, TokenCost


@dataclass
class TenantUsage:
    """Tokens served to one tenant since start. `service` is their weighted sum
    (w_p * prompt_tokens + w_q * output_tokens), the paper's measure of service; unlike a
    VTC counter it is never lifted, so it is comparable across policies."""

    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits and recomputation excluded)
    output_tokens: int = 0  # tokens sampled
    service: float = 0.0


class TenantLedger:
    """Per-tenant tokens served, charged as steps are scheduled."""

    def __init__(self, cost: TokenCost) -> None:
        self.cost = cost
        self.tenants: dict[str, TenantUsage] = {}

    def charge(self, tenant: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        usage = self.tenants.setdefault(tenant, TenantUsage())
        usage.prompt_tokens += num_prompt_tokens
        usage.output_tokens += num_output_tokens
        usage.service += self.cost(num_prompt_tokens, num_output_tokens)

    def forget(self, tenant: str) -> None:
        """Drop a retired tenant's totals (engine.sched.tenants)."""
        self.tenants.pop(tenant, None)

    def service(self, tenant: str) -> float:
        usage = self.tenants.get(tenant)
        return usage.service if usage else 0.0


class ServiceCharges:
    """Charges each scheduled chunk's new service to its tenant, in the policy's counters and
    the ledger alike: w_p for each prompt token computed for the first time (prefix-cache hits
    and recomputation after preemption are free) and w_q for the token a chunk samples."""

    def __init__(self, policy: Policy, ledger: TenantLedger) -> None:
        self.policy = policy
        self.ledger = ledger
        self._charged_upto: dict[int, int] = {}  # seq id -> positions already charged

    def charge(self, seq: EngineSequence, start: int, end: int, samples: bool) -> None:
        """seq's chunk computes positions [start, end) and samples a token if `samples`."""
        charged = self._charged_upto.get(seq.seq_id, 0)
        new_prompt = max(0, min(end, seq.num_prompt_tokens) - max(start, charged))
        self._charged_upto[seq.seq_id] = max(charged, end)
        new_output = 1 if samples else 0
        if new_prompt or new_output:
            self.policy.charge(seq.tenant, new_prompt, new_output)
            self.ledger.charge(seq.tenant, new_prompt, new_output)

    def forget(self, seq_id: int) -> None:
        """seq retired: its charges are complete."""
        self._charged_upto.pop(seq_id, None)


@dataclass
class TenantStats:
    running: int = 0
    waiting: int = 0
    prefilling: int = 0  # running, prompt not all computed: still queued for prefill tokens
    prompt_tokens: int = 0
    output_tokens: int = 0
    service: float = 0.0
    counter: float | None = None  # the policy's counter (vtc), None for policies without one


def tenant_stats(
    ledger: TenantLedger,
    counters: Mapping[str, float] | None,
    running: Sequence[EngineSequence],
    waiting: Sequence[EngineSequence],
    prefilling: Callable[[EngineSequence], bool],
) -> dict[str, TenantStats]:
    """Every tenant served, counted by the policy or with requests in the queues, by name."""
    num_running = Counter(s.tenant for s in running)
    num_waiting = Counter(s.tenant for s in waiting)
    num_prefilling = Counter(s.tenant for s in running if prefilling(s))
    names = set(ledger.tenants) | set(counters or {}) | set(num_running) | set(num_waiting)
    tenants: dict[str, TenantStats] = {}
    for name in sorted(names):
        usage = ledger.tenants.get(name)
        tenants[name] = TenantStats(
            running=num_running[name],
            waiting=num_waiting[name],
            prefilling=num_prefilling[name],
            prompt_tokens=usage.prompt_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            service=usage.service if usage else 0.0,
            counter=counters.get(name) if counters else None,
        )
    return tenants


@dataclass
class SchedulerStats:
    policy: str
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    num_finished: int  # completed (not aborted) since start
    num_aborted: int
    rejected: dict[str, int]  # AdmissionStatus value -> count of refused add() calls
    kv_usage: float  # fraction of KV blocks held by sequences
    completions_per_s: float  # over the Retry-After window
    retired_tenants: int = 0  # idle tenants whose state was forgotten, since start
    tenants: dict[str, TenantStats] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class ServiceGapTracker:
    """The VTC paper's fairness measure, observed live: for two tenants backlogged (with
    requests waiting for prefill tokens: queued, or running with prompt left) at every
    observation of a stretch, the largest |W_f(t1, t2) - W_g(t1, t2)|
    over t1 < t2 in it, W being weighted service. Sheng et al. (OSDI 2024, §4) bound it
    by 2 max(w_p L_input, w_q M) under VTC; FCFS lets it grow without bound.

    Observations are whenever `observe` is called (the dashboard's poll), so a stretch is
    "continuously backlogged" as far as those samples see."""

    def __init__(self) -> None:
        # (f, g) -> (lowest, highest) W_f - W_g seen in the pair's current stretch
        self._stretches: dict[tuple[str, str], tuple[float, float]] = {}
        self.max_seen = 0.0  # the largest gap of any stretch since start

    def observe(self, tenants: Mapping[str, TenantStats]) -> None:
        """Extend the stretches of pairs still both backlogged; end the others."""
        backlogged = sorted(name for name, t in tenants.items() if t.waiting + t.prefilling > 0)
        stretches: dict[tuple[str, str], tuple[float, float]] = {}
        for i, f in enumerate(backlogged):
            for g in backlogged[i + 1 :]:
                diff = tenants[f].service - tenants[g].service
                low, high = self._stretches.get((f, g), (diff, diff))
                stretches[(f, g)] = (min(low, diff), max(high, diff))
        self._stretches = stretches
        self.max_seen = max(self.max_seen, self.current()[0])

    def current(self) -> tuple[float, tuple[str, str] | None]:
        """The largest gap among pairs backlogged now, and that pair (None when no pair is)."""
        gap, pair = 0.0, None
        for key, (low, high) in self._stretches.items():
            if high - low > gap or pair is None:
                gap, pair = high - low, key
        return gap, pair
