"""The linear kernels of each weight mode on the embedded model's own shapes, timed in turns.

For every kernel module the server can run (engine/model/kernel_select.py), as the server runs
it and, where it switches to cpu_ops' packed kernels at some row counts, with oneDNN alone, and
for every row count: the time of one call on a weight of the LM head's shape (262,144 x 640,
tied to the embedding) and of one decoder layer's linears (the fused q/k/v, o, fused gate/up
and down projections of Gemma 3 270M), with random weights and inputs of the model's scale.
Each layer shape is timed through the model's 18 layers, each with its own weights, and divided
by 18: one layer's weights alone would stay in the CPU's cache from call to call, which decode
never sees.

On a shared machine the speed drifts by tens of percent within minutes, so the kernels are
timed in turns: each round calls every kernel once per shape and row count, in a shuffled
order, and the figure is each one's median over the rounds. Ratios within a row of the table
are what to read.

Then Gemma's MLP in bf16 two ways, through 18 layers in shuffled turns at decode and prefill
row counts: as the server runs it (BFloat16GatedMLP: gelu-tanh and the gate*up product fused
into oneDNN's GEMMs, bfloat16 throughout) and as separate bf16 linears (fused gate/up, down)
with the gelu and product in float32 between them.

Then prefill-sized batches of changing size: one layer's four bf16 linears called at
`--prefill-calls` random row counts of 65-600, with the rows padded to linear_kernels'
row_bucket (what the server does) and at their exact count. oneDNN builds a primitive per
input shape, so the second pays that build on nearly every call.

    python -m evals.bench_kernels [--rows 1 16 32] [--mlp-rows 1 16 32 512] [--rounds 20]
        [--prefill-calls 300]

Results go to evals/results/bench_kernels.json on a CPU with AMX tiles, to
bench_kernels_no_amx.json on one with AVX512-VNNI and no AMX, and to bench_kernels_avx2.json on
one with neither (there the bf16 kernels, which the server refuses without AVX-512, are left
out).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cpu_features import has_amx, has_bf16, has_vnni
from engine.model.int8_kernels import DynamicInt8Linear, OneDNNInt8Linear
from engine.model.kernel_select import int8_linear_class
from engine.model.linear_kernels import BFloat16GatedMLP, BFloat16Linear, PackedLinear
from evals.harness import write_results

HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS, KV_HEADS, VOCAB = 640, 2048, 256, 4, 1, 262_144
LAYERS = 18
SHAPES = {  # (out_features, in_features)
    "lm_head": (VOCAB, HIDDEN),
    "qkv_proj": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up_proj": (2 * INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
}
Call = Callable[[torch.Tensor], torch.Tensor]
Key = TypeVar("Key", bound=Hashable)


def float32_onednn(weight: torch.Tensor) -> Call:
    """Float32 weights reordered for oneDNN (what PackedLinear runs without cpu_ops' tiles)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def library_only(module_class: type[nn.Module]):
    """module_class with its cpu_ops kernels dropped: its library (oneDNN, fbgemm) at every
    row count."""

    def build(weight: torch.Tensor) -> Call:
        if module_class is BFloat16Linear:
            module = BFloat16Linear(weight)
            module.tiles = None
            return module
        return module_class(weight, packed=False)

    return build


# Each kernel as the server runs it, and its library alone where the server runs cpu_ops'
# packed kernels at some row counts (PackedLinear: all; bf16: up to 4 rows, or 128 where cpu_ops
# has AMX tiles; int8: all with VNNI, up to 64 where it has AMX tiles). The int8 library is the one
# `int8` picks on this CPU (int8_linear_class); on an AMX CPU fbgemm is timed beside it. Without
# AMX oneDNN's int8 GEMM is left out: on an AVX512-VNNI CPU it took seconds a call from 8 rows.
_INT8 = int8_linear_class()
_INT8_LIBRARY = "oneDNN" if _INT8 is OneDNNInt8Linear else "fbgemm"
KERNELS: dict[str, Callable[[torch.Tensor], Call]] = {
    "exact (float32 F.linear)": lambda w: lambda x: F.linear(x, w),
    "packed (float32, as served)": PackedLinear,
    "packed (float32, oneDNN)": float32_onednn,
    "int8 (as served)": _INT8,
    f"int8 ({_INT8_LIBRARY} only)": library_only(_INT8),
}
if has_bf16():  # elsewhere the server refuses the bf16 modes (kernel_select.kernel_for)
    KERNELS["bf16 (as served)"] = BFloat16Linear
    KERNELS["bf16 (oneDNN)"] = library_only(BFloat16Linear)
if _INT8 is OneDNNInt8Linear:
    KERNELS["int8 (fbgemm only)"] = library_only(DynamicInt8Linear)


def median_ms_in_turns(
    runs: dict[Key, tuple[list[Call], torch.Tensor]], rounds: int, seed: int
) -> dict[Key, float]:
    """Per entry, the median ms of one call: each entry's calls (one per layer, or one) run on
    its input, every entry once per round in a shuffled order, over `rounds` rounds after two
    to warm up."""
    times: dict[Key, list[float]] = {key: [] for key in runs}
    order = list(runs)
    rng = random.Random(seed)
    for round_index in range(rounds + 2):
        rng.shuffle(order)
        for key in order:
            copies, x = runs[key]
            start = time.perf_counter()
            for call in copies:
                call(x)
            if round_index >= 2:
                times[key].append((time.perf_counter() - start) / len(copies))
    return {key: 1000 * statistics.median(values) for key, values in times.items()}


def mlp_fusion_ms(rows_counts: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """Median ms per layer of Gemma's bf16 MLP, fused (BFloat16GatedMLP) and unfused (bf16
    gate/up and down linears, gelu and product in float32), over `rows_counts` input rows."""
    layers: dict[str, list[Call]] = {"unfused": [], "fused": []}
    for _ in range(LAYERS):
        gate, up = (torch.randn(INTERMEDIATE, HIDDEN) * 0.02 for _ in range(2))
        down = torch.randn(HIDDEN, INTERMEDIATE) * 0.02
        gate_up, down_proj = BFloat16Linear(torch.cat([gate, up])), BFloat16Linear(down)

        def unfused(x: torch.Tensor, gate_up=gate_up, down_proj=down_proj) -> torch.Tensor:
            g, u = gate_up(x).chunk(2, dim=-1)
            return down_proj(F.gelu(g, approximate="tanh") * u)

        layers["unfused"].append(unfused)
        layers["fused"].append(BFloat16GatedMLP(gate, up, down))
    inputs = {rows: torch.randn(rows, HIDDEN) for rows in rows_counts}
    runs = {(way, rows): (layers[way], inputs[rows]) for way in layers for rows in rows_counts}
    median_ms = median_ms_in_turns(runs, rounds, seed=1)
    return {way: {rows: median_ms[way, rows] for rows in rows_counts} for way in layers}


def prefill_rows_seconds(calls: int, bucketed: bool) -> float:
    """Seconds for `calls` random row counts of 65-600 through one layer's bf16 linears. oneDNN
    caches primitives by shape for the whole process: run the padded case first, so that the
    exact case can reuse only those of its row counts that are bucket sizes."""
    layers = [BFloat16Linear(torch.randn(n, k) * 0.02) for n, k in list(SHAPES.values())[1:]]
    rng = random.Random(1)
    start = time.perf_counter()
    for _ in range(calls):
        rows = rng.randint(65, 600)
        for layer in layers:
            x = torch.randn(rows, layer.in_features)
            if bucketed:
                layer(x)
            else:  # the same packed weight at the exact row count
                torch.ops.mkldnn._linear_pointwise(
                    x.bfloat16(), layer.slices[0], None, "none", [], ""
                )
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--mlp-rows", type=int, nargs="+", default=[1, 16, 32, 512])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--prefill-calls", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    calls = {
        (shape, kernel): [
            build(torch.randn(n, k) * 0.02) for _ in range(1 if shape == "lm_head" else LAYERS)
        ]
        for shape, (n, k) in SHAPES.items()
        for kernel, build in KERNELS.items()
    }
    inputs = {
        (shape, rows): torch.randn(rows, in_features)
        for shape, (_, in_features) in SHAPES.items()
        for rows in args.rows
    }
    runs = {
        (shape, kernel, rows): (copies, inputs[shape, rows])
        for (shape, kernel), copies in calls.items()
        for rows in args.rows
    }
    median_ms = median_ms_in_turns(runs, args.rounds, seed=0)

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
    mlp_ms = mlp_fusion_ms(args.mlp_rows, args.rounds) if has_bf16() else {}
    for way, by_rows in mlp_ms.items():
        timings = ", ".join(f"{rows} rows {ms:.3f}" for rows, ms in by_rows.items())
        print(f"bf16 MLP {way}, ms per layer: {timings}")
    prefill_s: dict[str, float] = {}
    if has_bf16():
        prefill_s = {
            "row_bucket": prefill_rows_seconds(args.prefill_calls, bucketed=True),
            "exact rows": prefill_rows_seconds(args.prefill_calls, bucketed=False),
        }
        print(
            f"{args.prefill_calls} prefill batches of 65-600 rows through one layer's bf16 "
            f"linears: {prefill_s['row_bucket']:.2f} s padded to row_bucket, "
            f"{prefill_s['exact rows']:.2f} s at the exact row count"
        )
    # One file per kind of CPU: the kernels that run differ with AMX tiles, with VNNI alone
    # and with AVX2 alone.
    path = write_results(
        "bench_kernels" if has_amx() else "bench_kernels_no_amx" if has_vnni() else
        "bench_kernels_avx2",
        {"rows": args.rows, "rounds": args.rounds, "amx": has_amx(), "int8": int8_library,
         "ms": {k: {part: {str(r): v for r, v in rows.items()} for part, rows in parts.items()}
                for k, parts in table.items()},
         "mlp_ms": {way: {str(r): v for r, v in rows.items()} for way, rows in mlp_ms.items()},
         "prefill_rows_s": prefill_s, "markdown": markdown},
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
