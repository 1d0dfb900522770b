"""One user's decode step against the memory roofline, in the default mode.

At one row a decode step multiplies every weight once: it is bound by reading them. This
counts the bytes one decode token reads in the weight mode the server picks by default
(WEIGHTS=auto: each linear layer's weights at its kernel's element size, the embedding row,
the K/V the context holds), measures this machine's read bandwidth (a sum over a buffer far
larger than the caches, both cores), and sets the roofline, bandwidth / bytes, beside the
measured decode speed of one stream through the engine.

    python -m evals.roofline [--context 256] [--decode-tokens 64] [--repeats 5] [--out PATH]

Writes evals/results/roofline.json (or `--out`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from engine.backends.custom import CustomBackend
from engine.config import EngineConfig, KVConfig
from engine.model.int8_kernels import DynamicInt8Linear, Int8GatedMLP, OneDNNInt8Linear
from engine.model.kernel_select import kernel_for
from engine.model.kv_cache import auto_kv_cache_dtype
from engine.model.linear_kernels import BFloat16GatedMLP, BFloat16Linear, PackedLinear
from engine.offline import LLM
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from evals.harness import engine_step_seconds, token_prompt, write_results

# Bytes per weight a kernel reads at one row.
_WEIGHT_BYTES: dict[type, int] = {
    BFloat16Linear: 2,
    OneDNNInt8Linear: 1,
    DynamicInt8Linear: 1,
    PackedLinear: 4,
}


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights one decode token reads, by kind of module."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, BFloat16GatedMLP):
            size = 3 * module.in_features * module.out_features * 2  # gate, up and down
        elif isinstance(module, Int8GatedMLP):
            size = 3 * module.in_features * module.hidden  # gate, up and down, a byte each
        elif isinstance(module, nn.Linear):
            size = module.weight.numel() * module.weight.element_size()
        elif isinstance(
            module, (BFloat16Linear, OneDNNInt8Linear, DynamicInt8Linear, PackedLinear)
        ):
            size = module.out_features * module.in_features * _WEIGHT_BYTES[type(module)]
        else:
            continue
        name = type(module).__name__
        counts[name] = counts.get(name, 0) + size
    return counts


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a sum over a `gib` GiB float32 buffer reads, best of `repeats`."""
    buffer = torch.ones(int(gib * (1 << 30)) // 4)
    buffer.sum()  # fault the pages in
    best = min(_timed(lambda: buffer.sum()) for _ in range(repeats))
    return buffer.numel() * 4 / best


def _timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="default: results/roofline.json")
    args = parser.parse_args()

    llm = LLM(
        weights="auto",
        numerics="fast",
        config=EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=1), kv=KVConfig(enable_prefix_caching=False)
        ),
    )
    engine = llm.engine
    if not isinstance(engine.backend, CustomBackend):
        raise SystemExit("the roofline is of the custom backend")
    model = engine.backend.model
    kernel = kernel_for("auto", "fast", torch.device("cpu"))
    weights = weight_bytes(model)
    embedding = model.model.embed_tokens.weight
    embedding_row = embedding.shape[1] * embedding.element_size()
    # K/V read per token at the context's midpoint (sliding layers read at most their window).
    context = args.context + args.decode_tokens // 2
    kv_bytes = sum(
        group.bytes_per_token * min(context, group.sliding_window or context)
        for group in engine.runner.cache_groups
    )
    total = sum(weights.values()) + embedding_row + kv_bytes

    bandwidth = read_bandwidth()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True)
    prompt = token_prompt(llm.tokenizer, rng, args.context)
    engine_step_seconds(engine, [prompt], params)  # warm-up
    per_token = []
    for _ in range(args.repeats):
        steps = engine_step_seconds(
            engine, [token_prompt(llm.tokenizer, rng, args.context)], params
        )
        per_token.append(statistics.median(steps[1:]))
    measured = 1 / statistics.median(per_token)
    roofline = bandwidth / total
    result = {
        "weights": kernel,
        "kv_cache_dtype": str(auto_kv_cache_dtype(kernel, torch.float32)),
        "bytes_per_token": {**weights, "embedding row": embedding_row, "kv": kv_bytes},
        "total_mb_per_token": round(total / 1e6, 1),
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "roofline_tok_s": round(roofline, 1),
        "roofline_ms_per_token": round(1000 / roofline, 2),
        "measured_tok_s": round(measured, 1),
        "measured_ms_per_token": round(1000 / measured, 2),
        "fraction_of_roofline": round(measured / roofline, 3),
    }
    for key, value in result.items():
        print(f"{key:24s} {value}")
    print(f"wrote {write_results('roofline', result, args.out)}")


if __name__ == "__main__":
    main()
