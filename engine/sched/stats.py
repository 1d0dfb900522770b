"""Scheduler statistics: per-tenant service ledger and a JSON-able snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.sched.policy import TokenCost


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

    def service(self, tenant: str) -> float:
        usage = self.tenants.get(tenant)
        return usage.service if usage else 0.0


@dataclass
class TenantStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    service: float = 0.0
    counter: float | None = None  # the policy's counter (vtc), None for policies without one


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
    tenants: dict[str, TenantStats] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)
