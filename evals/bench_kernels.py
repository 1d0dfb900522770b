"""The linear kernels of each weight mode on the embedded model's own shapes, timed in turns.

For every kernel module the server can run (engine/model/linear_kernels.py) and every row
count, the time of one call on a weight of the LM head's shape (262,144 x 640, tied to the
embedding) and of one decoder layer's linears (the fused q/k/v, o, fused gate/up and down
projections of Gemma 3 270M), with random weights and inputs of the model's scale.

On a shared machine the speed drifts by tens of percent within minutes, so the kernels are
timed in turns: each round calls every kernel once per shape and row count, in a shuffled
order, and the figure is each one's median over the rounds. Ratios within a row of the table
are what to read.

    python -m evals.bench_kernels [--rows 1 16 32] [--rounds 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.linear_kernels import (
    BFloat16Linear,
    DynamicInt8Linear,
    OneDNNInt8Linear,
    PackedLinear,
    has_amx,
    int8_linear_class,
)
from evals.harness import write_results

HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS, KV_HEADS, VOCAB = 640, 2048, 256, 4, 1, 262_144
SHAPES = {  # (out_features, in_features)
    "lm_head": (VOCAB, HIDDEN),
    "qkv_proj": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up_proj": (2 * INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
}
Call = Callable[[torch.Tensor], torch.Tensor]
# Both int8 libraries, whichever `int8` picks on this CPU (int8_linear_class).
KERNELS: dict[str, Callable[[torch.Tensor], Call]] = {
    "exact (float32 F.linear)": lambda w: lambda x: F.linear(x, w),
    "packed (float32 oneDNN)": PackedLinear,
    "bf16 (oneDNN)": BFloat16Linear,
    "int8 (oneDNN)": OneDNNInt8Linear,
    "int8 (fbgemm)": DynamicInt8Linear,
}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    calls = {
        (shape, kernel): build(torch.randn(n, k) * 0.02)
        for shape, (n, k) in SHAPES.items()
        for kernel, build in KERNELS.items()
    }
    inputs = {
        (shape, rows): torch.randn(rows, in_features)
        for shape, (_, in_features) in SHAPES.items()
        for rows in args.rows
    }
    times: dict[tuple[str, str, int], list[float]] = {}
    order = [(shape, kernel, rows) for (shape, kernel) in calls for rows in args.rows]
    rng = random.Random(0)
    for round_index in range(args.rounds + 2):  # the first two rounds warm up
        rng.shuffle(order)
        for shape, kernel, rows in order:
            x = inputs[shape, rows]
            start = time.perf_counter()
            calls[shape, kernel](x)
            elapsed = time.perf_counter() - start
            if round_index >= 2:
                times.setdefault((shape, kernel, rows), []).append(elapsed)
    median_ms = {key: 1000 * statistics.median(values) for key, values in times.items()}

    layer_shapes = [shape for shape in SHAPES if shape != "lm_head"]
    table: dict[str, dict[str, dict[int, float]]] = {}
    for kernel in KERNELS:
        table[kernel] = {
            "lm_head": {rows: median_ms["lm_head", kernel, rows] for rows in args.rows},
            "layer": {
                rows: sum(median_ms[shape, kernel, rows] for shape in layer_shapes)
                for rows in args.rows
            },
        }
    head = ["kernel", *(f"LM head ms, {r} rows" for r in args.rows)]
    head += [f"one layer's linears ms, {r} rows" for r in args.rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for kernel, row in table.items():
        cells = [kernel, *(f"{row['lm_head'][r]:.2f}" for r in args.rows)]
        cells += [f"{row['layer'][r]:.3f}" for r in args.rows]
        lines.append("| " + " | ".join(cells) + " |")
    markdown = "\n".join(lines)
    int8_library = int8_linear_class().__name__
    print(f"AMX: {has_amx()}; int8 runs {int8_library}; {torch.get_num_threads()} threads")
    print(markdown)
    path = write_results(
        "bench_kernels",
        {"rows": args.rows, "rounds": args.rounds, "amx": has_amx(), "int8": int8_library,
         "ms": {k: {part: {str(r): v for r, v in rows.items()} for part, rows in parts.items()}
                for k, parts in table.items()},
         "markdown": markdown},
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
