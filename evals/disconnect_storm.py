"""A disconnect storm: clients hang up abruptly, half over SSE and half over the WebSocket, some
while their prompt is being prefilled and some while tokens stream back. Afterwards the server
must hold exactly what it held before: the same free KV blocks and no sequence left.

Each client sends one request and drops its connection (SSE: closes the socket unread; WS:
aborts the TCP connection without a close frame) either at once (mid-prefill: a prompt of
several prefill chunks) or after 1-8 streamed tokens (mid-decode). `--concurrency` clients are
in flight at a time.

    python -m evals.disconnect_storm [--disconnects 1000] [--fast]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from evals.clients import Outcome, http_request, request_body, settled_metrics, ws_request
from evals.harness import RESULTS, running_server, write_results

PREFILL_PROMPT_TOKENS = 600  # several 256-token prefill chunks: a hang-up lands mid-prefill
DECODE_PROMPT_TOKENS = 24
STORM_SETTINGS = {
    "MAX_NUM_BATCHED_TOKENS": 256,
    # The storm's clients take a core; a two-thread OpenMP team sharing the other with them
    # stalls at every barrier.
    "OMP_NUM_THREADS": 1,
}


def kv_state(snapshot: dict) -> dict:
    kv, sched = snapshot["kv"], snapshot["scheduler"]
    return {
        # Blocks held by anyone (cached-only blocks are free for new work).
        "blocks_in_use": {name: group["in_use"] for name, group in kv["groups"].items()},
        "sequences": kv["num_sequences"],
        "running": sched["num_running"],
        "waiting": sched["num_waiting"],
        "aborted": sched["num_aborted"],
    }


async def one_disconnect(
    client: httpx.AsyncClient, base: str, rng: random.Random, index: int
) -> Outcome:
    """Client `index`: even ones over SSE, odd ones over the WebSocket; a random phase."""
    mid_prefill = rng.random() < 0.5
    length = PREFILL_PROMPT_TOKENS if mid_prefill else DECODE_PROMPT_TOKENS
    prompt = [rng.randrange(1000, 200_000) for _ in range(length)]
    hang_up_after = 0 if mid_prefill else rng.randint(1, 8)
    body = request_body("completions", prompt, max_tokens=64)
    if index % 2 == 0:
        return await http_request(client, "completions", body, True, hang_up_after)
    return await ws_request(base, "completions", body, hang_up_after)


async def storm(base: str, disconnects: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        warm = request_body("completions", [1000] * 8, max_tokens=2)
        await http_request(client, "completions", warm, stream=False)
        before = kv_state(await settled_metrics(client))
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(disconnects):
            queue.put_nowait(index)
        outcomes: list[Outcome] = []

        async def worker() -> None:
            while not queue.empty():
                outcomes.append(await one_disconnect(client, base, rng, queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        after = kv_state(await settled_metrics(client))
        healthy = (await client.get("/health")).status_code == 200
    kinds = Counter(f"{o.transport}:{o.kind}" for o in outcomes)
    return {
        "disconnects": disconnects,
        "elapsed_s": round(elapsed, 1),
        "outcomes": dict(sorted(kinds.items())),
        "before": before,
        "after": after,
        "aborted_by_server": after["aborted"] - before["aborted"],
        "blocks_restored": after["blocks_in_use"] == before["blocks_in_use"],
        "no_sequence_left": after["sequences"] == after["running"] == after["waiting"] == 0,
        "healthy": healthy,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disconnects", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--fast", action="store_true", help="100 disconnects, for the test suite")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "disconnect_storm.json")
    args = parser.parse_args(argv)
    if args.fast:
        args.disconnects = 100
    return args


def run(args: argparse.Namespace) -> dict:
    log = args.out.with_name(f"{args.out.stem}.server.log")
    with running_server(log, **STORM_SETTINGS) as base:
        summary = asyncio.run(storm(base, args.disconnects, args.concurrency, args.seed))
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    write_results("disconnect_storm", payload, args.out)
    return summary


def main() -> None:
    summary = run(parse_args())
    for key, value in summary.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
