"""Fairness as a user sees it: three tenants stream completions over HTTP from the real server,
started in a subprocess, once under `fcfs` and once under `vtc`, plus the light tenant alone.

Tenants are API keys (`API_KEYS`, sent as `Authorization: Bearer <key>`):
- heavy: 8 concurrent streams of long prompts, always backlogged;
- light: 2 streams of short prompts, asking for far less than its fair share;
- late:  4 streams of medium prompts that start a third of the way in, backlogged from then on.
Prompt lengths and max_tokens are drawn from ranges (random token ids, so no prefix-cache
hits). Every stream fits in the batch (`MAX_BATCH_SIZE` 32); the step's token budget
(`MAX_NUM_BATCHED_TOKENS` 64) is what the tenants compete for: the prompts of heavy and late
queue for prefill tokens, which the policy hands out (fcfs: oldest first; vtc: the smallest
finish tag, the tenant's counter plus the rest of the prompt, first).

Reported, per policy: service over time per tenant (weighted tokens w_p * prompt + w_q *
output per time bucket, read from the server's per-tenant ledger in /api/metrics, the VTC
paper's plot), the largest service gap between two continuously backlogged tenants against the
paper's bound, and the light tenant's client-side TTFT p95 against its solo value. A tenant
is backlogged while it has a request waiting for prefill tokens (queued, or running with prompt
left), the scheduler's queue Q for vtc.

The bound (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, §4):
for two clients f, g backlogged over [t1, t2), |W_f(t1, t2) - W_g(t1, t2)| <= 2U with
U = max(w_p * L_input, w_q * M), L_input the longest prompt and M the most tokens a running
batch can hold. Here M = min(MAX_ACTIVE_KV_TOKENS, running * (longest prompt + largest
max_tokens)), running = min(MAX_BATCH_SIZE, streams): with the defaults, M = 14 * (448 + 48)
= 6,944, U = 2 * 6,944 and 2U = 27,776 weighted tokens.

The server runs with one OpenMP thread (`--threads`) so that other jobs on a shared machine do
not stall its steps; requests still running when a phase ends are cut off there, and a cut-off
request that had no token yet counts its wait so far as its TTFT (a lower bound).

    python -m evals.fairness_http [--seconds 60] [--fast]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from evals.harness import RESULTS, pct, running_server, write_results
from evals.plots import plt

MODEL = "gemma-3-270m"
VOCAB_LOW, VOCAB_HIGH = 1000, 30000  # ordinary token ids for random prompts


@dataclass(frozen=True)
class Tenant:
    """One tenant's closed-loop load: `streams` users, each sending its next request when the
    last one finished, from `start_frac` of the run on."""

    name: str
    streams: int
    prompt_tokens: tuple[int, int]  # inclusive range
    max_tokens: tuple[int, int]
    start_frac: float = 0.0

    @property
    def key(self) -> str:
        return f"key-{self.name}"


TENANTS = (
    Tenant("heavy", 8, (256, 448), (16, 48)),
    Tenant("light", 2, (16, 48), (8, 24)),
    Tenant("late", 4, (128, 256), (16, 48), start_frac=1 / 3),
)


@dataclass
class Record:
    """One request as its user saw it. A request still running when the run ends is cut off
    there (`complete` False): its TTFT, if no token had come yet, is the time it had waited,
    a lower bound, so that long waits count rather than vanish from the percentiles."""

    tenant: str
    sent_s: float  # since the run's start
    prompt_tokens: int
    max_tokens: int
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    complete: bool = False


@dataclass
class Sample:
    t_s: float
    service: dict[str, float] = field(default_factory=dict)
    queued: dict[str, int] = field(default_factory=dict)  # requests waiting for prefill tokens


async def stream_one(
    client: httpx.AsyncClient, base: str, prompt: list[int], record: Record, t0: float
) -> None:
    """One streaming completion, timed at the client into `record` as tokens arrive (`t0` is
    the perf_counter() at which it was sent)."""
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": record.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    first = False
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not first and chunk["choices"] and chunk["choices"][0].get("text") is not None:
                first = True
                record.ttft_s = time.perf_counter() - t0
            if chunk.get("usage"):
                record.output_tokens = chunk["usage"]["completion_tokens"]
    record.e2e_s = time.perf_counter() - t0
    record.ttft_s = record.ttft_s if first else record.e2e_s
    record.complete = True


@dataclass
class Phase:
    """What one run under one policy saw: every request, the /api/metrics samples, and the
    server's step profile (mean step time by phase) over its last steps."""

    records: list[Record] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    step_profile: dict = field(default_factory=dict)


async def drive(
    base: str, tenants: tuple[Tenant, ...], seconds: float, seed: int, poll_s: float,
    metrics_urls: list[str] | None = None,
) -> Phase:  # fmt: skip
    """Run every tenant's streams for `seconds` while sampling /api/metrics every `poll_s`;
    requests still in flight at the end are cut off (the server aborts them). With
    `metrics_urls` (each replica's /api/metrics), a sample sums the replicas' tenants."""
    rng = random.Random(seed)
    phase = Phase()
    records, samples = phase.records, phase.samples
    start = time.perf_counter()
    deadline = start + seconds

    async def user(client: httpx.AsyncClient, tenant: Tenant, user_rng: random.Random) -> None:
        await asyncio.sleep(tenant.start_frac * seconds)
        while (sent := time.perf_counter()) < deadline:
            prompt = [
                user_rng.randrange(VOCAB_LOW, VOCAB_HIGH)
                for _ in range(user_rng.randint(*tenant.prompt_tokens))
            ]
            record = Record(
                tenant.name, sent - start, len(prompt), user_rng.randint(*tenant.max_tokens)
            )
            records.append(record)
            try:
                await asyncio.wait_for(
                    stream_one(client, base, prompt, record, sent), deadline - sent
                )
            except asyncio.TimeoutError:
                record.e2e_s = deadline - sent
                record.ttft_s = record.ttft_s or record.e2e_s

    async def poll(client: httpx.AsyncClient) -> None:
        urls = metrics_urls or [base + "/api/metrics"]
        while time.perf_counter() < deadline:
            snaps = [(await client.get(url)).json() for url in urls]
            sample = Sample(time.perf_counter() - start)
            for snap in snaps:
                for name, t in snap["scheduler"]["tenants"].items():
                    sample.service[name] = sample.service.get(name, 0.0) + t["service"]
                    queued = t["waiting"] + t["prefilling"]
                    sample.queued[name] = sample.queued.get(name, 0) + queued
            samples.append(sample)
            phase.step_profile = snaps[0]["step_profile"]
            await asyncio.sleep(poll_s)

    clients = {
        t.name: httpx.AsyncClient(
            timeout=None,
            headers={"Authorization": f"Bearer {t.key}"},
            limits=httpx.Limits(max_connections=t.streams + 2),
        )
        for t in tenants
    }
    async with httpx.AsyncClient(timeout=30) as metrics_client:
        try:
            jobs = [
                user(clients[t.name], t, random.Random(rng.random()))
                for t in tenants
                for _ in range(t.streams)
            ]
            await asyncio.gather(poll(metrics_client), *jobs)
        finally:
            for client in clients.values():
                await client.aclose()
    return phase


def backlogged_gap(samples: list[Sample], f: str, g: str) -> tuple[float, float]:
    """(largest |W_f(t1, t2) - W_g(t1, t2)|, seconds covered) over intervals in which both
    tenants had requests queued at every sample: continuously backlogged, as sampling sees it."""
    gap, covered = 0.0, 0.0
    stretch: list[Sample] = []
    for sample in [*samples, None]:
        if sample is not None and sample.queued.get(f, 0) and sample.queued.get(g, 0):
            stretch.append(sample)
            continue
        if len(stretch) >= 2:
            diff = [s.service.get(f, 0.0) - s.service.get(g, 0.0) for s in stretch]
            gap = max(gap, max(diff) - min(diff))
            covered += stretch[-1].t_s - stretch[0].t_s
        stretch = []
    return gap, covered


def service_series(
    samples: list[Sample], names: list[str], bucket_s: float, seconds: float
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted tokens served per second to each tenant, per `bucket_s` bucket (bucket mids)."""
    edges = [i * bucket_s for i in range(int(seconds / bucket_s) + 1)]

    def at(name: str, t: float) -> float:
        value = 0.0
        for sample in samples:
            if sample.t_s > t:
                break
            value = sample.service.get(name, 0.0)
        return value

    mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    series = {
        name: [(at(name, b) - at(name, a)) / bucket_s for a, b in itertools.pairwise(edges)]
        for name in names
    }
    return mids, series


def run_phase(
    log: Path, settings: dict[str, object], tenants: tuple[Tenant, ...], seconds: float,
    seed: int, poll_s: float,
) -> Phase:  # fmt: skip
    """Start a fresh server with `settings`, warm it up, and drive `tenants` for `seconds`."""
    with running_server(log, **settings) as base:
        warm = httpx.post(
            base + "/v1/completions",
            headers={"Authorization": "Bearer key-warmup"},
            json={"model": MODEL, "prompt": [VOCAB_LOW] * 32, "max_tokens": 4, "ignore_eos": True},
            timeout=120,
        )
        warm.raise_for_status()
        return asyncio.run(drive(base, tenants, seconds, seed, poll_s))


def server_settings(args: argparse.Namespace, policy: str) -> dict[str, object]:
    keys = ",".join(f"{t.name}:{t.key}" for t in TENANTS) + ",warmup:key-warmup"
    return {
        "SCHEDULING_POLICY": policy,
        "MAX_BATCH_SIZE": args.batch,
        "MAX_NUM_BATCHED_TOKENS": args.budget,
        "MAX_ACTIVE_KV_TOKENS": args.kv_tokens,
        "PREFIX_CACHING": "false",
        "VTC_INPUT_WEIGHT": args.w_input,
        "VTC_OUTPUT_WEIGHT": args.w_output,
        "API_KEYS": keys,
        # One OpenMP thread: on a shared 2-core machine, a 2-thread team stalls whenever another
        # job holds a core (measured under the same load: 1.5 s a step instead of 0.11 s), which
        # would drown the scheduling this eval is about in noise.
        "OMP_NUM_THREADS": args.threads,
    }


def paper_bound(args: argparse.Namespace) -> dict[str, float]:
    """2U, U = max(w_p * L_input, w_q * M) (the paper's §4 bound) for these tenants and settings:
    at most MAX_BATCH_SIZE sequences (and no more than there are streams) run, each holding at
    most its prompt and max_tokens."""
    l_input = max(t.prompt_tokens[1] for t in TENANTS)
    longest = max(t.prompt_tokens[1] + t.max_tokens[1] for t in TENANTS)
    running = min(args.batch, sum(t.streams for t in TENANTS))
    m = min(args.kv_tokens, running * longest)
    u = max(args.w_input * l_input, args.w_output * m)
    return {"L_input": l_input, "M": m, "U": u, "bound_2U": 2 * u}


def summarize_phase(records: list[Record], samples: list[Sample], names: list[str]) -> dict:
    """Per-tenant latency and service, and the largest gap between backlogged tenants; a
    tenant's `backlogged_share` is the share of samples in which it had prefill work queued."""
    tenants = {}
    for name in names:
        mine = [r for r in records if r.tenant == name]
        ttft = [r.ttft_s for r in mine]
        backlogged = sum(bool(s.queued.get(name, 0)) for s in samples)
        tenants[name] = {
            "requests": len(mine),
            "cut_off": sum(not r.complete for r in mine),
            "ttft_p50_s": round(pct(ttft, 50), 4),
            "ttft_p95_s": round(pct(ttft, 95), 4),
            "e2e_p50_s": round(pct([r.e2e_s for r in mine], 50), 4),
            "service": round(samples[-1].service.get(name, 0.0), 1) if samples else 0.0,
            "backlogged_share": round(backlogged / len(samples), 3) if samples else 0.0,
        }
    gaps = {}
    for i, f in enumerate(names):
        for g in names[i + 1 :]:
            gap, covered = backlogged_gap(samples, f, g)
            gaps[f"{f}/{g}"] = {"max_gap": round(gap, 1), "backlogged_s": round(covered, 1)}
    worst = max(gaps.items(), key=lambda item: item[1]["max_gap"])
    return {
        "tenants": tenants,
        "gaps": gaps,
        "max_service_gap": worst[1]["max_gap"],
        "max_gap_pair": worst[0],
    }


def markdown_table(summary: dict) -> str:
    """The table in docs/fairness.md: one row per policy."""
    solo = summary["solo_light_ttft_p95_s"]
    bound = summary["bound"]["bound_2U"]
    lines = [
        "| policy | light TTFT p95 | x solo | heavy TTFT p95 | late TTFT p95 | service heavy / "
        "light / late | max gap, backlogged (pair) | bound 2U |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| solo (light alone) | {solo:.3f} s | 1.00 | | | | | |",
    ]
    for policy in ("fcfs", "vtc"):
        p = summary[policy]
        t = p["tenants"]
        lines.append(
            f"| {policy} | {t['light']['ttft_p95_s']:.3f} s | {p['light_vs_solo']:.2f} | "
            f"{t['heavy']['ttft_p95_s']:.3f} s | {t['late']['ttft_p95_s']:.3f} s | "
            f"{t['heavy']['service']:,.0f} / {t['light']['service']:,.0f} / "
            f"{t['late']['service']:,.0f} | {p['max_service_gap']:,.0f} ({p['max_gap_pair']}) | "
            f"{bound:,.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="per policy")
    parser.add_argument("--solo-seconds", type=float, default=20.0)
    parser.add_argument("--fast", action="store_true", help="short runs, for the test suite")
    parser.add_argument("--batch", type=int, default=32, help="MAX_BATCH_SIZE")
    parser.add_argument("--budget", type=int, default=64, help="MAX_NUM_BATCHED_TOKENS")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="MAX_ACTIVE_KV_TOKENS")
    parser.add_argument("--w-input", type=float, default=1.0, help="VTC_INPUT_WEIGHT")
    parser.add_argument("--w-output", type=float, default=2.0, help="VTC_OUTPUT_WEIGHT")
    parser.add_argument("--bucket", type=float, default=2.0, help="seconds per plotted bucket")
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="the server's OMP_NUM_THREADS")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness_http.json")
    args = parser.parse_args(argv)
    if args.fast:
        args.seconds, args.solo_seconds, args.bucket = 16.0, 5.0, 1.0
    return args


def plot(path: Path, args: argparse.Namespace, summary: dict, series: dict) -> None:
    """Service per tenant over time under each policy (the paper's plot), and every light
    request's TTFT against the time it was sent, with the solo p95 and twice it."""
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    for ax, policy in zip(axes[:2], ("fcfs", "vtc"), strict=True):
        data = series[policy]
        for name, values in data["service_per_s"].items():
            ax.plot(data["t_s"], values, label=name)
        ax.set_title(f"{policy}: service per tenant")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel(f"weighted tokens/s ({args.w_input:g} x prompt + {args.w_output:g} x output)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    for policy, marker in (("fcfs", "x"), ("vtc", "o")):
        light = [r for r in series[policy]["records"] if r["tenant"] == "light"]
        ax.scatter([r["sent_s"] for r in light], [r["ttft_s"] for r in light], marker=marker,
                   label=f"{policy}: light request TTFT", s=18)  # fmt: skip
    solo = summary["solo_light_ttft_p95_s"]
    ax.axhline(solo, color="green", label=f"solo p95 {solo:.3f} s")
    ax.axhline(2 * solo, color="green", linestyle="--", label="2 x solo p95")
    ax.set_yscale("log")
    ax.set_title("light tenant: TTFT per request")
    ax.set_xlabel("sent at (seconds since start)")
    ax.set_ylabel("TTFT (s, log)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    """Solo, fcfs and vtc phases, each on a fresh server; writes JSON + PNG, returns the summary."""
    poll_s = 0.1
    names = [t.name for t in TENANTS]
    light = tuple(t for t in TENANTS if t.name == "light")

    def log(label: str) -> Path:
        return args.out.with_name(f"{args.out.stem}.{label}.server.log")

    solo = run_phase(
        log("solo"), server_settings(args, "vtc"), light, args.solo_seconds, args.seed, poll_s
    )
    solo_p95 = pct([r.ttft_s for r in solo.records], 95)
    summary: dict = {
        "solo_light_ttft_p95_s": round(solo_p95, 4),
        "solo_light_requests": len(solo.records),
        "solo_step_profile": solo.step_profile,
        "bound": paper_bound(args),
    }
    series = {}
    for policy in ("fcfs", "vtc"):
        ran = run_phase(
            log(policy), server_settings(args, policy), TENANTS, args.seconds, args.seed, poll_s
        )
        records, samples = ran.records, ran.samples
        phase = summarize_phase(records, samples, names)
        phase["step_profile"] = ran.step_profile
        phase["light_vs_solo"] = round(phase["tenants"]["light"]["ttft_p95_s"] / solo_p95, 2)
        phase["gap_within_bound"] = phase["max_service_gap"] <= summary["bound"]["bound_2U"]
        summary[policy] = phase
        mids, per_tenant = service_series(samples, names, args.bucket, args.seconds)
        series[policy] = {
            "t_s": mids,
            "service_per_s": per_tenant,
            "records": [asdict(r) for r in records],
        }
    summary["table"] = markdown_table(summary)
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "tenants": [asdict(t) for t in TENANTS],
        "settings": server_settings(args, "<policy>"),
        "summary": summary,
        "series": series,
    }
    path = write_results(args.out.stem, payload, args.out)
    plot(path.with_suffix(".png"), args, summary, series)
    return summary


def main() -> None:
    args = parse_args()
    summary = run(args)
    print(summary["table"])
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
