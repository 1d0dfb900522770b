"""What /metrics exposes from ServingMetrics (pure logic, exact text): the engine's running
totals as Prometheus counters, and one capped choice of tenants for /metrics and the dashboard."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineGauges, ServingMetrics, shown_tenants
from engine.sched.stats import TenantStats

COUNTERS = (
    "gemma_serve:prefix_cache_queries_total",
    "gemma_serve:prefix_cache_hits_total",
    "gemma_serve:num_preemptions_total",
    "gemma_serve:tenant_tokens_served_total",
)


def exposition(metrics: ServingMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def scraped(tenants: dict[str, TenantStats] | None = None) -> str:
    metrics = ServingMetrics("m")
    metrics.update_gauges(EngineGauges(2, 1, 0.25, 120, 48, 3, tenants or {}))
    return exposition(metrics)


def test_engine_totals_are_counters_with_their_documented_names():
    text = scraped({"alice": TenantStats(prompt_tokens=7, output_tokens=5, counter=3.0)})
    lines = text.splitlines()
    for name in COUNTERS:
        assert f"# TYPE {name} counter" in lines, name
    # The engine's own values, as they stand; no *_created series (the engine keeps no start
    # time per total), so no extra gauge family beside any counter.
    samples = [line for line in lines if line.startswith(COUNTERS) or "_created" in line]
    assert samples == [
        'gemma_serve:prefix_cache_queries_total{model_name="m"} 120.0',
        'gemma_serve:prefix_cache_hits_total{model_name="m"} 48.0',
        'gemma_serve:num_preemptions_total{model_name="m"} 3.0',
        'gemma_serve:tenant_tokens_served_total{model_name="m",tenant="alice"} 12.0',
    ]
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: types[name.removesuffix("_total")] for name in COUNTERS} == dict.fromkeys(
        COUNTERS, "counter"
    )


def test_engine_state_stays_gauges():
    text = scraped({"alice": TenantStats(prompt_tokens=7, output_tokens=5, counter=3.0)})
    samples = {
        (s.name, s.labels.get("tenant")): (family.type, s.value)
        for family in text_string_to_metric_families(text)
        if family.type == "gauge" and not family.name.endswith("_created")
        for s in family.samples
    }
    assert samples == {
        ("gemma_serve:num_requests_running", None): ("gauge", 2.0),
        ("gemma_serve:num_requests_waiting", None): ("gauge", 1.0),
        ("gemma_serve:kv_cache_usage_perc", None): ("gauge", 0.25),
        ("gemma_serve:tenant_virtual_token_counter", "alice"): ("gauge", 3.0),
    }


def test_shown_tenants_in_flight_first_then_most_served_ties_by_name():
    tenants = {
        "idle-big": TenantStats(service=900.0),
        "idle-b": TenantStats(service=10.0),
        "idle-a": TenantStats(service=10.0),
        "busy": TenantStats(waiting=1, service=1.0),
        "running": TenantStats(running=2, service=0.0),
    }
    names = [name for name, _ in shown_tenants(tenants, 4)]
    assert names == ["running", "busy", "idle-big", "idle-a"]
    assert shown_tenants(tenants, 0) == []


def test_the_dashboard_lists_the_tenants_metrics_exports():
    metrics = ServingMetrics("m", max_tenants=2)
    tenants = {
        "idle-big": TenantStats(service=900.0, prompt_tokens=300, output_tokens=300),
        "idle-small": TenantStats(service=10.0, prompt_tokens=10),
        "busy": TenantStats(waiting=1, service=1.0, prompt_tokens=1),
    }
    metrics.record_first_token(0.5, tenant="idle-small")
    metrics.record_first_token(0.25, tenant="busy")
    metrics.update_gauges(EngineGauges(0, 1, 0.0, 0, 0, 0, tenants))
    fairness = metrics.fairness(tenants)
    assert list(fairness["tenants"]) == ["busy", "idle-big"]
    assert fairness["tenants"]["busy"]["service"] == 1.0
    assert fairness["tenants"]["busy"]["ttft_s"]["p50"] == 0.25
    assert fairness["tenants"]["idle-big"]["ttft_s"]["count"] == 0
    families = text_string_to_metric_families(exposition(metrics))
    labels = {s.labels["tenant"] for f in families for s in f.samples if "tenant" in s.labels}
    assert labels == set(fairness["tenants"])
