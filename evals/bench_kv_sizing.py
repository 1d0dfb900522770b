"""How many sequences of a given context length one KV memory budget holds at once, with every
cache group given the same number of blocks (the even split), against pools split by layer kind
at startup (engine.kv.sizing.blocks_per_group: sliding-window layers get a window for each of
MAX_BATCH_SIZE sequences, full attention the rest), and against one page pool the groups share
(engine.kv.sizing.shared_pages, what the engine runs).

The model's real cache groups in the real KVCacheManager, prefilling one sequence after another
in chunks as the scheduler does, until the next one no longer fits. What fits depends only on
block accounting, not on the numbers the forward computes, so no forward runs: that makes
hundreds of 2,048-token sequences cheap to measure. `--model embedded` (the default) is Gemma 3
270M: 3 full-attention layers and 15 sliding over 512 tokens, all of one K/V shape. `--model
gemma4` is transformers' default Gemma4TextConfig (its layer shapes only, no weights): 5
full-attention layers of 4 KV heads of 512 dims and 25 sliding ones of 4 of 256, so a page's
lanes are as wide as a full layer and two sliding layers share one.

    python -m evals.bench_kv_sizing [--model embedded|gemma4] [--kv-tokens 65536]
        [--max-seqs 32 64 128] [--contexts ...]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from tqdm import tqdm
from transformers import Gemma4TextConfig

from engine.kv.layout import CacheGroupSpec, SharedPages
from engine.kv.manager import KVCacheManager
from engine.kv.sizing import blocks_per_group, even_split, shared_pages
from engine.model.architecture import GemmaTextConfig, architecture_from_config
from engine.model.kv_cache import cache_group_specs
from engine.model.loader import load_model
from engine.request import Sequence
from engine.sampling import SamplingParams
from evals.harness import write_results
from evals.plots import line_chart


def sequences_held(
    groups: list[CacheGroupSpec],
    sizes: dict[str, int] | SharedPages,
    context: int,
    max_seqs: int,
    args: argparse.Namespace,
) -> int:
    """How many sequences of `context` tokens the KV manager holds at once: sequence after
    sequence is prefilled in chunks of `args.chunk` tokens (allocate, then commit, which frees
    blocks that left a sliding window), as the scheduler does, until one no longer fits."""
    kv = KVCacheManager(groups, sizes, args.block_size, enable_prefix_caching=False)
    tokens = itertools.count(1000)  # distinct prompts
    held = 0
    while held < max_seqs:
        seq = Sequence([next(tokens) for _ in range(context)], SamplingParams(max_tokens=1))
        kv.match_prefix(seq)
        while seq.num_computed_tokens < context:
            chunk = min(args.chunk, context - seq.num_computed_tokens)
            if not kv.allocate(seq, chunk):
                return held
            seq.num_computed_tokens += chunk
            kv.commit(seq)
        held += 1
    return held


def upper_bound(groups: list[CacheGroupSpec], budget_bytes: int, context: int, max_seqs: int):
    """Sequences whose context the budget holds with no block wasted: full layers keep the whole
    context, sliding ones a window, capped at max_seqs."""
    per_seq = sum(
        g.bytes_per_token
        * (context if g.sliding_window is None else min(context, g.sliding_window))
        for g in groups
    )
    return min(max_seqs, budget_bytes // per_seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["embedded", "gemma4"], default="embedded")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="MAX_ACTIVE_KV_TOKENS")
    parser.add_argument(
        "--max-seqs", type=int, nargs="+", default=[32, 64, 128], help="MAX_BATCH_SIZE values"
    )
    parser.add_argument("--chunk", type=int, default=512, help="MAX_NUM_BATCHED_TOKENS")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    args = parser.parse_args()

    config = load_model().config if args.model == "embedded" else Gemma4TextConfig()
    assert isinstance(config, GemmaTextConfig)
    name = "bench_kv_sizing" + ("" if args.model == "embedded" else f"_{args.model}")
    groups = cache_group_specs(architecture_from_config(config), torch.float32)
    budget = args.kv_tokens * sum(g.bytes_per_token for g in groups)
    even = {g.name: even_split(groups, budget, args.block_size) for g in groups}
    pages = shared_pages(groups, budget, args.block_size, max(args.max_seqs), args.chunk)
    rows, blocks = [], {"even split": even, "shared pages": vars(pages)}
    for max_seqs in tqdm(args.max_seqs, desc="batch sizes"):
        sized = blocks_per_group(groups, budget, args.block_size, max_seqs, args.chunk)
        blocks[f"split by layer kind, batch {max_seqs}"] = sized
        for context in args.contexts:
            row = {
                "max_seqs": max_seqs,
                "context": context,
                "even split": sequences_held(groups, even, context, max_seqs, args),
                "split by layer kind": sequences_held(groups, sized, context, max_seqs, args),
                "shared pages": sequences_held(groups, pages, context, max_seqs, args),
                "upper bound": upper_bound(groups, budget, context, max_seqs),
            }
            row["ratio"] = round(row["shared pages"] / max(row["even split"], 1), 2)
            rows.append(row)
    lines = [
        "| batch | context | even split | split by layer kind | shared pages | gain "
        "| no-waste bound |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['max_seqs']} | {r['context']} | {r['even split']} "
            f"| {r['split by layer kind']} | {r['shared pages']} | {r['ratio']}x "
            f"| {r['upper bound']} |"
            for r in rows
        ),
    ]
    table = "\n".join(lines)
    print(table)
    path = write_results(
        name,
        {
            "model": args.model,
            "kv_tokens": args.kv_tokens, "budget_bytes": budget, "chunk": args.chunk,
            "block_size": args.block_size,
            "groups": {g.name: {"bytes_per_token": g.bytes_per_token,
                                "window": g.sliding_window} for g in groups},
            "blocks": blocks, "rows": rows, "markdown": table,
        },
    )  # fmt: skip
    largest = max(args.max_seqs)
    last = [r for r in rows if r["max_seqs"] == largest]
    series = {
        f"{kind}, batch {largest}": [float(r[kind]) for r in last]
        for kind in ("even split", "split by layer kind", "shared pages")
    }
    series[f"no-waste bound, batch {largest}"] = [float(r["upper bound"]) for r in last]
    line_chart(
        path.with_suffix(".png"),
        f"Sequences held at once in {args.kv_tokens} tokens of KV memory ({args.model})",
        [float(c) for c in args.contexts],
        series,
        "context (tokens)",
        "concurrent sequences",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
