"""Prefix sharing: time to first token of a ~1,000-token prompt the first time (cold) and when
the same prompt comes again (the prefix cache serves all but its last token), through the real
server; plus distinct questions behind one shared ~1,000-token system prompt.

    python -m evals.bench_prefix [--prompt-tokens 1000] [--prompts 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random

import httpx

from engine.model.loader import load_model
from evals.harness import (
    RESULTS,
    make_prompt,
    pct,
    running_server,
    stream_completion,
    token_prompt,
    write_results,
)
from evals.plots import bar_chart


async def measure(base: str, prompts: list[list[int]], shared: list[list[int]]) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        await stream_completion(client, base, prompts[0][:64], 2)  # warm-up
        cold, warm, cached = [], [], []
        for prompt in prompts:
            first = await stream_completion(client, base, prompt, 1)
            again = await stream_completion(client, base, prompt, 1)
            cold.append(first.ttft_s)
            warm.append(again.ttft_s)
            cached.append(again.cached_tokens)
        shared_ttft, shared_cached = [], []
        for prompt in shared:
            timing = await stream_completion(client, base, prompt, 1)
            shared_ttft.append(timing.ttft_s)
            shared_cached.append(timing.cached_tokens)
    return {
        "cold_ttft_p50_s": round(pct(cold, 50), 4),
        "repeat_ttft_p50_s": round(pct(warm, 50), 4),
        "repeat_speedup": round(pct(cold, 50) / pct(warm, 50), 1),
        "repeat_cached_tokens": cached,
        "shared_system_prompt_ttft_p50_s": round(pct(shared_ttft[1:], 50), 4),
        "shared_system_prompt_first_ttft_s": round(shared_ttft[0], 4),
        "shared_system_prompt_cached_tokens": shared_cached,
        "raw": {"cold": cold, "repeat": warm, "shared": shared_ttft},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()

    tokenizer = load_model().tokenizer
    rng = random.Random(2)
    prompts = [token_prompt(tokenizer, rng, args.prompt_tokens) for _ in range(args.prompts)]
    system = token_prompt(tokenizer, rng, args.prompt_tokens)
    shared = [
        system + tokenizer(" " + make_prompt(rng, 24)).input_ids[1:]
        for _ in range(args.prompts + 1)
    ]

    with running_server(RESULTS / "bench_prefix.server.log", MAX_NUM_BATCHED_TOKENS=2048) as base:
        result = asyncio.run(measure(base, prompts, shared))
    print(
        f"cold TTFT p50 {result['cold_ttft_p50_s']:.3f}s, "
        f"repeat {result['repeat_ttft_p50_s']:.3f}s -> {result['repeat_speedup']}x; "
        "shared system prompt TTFT p50 "
        f"{result['shared_system_prompt_ttft_p50_s']:.3f}s"
    )
    path = write_results("bench_prefix", {"prompt_tokens": args.prompt_tokens, **result})
    bar_chart(
        path.with_suffix(".png"),
        f"TTFT of a {args.prompt_tokens}-token prompt",
        {
            "cold": result["cold_ttft_p50_s"],
            "repeated prompt": result["repeat_ttft_p50_s"],
            "shared system prompt": result["shared_system_prompt_ttft_p50_s"],
        },
        "TTFT p50 (s)",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
