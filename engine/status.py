"""What the engine reports about itself: the gauges Prometheus scrapes and the snapshot the
dashboard polls, computed when asked rather than over every tenant each step."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.metrics import EngineGauges, ServingMetrics


def gauges(engine: LLMEngine) -> EngineGauges:
    """Scheduler and KV state for /metrics."""
    stats = engine.scheduler.stats()
    prefix = engine.kv.stats()["prefix_cache"]
    return EngineGauges(
        running=stats.num_running,
        waiting=stats.num_waiting,
        kv_usage=stats.kv_usage,
        prefix_queries=prefix["query_tokens"],
        prefix_hits=prefix["hit_tokens"],
        preemptions=stats.num_preemptions,
        tenants=stats.tenants,
    )


def snapshot(engine: LLMEngine, metrics: ServingMetrics) -> dict:
    """Everything the dashboard shows: latency windows, scheduler and KV state, step profile."""
    stats = engine.scheduler.stats()
    fairness = metrics.fairness(stats.tenants)
    scheduler = stats.to_dict()
    # Clients may name a new tenant per request: list only the tenants the fairness part (and
    # /metrics) shows, at most METRICS_MAX_TENANTS; num_tenants counts every known one.
    scheduler["num_tenants"] = len(stats.tenants)
    scheduler["tenants"] = {name: scheduler["tenants"][name] for name in fairness["tenants"]}
    return {
        "metrics": metrics.snapshot(),
        "scheduler": scheduler,
        "fairness": fairness,
        "kv": engine.kv.stats(),
        "steps": engine.num_steps,
        "step_profile": engine.profile.summary(),
    }
