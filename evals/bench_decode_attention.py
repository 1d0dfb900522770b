"""Decode attention of one sequence, with every thread and with one (cpu_ops' kernel).

A decode step of one sequence has one (sequence, KV head) pair per layer in Gemma 3 270M. With
fewer pairs than threads, cpu_ops.paged_decode_attention shares each pair's keys, then its
output columns, between the threads (the same bits as one thread computes). This times one
call per layer through the model's 18 layers, each with its own bfloat16 pools, the keys in
blocks of 16 consecutive slots scattered over the pool as the paged cache holds a sequence, at
each `--keys` count: all threads against one, in shuffled turns
(evals.bench_kernels.median_ms_in_turns), median of the rounds.

    python -m evals.bench_decode_attention [--keys 128 256 512 1024 4096] [--rounds 50]

Results go to evals/results/bench_decode_attention.json.
"""

from __future__ import annotations

import argparse

import torch

from engine.model import cpu_ops
from evals.bench_kernels import HEAD_DIM, HEADS, KV_HEADS, LAYERS, Call, median_ms_in_turns
from evals.harness import write_results

BLOCK = 16  # tokens per KV block, the server's default KV_BLOCK_SIZE


def attention_call(
    pool: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, mask: torch.Tensor, threads: int
) -> Call:
    """paged_decode_attention of a query over `pool`'s keys and values, on `threads` threads."""
    key_pool, value_pool = pool

    def attend(query: torch.Tensor) -> torch.Tensor:
        torch.set_num_threads(threads)
        return cpu_ops.paged_decode_attention(
            query, key_pool, value_pool, slots, mask, HEAD_DIM**-0.5
        )

    return attend


def decode_attention_ms(keys_counts: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """Median ms per layer of one sequence's decode attention (HEADS query heads over KV_HEADS,
    bfloat16 pools, every layer its own) at each key count, with all threads and with one."""
    every = torch.get_num_threads()
    slots_total = 2 * max(keys_counts)
    pools = [
        (
            torch.randn(slots_total, KV_HEADS, HEAD_DIM).bfloat16(),
            torch.randn(slots_total, KV_HEADS, HEAD_DIM).bfloat16(),
        )
        for _ in range(LAYERS)
    ]
    ways = {f"{every} threads": every, "1 thread": 1}
    runs: dict[tuple[str, int], tuple[list[Call], torch.Tensor]] = {}
    for keys in keys_counts:
        # The sequence's blocks of BLOCK consecutive slots, scattered over the pool.
        blocks = torch.randperm(slots_total // BLOCK)[: -(-keys // BLOCK)]
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).view(1, -1)[:, :keys]
        mask = torch.zeros(1, keys, dtype=torch.bfloat16)
        for way, threads in ways.items():
            calls = [attention_call(pool, slots, mask, threads) for pool in pools]
            runs[way, keys] = (calls, torch.randn(1, HEADS, HEAD_DIM))
    try:
        median_ms = median_ms_in_turns(runs, rounds, seed=2)
    finally:
        torch.set_num_threads(every)
    return {way: {keys: median_ms[way, keys] for keys in keys_counts} for way in ways}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[128, 256, 512, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("cpu_ops is not built on this machine: nothing to time")
    torch.manual_seed(0)
    ms = decode_attention_ms(args.keys, args.rounds)
    head = ["", *(f"{keys} keys" for keys in args.keys)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(args.keys)]
    for way, by_keys in ms.items():
        lines.append(
            f"| {way}, us per layer | "
            + " | ".join(f"{v * 1000:.1f}" for v in by_keys.values())
            + " |"
        )
    markdown = "\n".join(lines)
    print(markdown)
    path = write_results(
        "bench_decode_attention",
        {
            "keys": args.keys,
            "rounds": args.rounds,
            "ms_per_layer": {way: {str(k): v for k, v in row.items()} for way, row in ms.items()},
            "markdown": markdown,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
