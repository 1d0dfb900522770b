"""Per-tenant state stays bounded whatever tenants clients name: idle tenants are retired after
an idle time or beyond a count (pure logic, exact values), and Prometheus exports a capped set."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.metrics import EngineGauges, ServingMetrics
from engine.sched.stats import TenantStats
from engine.sched.tenants import IdleTenants
from tests.sched_driver import FakeClock, make_scheduler, make_seq, run_step


def test_idle_tenants_retire_by_age_and_beyond_the_count_oldest_first():
    idle = IdleTenants(idle_s=10.0, max_idle=2)
    idle.idle("a", 0.0)
    idle.idle("b", 1.0)
    idle.idle("c", 2.0)
    assert idle.expired(3.0) == ["a"]  # three idle, two allowed: the least recently active
    idle.busy("b")  # b has a request in flight again
    assert len(idle) == 1 and idle.expired(11.0) == []
    assert idle.expired(12.0) == ["c"]  # 10 s idle
    idle.idle("b", 20.0)
    idle.idle("b", 25.0)  # active again and idle again: counted from the latest
    assert idle.expired(34.0) == [] and idle.expired(35.0) == ["b"]


def test_the_scheduler_forgets_retired_tenants_and_keeps_busy_ones():
    clock = FakeClock(0.0)
    sched = make_scheduler(policy="vtc", clock=clock, tenant_idle_s=100.0, max_idle_tenants=3)
    for i in range(10):  # ten tenants, one short request each, one after another
        sched.add(make_seq(4, max_tokens=1, tenant=f"user-{i}"))
        while sched.has_work:
            run_step(sched)
        clock.now += 1.0
    busy = make_seq(4, max_tokens=50, tenant="busy")
    sched.add(busy)
    run_step(sched)
    stats = sched.stats()
    # Retired at the start of each step: the three most recent idle tenants remain.
    assert set(stats.tenants) == {"user-7", "user-8", "user-9", "busy"}
    assert stats.retired_tenants == 7
    assert set(sched.policy.counters()) == set(sched.ledger.tenants) == set(stats.tenants)
    clock.now += 100.0
    run_step(sched)
    assert set(sched.stats().tenants) == {"busy"}  # idle for 100 s; busy is still running


def test_a_retired_tenant_comes_back_lifted_like_a_new_one():
    clock = FakeClock(0.0)
    sched = make_scheduler(policy="vtc", clock=clock, tenant_idle_s=5.0, max_num_seqs=1)
    sched.add(make_seq(8, max_tokens=1, tenant="old"))
    run_step(sched)  # old: 8 + 2 = 10, and it left Q last
    clock.now += 10.0
    run_step(sched)  # old retired
    assert sched.policy.counters() == {}
    sched.add(make_seq(4, max_tokens=1, tenant="new"))
    # Q empty: lifted to the retired last-left tenant's counter, as if it were still known.
    assert sched.policy.counter("new") == 10.0


def test_prometheus_exports_at_most_the_cap_in_flight_tenants_first():
    metrics = ServingMetrics("m", max_tenants=2)
    tenants = {
        "idle-big": TenantStats(service=900.0, prompt_tokens=300, output_tokens=300, counter=9.0),
        "idle-small": TenantStats(service=10.0, prompt_tokens=5, output_tokens=0, counter=1.0),
        "busy": TenantStats(waiting=1, service=1.0, prompt_tokens=1, counter=2.0),
    }
    gauges = EngineGauges(0, 0, 0.0, 0, 0, 0, tenants)
    metrics.update_gauges(gauges)
    metrics.update_gauges(gauges)
    text = metrics_text(metrics)
    assert 'tenant="busy"' in text and 'tenant="idle-big"' in text
    assert 'tenant="idle-small"' not in text
    metrics.update_gauges(EngineGauges(0, 0, 0.0, 0, 0, 0, {}))
    assert "tenant=" not in metrics_text(metrics)  # retired tenants' series go too


def test_per_tenant_ttft_windows_are_capped_least_recently_updated_first():
    metrics = ServingMetrics("m", max_tenants=3)
    for i in range(10):
        metrics.record_first_token(0.1, tenant=f"t{i}")
    metrics.record_first_token(0.1, tenant="t7")
    assert list(metrics.tenant_ttft) == ["t8", "t9", "t7"]


def metrics_text(metrics: ServingMetrics) -> str:
    return generate_latest(metrics.registry).decode()
