"""Open-loop overload: Poisson arrivals at twice the measured capacity, for minutes, with nothing
lost that the server accepted.

1. Capacity: `--concurrency` closed-loop users send the request mix below (nobody hangs up);
   completed requests per second is the capacity.
2. Soak: requests arrive as a Poisson process at `--overload` x capacity for `--minutes`. The
   mix: completions and chat; SSE, plain JSON and the WebSocket; `n` of 1-3; prompts of 16-256
   tokens and max_tokens of 1-64 (EOS ignored); 5% of the clients hang up abruptly, half
   mid-prefill and half after 1-4 streamed tokens. Nobody retries a refusal.
3. Drain: every request sent finishes; then the server must be back where it started.

Reported: accepted vs refused (429 with Retry-After) vs failed; every accepted request either
completed whole or was aborted by its own client ("lost" counts the others); 5xx responses; KV
blocks in use, the waiting queue and the server's RSS each second; after the drain, blocks in
use against the idle baseline and RSS against its value before the soak.

    python -m evals.soak [--minutes 10] [--fast]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from evals.clients import Outcome, http_request, request_body, settled_metrics, ws_request
from evals.harness import RESULTS, rss_bytes, running_server_process, write_results
from evals.plots import plt

SOAK_SETTINGS = {
    # The soak's own clients take a core; a two-thread OpenMP team sharing the other with them
    # stalls at every barrier (measured: 14x slower), which would measure the stall.
    "OMP_NUM_THREADS": 1,
}
HANG_UP_SHARE = 0.05


@dataclass
class Sample:
    t_s: float
    blocks_in_use: int  # primary (full-attention) group
    waiting: int
    running: int
    rss_mb: float


def random_request(rng: random.Random, hang_ups: bool) -> tuple[str, str, dict, int | None]:
    """(transport, endpoint, body, hang_up_after) of one request of the mix."""
    transport = rng.choice(("sse", "http", "ws"))
    endpoint = rng.choice(("completions", "chat"))
    prompt = [rng.randrange(1000, 200_000) for _ in range(rng.randint(16, 256))]
    body = request_body(endpoint, prompt, rng.randint(1, 64), n=rng.choice((1, 1, 1, 2, 3)))
    hang_up_after = None
    if hang_ups and transport != "http" and rng.random() < HANG_UP_SHARE / (2 / 3):
        hang_up_after = 0 if rng.random() < 0.5 else rng.randint(1, 4)
    return transport, endpoint, body, hang_up_after


async def send(
    client: httpx.AsyncClient, base: str, request: tuple[str, str, dict, int | None]
) -> Outcome:
    transport, endpoint, body, hang_up_after = request
    if transport == "ws":
        return await ws_request(base, endpoint, body, hang_up_after)
    return await http_request(client, endpoint, body, transport == "sse", hang_up_after)


async def measure_capacity(
    client: httpx.AsyncClient, base: str, seconds: float, concurrency: int, rng: random.Random
) -> float:
    """Completed requests per second of the mix, `concurrency` users back to back."""
    deadline = time.perf_counter() + seconds
    done = 0

    async def user() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            outcome = await send(client, base, random_request(rng, hang_ups=False))
            done += outcome.kind == "completed"

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def engine_state(snapshot: dict) -> tuple[int, int, int]:
    """(blocks in use in the primary group, waiting, running) of an /api/metrics snapshot."""
    primary = next(iter(snapshot["kv"]["groups"].values()))
    sched = snapshot["scheduler"]
    return primary["in_use"], sched["num_waiting"], sched["num_running"]


async def soak(base: str, pid: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        capacity = await measure_capacity(client, base, args.capacity_s, args.concurrency, rng)
        await asyncio.sleep(1.0)  # the engine idles: its heap is trimmed
        baseline_blocks, _, _ = engine_state(await settled_metrics(client))
        baseline_rss = rss_bytes(pid)
        rate = args.overload * capacity
        samples: list[Sample] = []
        outcomes: list[Outcome] = []
        start = time.perf_counter()
        stop = start + 60 * args.minutes

        async def sampler() -> None:
            while True:
                blocks, waiting, running = engine_state((await client.get("/api/metrics")).json())
                t_s = time.perf_counter() - start
                samples.append(Sample(t_s, blocks, waiting, running, rss_bytes(pid) / 2**20))
                await asyncio.sleep(1.0)

        async def one(request: tuple[str, str, dict, int | None]) -> None:
            outcomes.append(await send(client, base, request))

        sampling = asyncio.create_task(sampler())
        tasks = []
        while (now := time.perf_counter()) < stop:
            tasks.append(asyncio.create_task(one(random_request(rng, hang_ups=True))))
            await asyncio.sleep(min(rng.expovariate(rate), max(stop - now, 0)))
        await asyncio.gather(*tasks)
        drained_s = time.perf_counter() - stop
        final = engine_state(await settled_metrics(client))
        final_blocks, final_waiting, final_running = final
        await asyncio.sleep(1.0)
        final_rss = rss_bytes(pid)
        sampling.cancel()
        healthy = (await client.get("/health")).status_code == 200
    return summarize(
        outcomes, samples, capacity, rate, drained_s,
        baseline=(baseline_blocks, baseline_rss),
        final=(final_blocks, final_waiting, final_running, final_rss),
        healthy=healthy,
    )  # fmt: skip


def summarize(
    outcomes: list[Outcome], samples: list[Sample], capacity: float, rate: float,
    drained_s: float, baseline: tuple[int, int], final: tuple[int, int, int, int], healthy: bool,
) -> dict:  # fmt: skip
    kinds = Counter(o.kind for o in outcomes)
    accepted = len(outcomes) - kinds["refused"] - kinds["client_error"]
    baseline_blocks, baseline_rss = baseline
    final_blocks, final_waiting, final_running, final_rss = final
    return {
        "capacity_req_s": round(capacity, 2),
        "arrival_rate_req_s": round(rate, 2),
        "sent": len(outcomes),
        "outcomes": dict(sorted(kinds.items())),
        "by_transport": dict(sorted(Counter(f"{o.transport}:{o.kind}" for o in outcomes).items())),
        "accepted": accepted,
        "completed": kinds["completed"],
        "aborted_by_client": kinds["aborted"],
        "refused_429": kinds["refused"],
        "failed": kinds["server_error"] + kinds["lost"] + kinds["client_error"],
        "lost_accepted": kinds["lost"],
        "responses_5xx": kinds["server_error"] + sum(o.status >= 500 for o in outcomes),
        "failures": [asdict(o) for o in outcomes if o.kind in ("lost", "server_error")][:20],
        "drain_s": round(drained_s, 1),
        "peak_blocks_in_use": max((s.blocks_in_use for s in samples), default=0),
        "peak_waiting": max((s.waiting for s in samples), default=0),
        "blocks_in_use_baseline": baseline_blocks,
        "blocks_in_use_after": final_blocks,
        "left_running_or_waiting": final_running + final_waiting,
        "rss_mb_before": round(baseline_rss / 2**20, 1),
        "rss_mb_after": round(final_rss / 2**20, 1),
        "rss_change": round(final_rss / baseline_rss - 1, 4),
        "healthy_after": healthy,
        "samples": [asdict(s) for s in samples],
    }


def verdict(summary: dict) -> dict[str, bool]:
    """The soak's pass conditions."""
    return {
        "no_5xx": summary["responses_5xx"] == 0,
        "nothing_lost": summary["lost_accepted"] == 0,
        "every_accepted_completed_or_aborted_by_its_client": summary["accepted"]
        == summary["completed"] + summary["aborted_by_client"],
        "kv_back_to_baseline": summary["blocks_in_use_after"] == summary["blocks_in_use_baseline"]
        and summary["left_running_or_waiting"] == 0,
        "rss_within_5_percent": abs(summary["rss_change"]) <= 0.05,
        "healthy_after": summary["healthy_after"],
    }


def plot(path: Path, summary: dict, minutes: float) -> None:
    samples = summary["samples"]
    t = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    ax = axes[0]
    ax.plot(t, [s["blocks_in_use"] for s in samples], label="KV blocks in use (full attention)")
    ax.plot(t, [s["running"] for s in samples], label="running")
    ax.plot(t, [s["waiting"] for s in samples], label="waiting")
    ax.axhline(summary["blocks_in_use_baseline"], color="grey", linestyle=":", label="idle")
    ax.set_title(f"{summary['arrival_rate_req_s']:.1f} req/s offered, {minutes:g} min")
    ax.set_xlabel("seconds since the soak began")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    ax.plot(t, [s["rss_mb"] for s in samples], label="server RSS")
    ax.axhline(summary["rss_mb_before"], color="grey", linestyle=":", label="before")
    ax.axhline(summary["rss_mb_before"] * 1.05, color="red", linestyle="--", label="+5%")
    ax.set_ylabel("MiB")
    ax.set_xlabel("seconds since the soak began")
    ax.set_title(f"RSS after the drain: {summary['rss_mb_after']:.0f} MiB")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[2]
    outcomes = summary["outcomes"]
    ax.bar(list(outcomes), list(outcomes.values()))
    ax.set_title(f"{summary['sent']} requests: outcomes")
    for i, value in enumerate(outcomes.values()):
        ax.text(i, value, str(value), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--capacity-s", type=float, default=30.0, help="capacity measurement")
    parser.add_argument("--concurrency", type=int, default=32, help="capacity users")
    parser.add_argument("--overload", type=float, default=2.0, help="arrival rate x capacity")
    # A short queue keeps the drain to seconds once arrivals stop, and fills in a short run.
    parser.add_argument("--queue", type=int, default=64, help="MAX_QUEUE_LEN")
    parser.add_argument("--fast", action="store_true", help="a 60 s soak, for the test suite")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args(argv)
    if args.fast:
        args.minutes, args.capacity_s, args.queue = 1.0, 15.0, 16
    return args


def run(args: argparse.Namespace) -> dict:
    log = args.out.with_name(f"{args.out.stem}.server.log")
    settings = SOAK_SETTINGS | {"MAX_QUEUE_LEN": args.queue}
    with running_server_process(log, **settings) as (base, process):
        summary = asyncio.run(soak(base, process.pid, args))
    summary["verdict"] = verdict(summary)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "settings": settings}
    path = write_results("soak", payload | {"summary": summary}, args.out)
    plot(path.with_suffix(".png"), summary, args.minutes)
    return summary


def main() -> None:
    summary = run(parse_args())
    for key, value in summary.items():
        if key not in ("samples", "failures"):
            print(f"{key}: {value}")
    for failure in summary["failures"]:
        print("failure:", failure)


if __name__ == "__main__":
    main()
