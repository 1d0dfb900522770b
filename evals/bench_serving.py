"""Closed-loop serving sweep: N concurrent streaming users, each sending distinct prompts of
`--prompt-tokens` tokens for `--output-tokens` tokens (EOS ignored), against the real server
over HTTP; and naive transformers serving the same prompts one request at a time, in one run.

Naive serving is measured, not guessed: each request's `generate` is timed (prefill alone and
the whole request). One-at-a-time service gives every N the same throughput; its TTFT under N
closed-loop users is the queueing of a single server: a request waits for the N-1 requests ahead
of it, then its own prefill.

    python -m evals.bench_serving [--users 1 4 16 32] [--requests-per-user 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random

from engine.model.loader import load_model
from evals.harness import (
    RESULTS,
    closed_loop,
    hf_reference_model,
    pct,
    running_server,
    summarize,
    time_generate,
    token_prompt,
    write_results,
)
from evals.plots import line_chart


def naive_service_times(loaded, prompts: list[list[int]], output_tokens: int) -> dict:
    model = hf_reference_model(loaded)
    time_generate(model, prompts[0], 2)  # warm-up
    prefill = [time_generate(model, p, 1) for p in prompts]
    service = [time_generate(model, p, output_tokens) for p in prompts]
    return {"prefill_s": prefill, "service_s": service}


def naive_at(users: int, times: dict, output_tokens: int) -> dict:
    service = sum(times["service_s"]) / len(times["service_s"])
    prefill = sum(times["prefill_s"]) / len(times["prefill_s"])
    tpot = [
        (s - p) / (output_tokens - 1)
        for s, p in zip(times["service_s"], times["prefill_s"], strict=True)
    ]
    # Closed loop, one server: in steady state every request queues behind the other N-1.
    ttft = [(users - 1) * service + p for p in times["prefill_s"]]
    return {
        "throughput_tok_s": round(output_tokens / service, 2),
        "ttft_p50_s": round(pct(ttft, 50), 4),
        "ttft_p95_s": round(pct(ttft, 95), 4),
        "tpot_p50_s": round(pct(tpot, 50), 4),
        "tpot_p95_s": round(pct(tpot, 95), 4),
        "service_s_mean": round(service, 3),
        "prefill_s_mean": round(prefill, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests-per-user", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--naive-requests", type=int, default=4)
    args = parser.parse_args()

    loaded = load_model()
    rng = random.Random(1)
    total = sum(n * args.requests_per_user for n in args.users) + 8
    prompts = [token_prompt(loaded.tokenizer, rng, args.prompt_tokens) for _ in range(total)]

    engine_rows: dict[int, dict] = {}
    settings = {"MAX_BATCH_SIZE": max(args.users), "MAX_ACTIVE_KV_TOKENS": 65536}
    with running_server(RESULTS / "bench_serving.server.log", **settings) as base:
        used = 0
        asyncio.run(closed_loop(base, prompts[:4], 4, 8))  # warm-up
        used += 4
        for users in args.users:
            batch = prompts[used : used + users * args.requests_per_user]
            used += len(batch)
            timings, elapsed = asyncio.run(closed_loop(base, batch, users, args.output_tokens))
            engine_rows[users] = summarize(timings, elapsed)
            print(f"engine N={users:3d}: {engine_rows[users]}")

    times = naive_service_times(loaded, prompts[-args.naive_requests :], args.output_tokens)
    naive_rows = {n: naive_at(n, times, args.output_tokens) for n in args.users}
    for users in args.users:
        speedup = engine_rows[users]["throughput_tok_s"] / naive_rows[users]["throughput_tok_s"]
        engine_rows[users]["speedup_vs_naive"] = round(speedup, 2)
        print(f"naive  N={users:3d}: {naive_rows[users]}  -> engine {speedup:.1f}x")

    path = write_results(
        "bench_serving",
        {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
         "requests_per_user": args.requests_per_user, "dtype": "float32",
         "engine": engine_rows, "naive_transformers": naive_rows, "naive_raw": times},
    )  # fmt: skip
    line_chart(
        path.with_suffix(".png"),
        f"Closed-loop throughput ({args.prompt_tokens}-token prompts, {args.output_tokens} out)",
        args.users,
        {
            "this engine": [engine_rows[n]["throughput_tok_s"] for n in args.users],
            "naive transformers": [naive_rows[n]["throughput_tok_s"] for n in args.users],
        },
        "concurrent users",
        "output tokens/s",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
