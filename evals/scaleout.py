"""Scale-out on Ray Serve (deploy/ray_serve.py): `python -m app serve --replicas N` started in a
subprocess, driven through Ray Serve's HTTP proxy.

(a) Throughput: evals.harness's closed-loop sweep (N streaming users, distinct prompts of
    `--prompt-words` words, `--output-tokens` tokens, EOS ignored) against 2 replicas with half
    the machine's cores each and, but for --fast, 1 replica with all of them and with half.
(b) Cache affinity: several users chat at once, each turn resending the whole history with no
    session id (so prefix routing alone keeps a conversation together), under the affinity
    router and under Ray Serve's default power-of-two-choices router. The prefix-hit rate is
    sum(cached_tokens) / sum(prompt_tokens) over every turn after the first; the history-hit
    rate divides by the history instead (the last turn's prompt and reply), the most a turn can
    hit.
(c) Fairness across 2 replicas: evals.fairness_http's tenants (heavy, light, late; API keys)
    and settings, VTC with counters shared across replicas (and, but for --fast, each
    replica's own alone); service and queues are the sums of the replicas' /api/metrics, and
    the gap is the largest service difference between two continuously backlogged tenants.

    python -m evals.scaleout [--fast] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import httpx

from evals import fairness_http
from evals.harness import (
    RESULTS,
    closed_loop,
    make_prompt,
    running_process,
    summarize,
    write_results,
)
from evals.plots import plt

MODEL = "gemma-3-270m"
# Ports below this are left to others: Ray gives its workers 10002-19999 by default.
_LOWEST_PORT = 20_000


def free_port_run(count: int) -> int:
    """A free port p such that p + 1 ... p + count - 1 are free too (the replicas' ops ports),
    drawn below the kernel's ephemeral port range. The replicas bind their ports many seconds
    after this check, and meanwhile Ray's own outgoing connections take source ports from that
    range: one of them landed on a replica's ops port once, and the replica never served."""
    top = _ephemeral_ports_start() - count
    if top <= _LOWEST_PORT:  # an ephemeral range starting this low leaves nowhere else to draw
        top = 65536 - count
    rng = random.Random()
    while True:
        port = rng.randrange(_LOWEST_PORT, top)
        if all(_bindable(port + offset) for offset in range(count)):
            return port


def _ephemeral_ports_start() -> int:
    """The first port the kernel hands out as a connection's source port (Linux's default
    32768 where it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextmanager
def running_replicas(
    log_path: Path, replicas: int, *flags: str, **settings: object
) -> Iterator[tuple[str, list[str]]]:
    """`python -m app serve --replicas N` with `settings` as env vars; yields the shared base
    URL and each replica's ops URL once every replica is ready."""
    port = free_port_run(replicas + 1)
    env = dict(os.environ, LOG_FORMAT="json", **{k: str(v) for k, v in settings.items()})
    command = [
        sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--replicas", str(replicas), "--ops-port", str(port + 1), *flags,
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    ops = [f"http://127.0.0.1:{port + 1 + r}" for r in range(replicas)]
    # SIGINT to the group, as Ctrl-C sends it: on SIGTERM a Ray instance's GCS and raylet die
    # at once, and the server's Serve shutdown then waits 30 s for them.
    with running_process(command, log_path, base + "/health", env, signal.SIGINT):
        deadline = time.monotonic() + 300
        while not all(_ready(url) for url in ops):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not ready; see {log_path}")
            time.sleep(0.5)
        yield base, ops


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------- (a) throughput


def sweep(base: str, users: list[int], args: argparse.Namespace, seed: int) -> dict[int, dict]:
    rng = random.Random(seed)
    rows = {}
    asyncio.run(closed_loop(base, [make_prompt(rng, 16) for _ in range(4)], 4, 4))  # warm-up
    for n in users:
        prompts = [make_prompt(rng, args.prompt_words) for _ in range(n * args.requests_per_user)]
        timings, elapsed = asyncio.run(closed_loop(base, prompts, n, args.output_tokens))
        rows[n] = summarize(timings, elapsed)
        print(f"  N={n}: {rows[n]}", flush=True)
    return rows


# ---------------------------------------------------------------- (b) cache affinity


async def chat_workload(base: str, users: int, turns: int, max_tokens: int, seed: int) -> dict:
    """Every user's conversation, turn by turn. Per turn, summed over users: the tokens
    prompted, those served from the cache, and the history (the last turn's prompt and reply:
    what a cache that kept the conversation could serve, to a block)."""
    rng = random.Random(seed)
    openings = [make_prompt(rng, 48) for _ in range(users)]
    questions = [[make_prompt(rng, 12) for _ in range(turns)] for _ in range(users)]
    prompted, cached, history = [0] * turns, [0] * turns, [0] * turns

    async def user(client: httpx.AsyncClient, u: int) -> None:
        messages = [{"role": "system", "content": openings[u]}]
        last = 0
        for turn in range(turns):
            messages.append({"role": "user", "content": questions[u][turn]})
            body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            reply = (await client.post(base + "/v1/chat/completions", json=body)).json()
            usage = reply["usage"]
            prompted[turn] += usage["prompt_tokens"]
            cached[turn] += usage["prompt_tokens_details"]["cached_tokens"]
            history[turn] += last
            last = usage["prompt_tokens"] + usage["completion_tokens"]
            messages.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            )

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(user(client, u) for u in range(users)))
    later = range(1, turns)
    return {
        "prompt_tokens_per_turn": prompted,
        "cached_tokens_per_turn": cached,
        "history_tokens_per_turn": history,
        "hit_rate_per_turn": [round(cached[t] / prompted[t], 4) for t in range(turns)],
        "hit_rate": round(sum(cached[t] for t in later) / sum(prompted[t] for t in later), 4),
        "history_hit_rate": round(
            sum(cached[t] for t in later) / sum(history[t] for t in later), 4
        ),
    }


# ---------------------------------------------------------------- (c) fairness


def fairness_phase(log: Path, fair: argparse.Namespace, fairness: str) -> dict:
    """evals.fairness_http's tenants for `fair.seconds` against 2 fresh replicas."""
    settings = fairness_http.server_settings(fair, "vtc")
    with running_replicas(log, 2, "--fairness", fairness, **settings) as (base, ops):
        warm = {"model": MODEL, "prompt": [1000] * 32, "max_tokens": 4, "ignore_eos": True}

        async def warm_up() -> None:  # two at once: one per replica
            async with httpx.AsyncClient(timeout=120) as client:
                headers = {"Authorization": "Bearer key-warmup"}
                await asyncio.gather(
                    *(
                        client.post(base + "/v1/completions", json=warm, headers=headers)
                        for _ in "ab"
                    )
                )

        asyncio.run(warm_up())
        phase = asyncio.run(
            fairness_http.drive(
                base, fairness_http.TENANTS, fair.seconds, fair.seed, 0.1,
                metrics_urls=[url + "/api/metrics" for url in ops],
            )
        )  # fmt: skip
    names = [t.name for t in fairness_http.TENANTS]
    summary = fairness_http.summarize_phase(phase.records, phase.samples, names)
    mids, per_tenant = fairness_http.service_series(phase.samples, names, fair.bucket, fair.seconds)
    summary["series"] = {"t_s": mids, "service_per_s": per_tenant}
    return summary


# ---------------------------------------------------------------- the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a short run, for the test suite")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-user", type=int, default=1)
    parser.add_argument("--prompt-words", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--chat-users", type=int, default=8)
    parser.add_argument("--chat-turns", type=int, default=6)
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--fair-seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "scaleout.json")
    args = parser.parse_args(argv)
    if args.fast:
        args.users, args.requests_per_user, args.output_tokens = [4], 1, 16
        args.chat_users, args.chat_turns, args.chat_tokens = 4, 3, 8
        args.fair_seconds = 16.0
    return args


def run(args: argparse.Namespace) -> dict:
    """All three parts; writes the JSON and the PNG, returns the summary."""
    logs = args.out.with_suffix("")
    settings = {"MAX_BATCH_SIZE": 32, "MAX_ACTIVE_KV_TOKENS": 16384}
    summary: dict = {"throughput": {}, "affinity": {}, "fairness": {}}
    chat = (args.chat_users, args.chat_turns, args.chat_tokens, args.seed)
    # One replica with all the cores, and with half: what replication adds beside what the
    # thread count does. --fast measures only the replicated side, to keep the suite short.
    cores = os.cpu_count() or 1
    for cpus in () if args.fast else (cores, cores / 2):
        name = f"1 replica, {cpus:g} CPU"
        print(f"(a) {name}", flush=True)
        log = Path(f"{logs}.1-replica-{cpus:g}-cpu.log")
        with running_replicas(log, 1, "--replica-cpus", str(cpus), **settings) as (base, _):
            summary["throughput"][name] = sweep(base, args.users, args, args.seed)
    for router in ("affinity", "power_of_two"):
        print(f"(a, b) 2 replicas, {router} router", flush=True)
        log = Path(f"{logs}.2-replicas-{router}.log")
        with running_replicas(log, 2, "--router", router, **settings) as (base, _):
            if router == "affinity":
                summary["throughput"][f"2 replicas, {cores / 2:g} CPU each"] = sweep(
                    base, args.users, args, args.seed
                )
            summary["affinity"][router] = asyncio.run(chat_workload(base, *chat))
            print(f"  chat: {summary['affinity'][router]}", flush=True)
    fair = fairness_http.parse_args(["--seconds", str(args.fair_seconds), "--bucket", "1"])
    summary["fairness"]["bound"] = fairness_http.paper_bound(fair)
    for fairness in ("shared",) if args.fast else ("shared", "local"):
        print(f"(c) fairness, {fairness} counters", flush=True)
        phase = fairness_phase(Path(f"{logs}.fairness-{fairness}.log"), fair, fairness)
        summary["fairness"][fairness] = phase
        print(f"  max gap {phase['max_service_gap']} ({phase['max_gap_pair']})", flush=True)
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "settings": settings,
        "fairness_settings": fairness_http.server_settings(fair, "vtc"),
        "tenants": [asdict(t) for t in fairness_http.TENANTS],
        "summary": summary,
    }
    path = write_results(args.out.stem, payload, args.out)
    plot(path.with_suffix(".png"), args, summary)
    return summary


def plot(path: Path, args: argparse.Namespace, summary: dict) -> None:
    """Throughput per N; prefix-hit rate per turn by router; service per tenant over time."""
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    ax = axes[0]
    for name, rows in summary["throughput"].items():
        ax.plot(args.users, [rows[n]["throughput_tok_s"] for n in args.users], marker="o",
                label=name)  # fmt: skip
    ax.set(title="(a) closed loop", xlabel="concurrent users", ylabel="output tokens/s")
    ax = axes[1]
    for router, result in summary["affinity"].items():
        turns = range(1, len(result["hit_rate_per_turn"]) + 1)
        ax.plot(turns, result["hit_rate_per_turn"], marker="o",
                label=f"{router}: {result['hit_rate']:.0%} of prompts, "
                      f"{result['history_hit_rate']:.0%} of history")  # fmt: skip
    ax.set_xticks(range(1, args.chat_turns + 1))
    ax.set(title="(b) multi-turn chat, no session id", xlabel="turn",
           ylabel="cached / prompt tokens", ylim=(0, 1.05))  # fmt: skip
    ax = axes[2]
    shared = summary["fairness"]["shared"]
    for name, values in shared["series"]["service_per_s"].items():
        ax.plot(shared["series"]["t_s"], values, label=name)
    ax.set(title=f"(c) 2 replicas, shared VTC: max gap {shared['max_service_gap']:,.0f}",
           xlabel="seconds since start", ylabel="weighted tokens/s, both replicas")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    summary = run(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "fairness"}, indent=1))
    for name, phase in summary["fairness"].items():
        if name != "bound":
            print(name, phase["max_service_gap"], phase["max_gap_pair"], phase["gaps"])
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
