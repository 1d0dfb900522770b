"""The scheduler's settings (MAX_BATCH_SIZE, MAX_NUM_BATCHED_TOKENS, the queue and in-flight
limits, the fairness weights, idle timeouts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched.policy import TokenCost

# The most sequences an automatic batch limit runs at once (vLLM's default max_num_seqs).
MAX_AUTO_BATCH = 256


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "vtc"  # "fcfs", "priority" or "vtc"
    # Most sequences running at once (MAX_BATCH_SIZE); None: the engine sizes it from memory
    # and the step budget (engine.llm_engine.auto_max_num_seqs), a bare scheduler runs up to
    # MAX_AUTO_BATCH.
    max_num_seqs: int | None = None
    # Token budget of one step: decodes + prefill chunks. 2048 as vLLM's CPU server: a long
    # prompt's GEMMs run at more rows per call, and a window-bound prefill in fewer chunks
    # (`python -m evals.bench_peers`, its long-prompt point).
    max_num_batched_tokens: int = 2048
    # Once a step's prefill chunks hold this many tokens, no further sequence's chunk joins the
    # step (the first may still take the whole budget); None: the budget alone decides. A
    # burst of short prompts is then prefilled a few at a time: the first get their first
    # token after a step of this size, not after the whole burst's, and a closed loop's
    # clients stop finishing, and arriving, in lockstep. bench_peers' mode "gemma-serve, no
    # prefill groups" compares both ways (docs/performance.md, "A burst of prompts").
    prefill_group_tokens: int | None = 512
    max_queue_len: int = 256  # waiting requests before add() answers OVERLOADED (MAX_QUEUE_LEN)
    max_inflight_per_tenant: int | None = None  # accepted, unfinished requests; None: no limit
    max_inflight_per_session: int | None = None
    token_cost: TokenCost = field(default_factory=TokenCost)  # w_p, w_q for vtc and the ledger
    retry_window_s: float = 30.0  # completions counted for the Retry-After estimate
    session_kv_idle_s: float | None = 300.0  # session pins idle this long are released
    # Idle tenants' counters and service are forgotten after this long, or least recently
    # active first beyond max_idle_tenants (engine.sched.tenants); None: never.
    tenant_idle_s: float | None = 600.0
    max_idle_tenants: int | None = 1024

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_queue_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_num_seqs",
            "max_inflight_per_tenant",
            "max_inflight_per_session",
            "prefill_group_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
