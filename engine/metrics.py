"""Serving metrics: sliding-window latency percentiles for the dashboard and a Prometheus
registry for operators.

Prometheus names follow vLLM's under our own prefix (`gemma_serve:` instead of `vllm:`), so an
existing vLLM dashboard maps over with a rename.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.sched.stats import ServiceGapTracker, TenantStats

PREFIX = "gemma_serve:"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


class SlidingWindow:
    """Samples from the last `window_s` seconds; percentiles over what remains."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def values(self) -> list[float]:
        self._trim()
        return [value for _, value in self._samples]

    def summary(self) -> dict[str, float]:
        values = sorted(self.values())
        return {
            "count": len(values),
            "p50": percentile(values, 50),
            "p95": percentile(values, 95),
            "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else 0.0,
        }

    def total(self) -> float:
        return sum(self.values())


@dataclass
class EngineGauges:
    """What the engine reports about itself at one instant."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    tenants: dict[str, TenantStats]


# Model-wide series of EngineGauges: (family, name, help, value). The `_total`s are the engine's
# own running totals, hence counters.
_MODEL_WIDE: tuple[
    tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, Callable[[EngineGauges], float]],
    ...,
] = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.",
     lambda g: g.running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.",
     lambda g: g.waiting),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
     lambda g: g.kv_usage),
    (CounterMetricFamily, "prefix_cache_queries_total",
     "Prompt tokens looked up in the prefix cache.", lambda g: g.prefix_queries),
    (CounterMetricFamily, "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
     lambda g: g.prefix_hits),
    (CounterMetricFamily, "num_preemptions_total", "Sequences preempted for recompute.",
     lambda g: g.preemptions),
)  # fmt: skip


def shown_tenants(tenants: Mapping[str, TenantStats], limit: int) -> list[tuple[str, TenantStats]]:
    """The at most `limit` tenants given their own series (clients may name a new tenant per
    request): those with requests in flight first, then the most served, ties by name (so
    /metrics and /api/metrics pick the same ones)."""
    return heapq.nsmallest(
        limit,
        tenants.items(),
        key=lambda item: (-(item[1].running + item[1].waiting), -item[1].service, item[0]),
    )


class EngineCollector:
    """Prometheus collector for what the engine reports at a scrape (`update`). Its running
    totals are exported as counters as they stand: the engine counts them already, and a Gauge
    would mistype them."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._latest: tuple[EngineGauges, list[tuple[str, TenantStats]]] | None = None

    def update(self, gauges: EngineGauges, tenants: list[tuple[str, TenantStats]]) -> None:
        self._latest = (gauges, tenants)  # one assignment: a concurrent scrape sees one state

    def collect(self) -> Iterator[Metric]:
        if self._latest is None:
            return
        gauges, tenants = self._latest
        for kind, name, doc, value_of in _MODEL_WIDE:
            family = kind(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value_of(gauges))
            yield family
        labels = ["model_name", "tenant"]
        counter = GaugeMetricFamily(
            PREFIX + "tenant_virtual_token_counter", "VTC virtual token counter per tenant.",
            labels=labels,
        )  # fmt: skip
        served = CounterMetricFamily(
            PREFIX + "tenant_tokens_served_total", "Tokens served per tenant (prompt + output).",
            labels=labels,
        )  # fmt: skip
        for tenant, stats in tenants:
            if stats.counter is not None:
                counter.add_metric([self._model_name, tenant], stats.counter)
            served.add_metric([self._model_name, tenant], stats.prompt_tokens + stats.output_tokens)
        yield counter
        yield served


class ServingMetrics:
    """Records request timings; exposes sliding windows and Prometheus collectors.

    Per-tenant series are kept for at most `max_tenants` tenants, whatever clients send (a
    client can name a new tenant per request): Prometheus and the dashboard's fairness card show
    the tenants with requests in flight first, then the most served (`shown_tenants`);
    per-tenant TTFT windows are dropped once their samples expire, least recently updated first
    beyond the cap. Model-wide series count everyone.
    """

    def __init__(self, model_name: str, window_s: float = 60.0, max_tenants: int = 64):
        self.model_name = model_name
        self.window_s = window_s
        self.max_tenants = max_tenants
        self.ttft = SlidingWindow(window_s)
        self.tpot = SlidingWindow(window_s)
        self.e2e = SlidingWindow(window_s)
        self.generated = SlidingWindow(window_s)  # tokens per engine step, timestamped
        self.tenant_ttft: dict[str, SlidingWindow] = {}  # per tenant, for fairness as users see it
        self.service_gap = ServiceGapTracker()
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._ttft_hist = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._tpot_hist = Histogram(
            PREFIX + "time_per_output_token_seconds", "Time per output token after the first.",
            labels, buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._e2e_hist = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self._generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self._success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            [*labels, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._engine = EngineCollector(model_name)
        self.registry.register(self._engine)

    def record_first_token(self, seconds: float, tenant: str | None = None) -> None:
        with self._lock:
            self.ttft.add(seconds)
            if tenant is not None:
                window = self.tenant_ttft.pop(tenant, None) or SlidingWindow(self.window_s)
                window.add(seconds)
                self.tenant_ttft[tenant] = window  # most recently updated last
                self._bound_tenant_windows()
        self._ttft_hist.labels(self.model_name).observe(seconds)

    def _bound_tenant_windows(self) -> None:
        if len(self.tenant_ttft) <= self.max_tenants:
            return
        for name in [n for n, w in self.tenant_ttft.items() if not w.values()]:
            del self.tenant_ttft[name]
        while len(self.tenant_ttft) > self.max_tenants:
            del self.tenant_ttft[next(iter(self.tenant_ttft))]

    def record_finished(
        self, *, e2e_s: float, ttft_s: float | None, prompt_tokens: int, output_tokens: int,
        finish_reason: str,
    ) -> None:  # fmt: skip
        tpot = None
        if ttft_s is not None and output_tokens > 1:
            tpot = (e2e_s - ttft_s) / (output_tokens - 1)
        with self._lock:
            self.e2e.add(e2e_s)
            if tpot is not None:
                self.tpot.add(tpot)
        name = self.model_name
        self._e2e_hist.labels(name).observe(e2e_s)
        if tpot is not None:
            self._tpot_hist.labels(name).observe(tpot)
        self._prompt_tokens.labels(name).inc(prompt_tokens)
        self._success.labels(name, finish_reason).inc()

    def record_generated(self, num_tokens: int) -> None:
        with self._lock:
            self.generated.add(num_tokens)
        self._generation_tokens.labels(self.model_name).inc(num_tokens)

    def update_gauges(self, gauges: EngineGauges) -> None:
        """What /metrics exports next: the engine's state, per tenant for the shown ones."""
        self._engine.update(gauges, shown_tenants(gauges.tenants, self.max_tenants))

    def snapshot(self) -> dict:
        """Sliding-window summary for the dashboard's JSON API."""
        with self._lock:
            span = min(self.window_s, max(time.monotonic() - self._started, 1e-9))
            return {
                "window_s": self.window_s,
                "ttft_s": self.ttft.summary(),
                "tpot_s": self.tpot.summary(),
                "e2e_s": self.e2e.summary(),
                "throughput_tokens_per_s": self.generated.total() / span,
            }

    def fairness(self, tenants: dict[str, TenantStats]) -> dict:
        """Per-tenant service and TTFT, and the service gap between backlogged tenants, for the
        dashboard: the same numbers `evals/fairness_http.py` measures from outside. Per tenant
        only for the tenants /metrics shows; the gap is over all of them."""
        with self._lock:
            self.service_gap.observe(tenants)
            gap, pair = self.service_gap.current()
            per_tenant = {
                name: {
                    "service": stats.service,
                    "ttft_s": (self.tenant_ttft.get(name) or SlidingWindow()).summary(),
                }
                for name, stats in shown_tenants(tenants, self.max_tenants)
            }
            return {
                "tenants": per_tenant,
                "max_service_gap": gap,
                "gap_pair": list(pair) if pair else None,
                "max_service_gap_seen": self.service_gap.max_seen,
            }
