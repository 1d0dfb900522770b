"""Which kernel runs the model's linear layers, by weight mode, numerics and device.

Ways to run `x @ W.T`, chosen by timing the kernels PyTorch offers on the CPU at hand
(`python -m evals.bench_forward` compares them inside the engine):
- `exact`: `F.linear` on the model's dtype, bit for bit what transformers computes.
- `packed`: the same float32 weights, reordered once into oneDNN's blocked layout so each call
  skips the repacking `F.linear` does (CPU only). Same maths, another summation order: logits
  differ from `exact` in the last bits.
- `bf16`: the weights rounded to bfloat16 once, through oneDNN (CPU only): AMX tiles where the
  CPU has them. Activations are rounded to bfloat16 per call; everything between the linear
  layers stays float32, except inside each MLP (BFloat16GatedMLP), whose gelu and product are
  fused into its GEMMs in bfloat16. Approximate: `evals/quality.py` measures what it costs.
- `int8`: dynamic quantization (CPU only). Weights are int8 with one scale per output channel;
  each call quantizes the activations to int8 with one scale per row, multiplies in integers,
  and rescales to float32. oneDNN runs it on CPUs with AMX tiles, fbgemm elsewhere (each
  measured the faster there); at decode sizes cpu_ops' own kernels take over (VNNI for a few
  rows, AMX tiles up to AMX_INT8_MAX_ROWS). Approximate: `evals/quality.py` measures what it
  costs.
- `bf16-int8head`: `bf16` for the decoder layers, `int8` for the LM head (`body_and_head`).

`quantize_model` swaps a model's `nn.Linear` modules for the chosen kernel in place. On CUDA and
MPS only `exact` exists: the other kernels are CPU libraries.
"""

from __future__ import annotations

import re
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import nn

from engine.model import cpu_ops

WEIGHT_MODES = ("auto", "fp32", "bf16", "bf16-int8head", "int8")
_CPU_ONLY = {"bf16": "oneDNN", "bf16-int8head": "oneDNN", "int8": "oneDNN or fbgemm"}
# Modes whose LM head runs another kernel than the body: (body, head).
_SPLIT_KERNELS = {"bf16-int8head": ("bf16", "int8")}
NUMERICS_MODES = ("exact", "fast")


def kernel_for(weights: str, numerics: str, device: torch.device) -> str:
    """`exact`, `packed`, `bf16`, `bf16-int8head` or `int8` for the WEIGHTS / NUMERICS settings
    on `device`.

    WEIGHTS=auto on CPU is bf16-int8head where the CPU has AMX tiles: there int8 ran the LM
    head, the largest matrix, about twice as fast as bfloat16 (evals/bench_kernels.py) for 0.5%
    more perplexity than float32, while int8 layers, only 4-17% faster than bfloat16 ones, took
    int8 everywhere to 3.6% (evals/quality.py). Without AMX it is int8, which decoded 3.9x
    faster than float32 on such a CPU for a 2.7% higher perplexity (evals/bench_forward.py).
    The DTYPE weights elsewhere.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown WEIGHTS {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
    if numerics not in NUMERICS_MODES:
        raise ValueError(
            f"unknown NUMERICS {numerics!r}: expected one of {', '.join(NUMERICS_MODES)}"
        )
    if weights == "auto":
        weights = ("bf16-int8head" if has_amx() else "int8") if device.type == "cpu" else "fp32"
    if weights in _CPU_ONLY:  # approximate whatever NUMERICS says
        if device.type != "cpu":
            raise ValueError(
                f"WEIGHTS={weights} uses {_CPU_ONLY[weights]}, a CPU kernel; "
                f"not available on {device}"
            )
        if weights.startswith("bf16") and not has_bf16():
            raise ValueError(
                f"WEIGHTS={weights} needs oneDNN's bfloat16 GEMM, which this CPU lacks "
                "(it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT); use WEIGHTS=int8 or fp32"
            )
        return weights
    if numerics == "fast" and device.type == "cpu" and torch.backends.mkldnn.is_available():
        return "packed"
    return "exact"


def body_and_head(kernel: str) -> tuple[str, str]:
    """The kernels of the decoder layers and of the LM head for `kernel`.

    `bf16-int8head` runs the layers in bfloat16 and the LM head, 62% of Gemma 3 270M's weights,
    in int8: the head is the largest matrix and decode reads all of it every step, so its bytes
    are what a step waits on; its perplexity lies between bf16's and int8's (evals/quality.py).
    """
    return _SPLIT_KERNELS.get(kernel, (kernel, kernel))


def has_bf16() -> bool:
    """Whether oneDNN has a bfloat16 GEMM for this CPU (BFloat16Linear's kernel)."""
    return (
        bool(torch.backends.mkldnn.is_available()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@cache
def has_vnni() -> bool:
    """Whether this CPU multiplies int8 with VNNI (vpdpbusd, int32 sums). Without it the int8
    GEMMs of fbgemm and oneDNN sum pairs of u8 x s8 products in int16 (vpmaddubsw), which
    saturates once activations and weights are both large."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False  # unknown: assume the saturating instructions
    return bool(re.search(r"\b(avx512_vnni|avx_vnni|amx_int8)\b", flags))


def int8_weight_max() -> int:
    """The largest int8 weight magnitude the int8 kernels quantize to: 127 with VNNI; 63 without,
    so that a u8 activation times a weight, summed in pairs, stays within int16 (255 * 63 * 2 <
    32767). Measured on an AVX2 CPU without VNNI (evals/quality.py, int8): 8-bit weights
    saturated to perplexity x1.050; 7-bit weights x1.040; 7-bit activations instead x1.155."""
    return 127 if has_vnni() else 63


def has_amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bfloat16 GEMM uses."""
    return bool(torch.cpu._is_amx_tile_supported()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# oneDNN builds (and caches, up to 1,024) one primitive per input shape: 2-8 ms and about 0.6 MB
# each, per weight shape. A server's row counts (every prefill length plus the decode rows beside
# it) would build one almost every step and grow resident memory by hundreds of megabytes
# (evals/soak.py). Rows beyond a few decode sizes are padded up to one of eight steps per power
# of two, at most 1/8 more rows, so a few dozen shapes cover every batch, and `warm_up` builds
# them all before the first request: resident memory stays flat under any traffic after that.
EXACT_ROWS = 16


def row_bucket(rows: int) -> int:
    """The row count oneDNN is called with for `rows` input rows: `rows` up to EXACT_ROWS, then
    the next multiple of 2**k / 8 for rows in [2**k, 2**(k+1))."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every row count oneDNN is called with for 1 to `max_rows` input rows, ascending."""
    return sorted({row_bucket(rows) for rows in range(1, max_rows + 1)})


def padded_rows(x: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a [row_bucket(rows), in_features] matrix of `dtype`, padded with zero rows."""
    rows = x.reshape(-1, in_features)
    bucket = row_bucket(rows.shape[0])
    if bucket == rows.shape[0]:
        return rows.to(dtype)
    padded = rows.new_zeros((bucket, in_features), dtype=dtype)
    padded[: rows.shape[0]] = rows
    return padded


class PackedLinear(nn.Module):
    """`x @ W.T` on the model's weights packed once, at load. Float32 weights go into
    cpu_ops.packed_linear's tiles where this CPU has that kernel (AVX-512): it reads the
    weights as one stream, and `evals/bench_kernels.py` timed the embedded model's layers 6-14%
    faster than oneDNN at 1, 16 and 32 rows and the LM head within a few percent either way, so
    only this copy is kept. Elsewhere the weights are reordered for oneDNN, which `F.linear`
    would redo every call."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.tiles: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        if weight.dtype == torch.float32 and cpu_ops.packed_linear_supported(torch.float32):
            self.tiles = cpu_ops.pack_linear_weight(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if self.tiles is not None:
            rows = x.reshape(-1, self.in_features)
            return cpu_ops.packed_linear(rows, self.tiles, self.out_features).view(shape)
        rows = padded_rows(x, self.in_features, x.dtype)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        return out[: x.numel() // self.in_features].view(shape)


# Output columns per oneDNN call of a large matrix (the LM head). Its output in one call, [rows,
# 262,144] float32, is 64 MiB at 64 rows and leaves the cache before anything reads it again;
# in slices, each slice is rounded or rescaled while still cached and the weights are still
# read once per call (evals/bench_kernels.py, "LM head by output slices").
OUTPUT_SLICE = 16384


def output_slices(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight`'s output rows in slices of OUTPUT_SLICE (one slice for a small matrix)."""
    if weight.shape[0] <= 2 * OUTPUT_SLICE:
        return [weight]
    return [part.contiguous() for part in weight.split(OUTPUT_SLICE)]


def slice_output(
    out: torch.Tensor | None, rows: int, columns: int, dtype: torch.dtype
) -> torch.Tensor:
    """Where a sliced GEMM writes its [rows, columns] result: `out`, a buffer its caller keeps
    between steps, where it has that shape and dtype, else a new tensor. A fresh 64-row LM
    head output is 64 MiB, which the allocator maps anew on every call and the first write
    faults in page by page (`python -m evals.bench_step` shows it in the forward phase)."""
    if (
        out is not None
        and out.shape == (rows, columns)
        and out.dtype == dtype
        and out.is_contiguous()
    ):
        return out
    return torch.empty((rows, columns), dtype=dtype)


def scatter_columns(
    part: torch.Tensor, row_scale: torch.Tensor | None, out: torch.Tensor, column: int
) -> None:
    """out[:, column:column + W] = part[:R] (* row_scale[:R]), R = out's rows, W = part's
    columns: by cpu_ops' kernel where it is built (a strided torch.mul is slower) and the
    output is float32, else by torch."""
    rows, columns = out.shape[0], part.shape[1]
    target = out[:, column : column + columns]
    if out.dtype == torch.float32 and cpu_ops.available():
        cpu_ops.scatter_columns(part, row_scale, out, column)
    elif row_scale is None:
        target.copy_(part[:rows])
    else:
        torch.mul(part[:rows], row_scale[:rows], out=target)


# Rows up to which the bfloat16 layers run cpu_ops' packed kernels rather than oneDNN's: a few
# streams' decode steps, where reading the weights is all the time there is and the packed
# kernel reads them once as a stream for every row; from about eight rows oneDNN's AMX tiles
# are faster, so both layouts are kept (`python -m evals.bench_kernels --rows 1 2 4 8 16`).
PACKED_BF16_MAX_ROWS = 4

# Rows up to which they run cpu_ops' packed kernels on AMX tiles where the CPU has them
# (cpu_ops.packed_amx): up to here those match or beat oneDNN's on the model's layer shapes,
# and they hand their work out to the threads as they come free; at prefill sizes oneDNN's
# blocking wins (`python -m evals.bench_kernels --rows 8 16 32 64 128 256`).
AMX_BF16_MAX_ROWS = 128


# The same for the int8 kernel (OneDNNInt8Linear) and cpu_ops' VNNI kernel, measured the same.
PACKED_INT8_MAX_ROWS = 4

# Rows up to which cpu_ops' int8 kernel runs on AMX tiles where it has them (decode steps):
# there it streams the weights faster than oneDNN for every layer shape, and at prefill sizes
# oneDNN's blocking wins for the wider-input shapes (`python -m evals.bench_kernels`).
AMX_INT8_MAX_ROWS = 64


def _bf16_packed_rows(inputs: int) -> int:
    """Rows up to which a bfloat16 layer of `inputs` inputs runs cpu_ops' packed kernels."""
    if cpu_ops.packed_amx(torch.bfloat16, inputs):
        return AMX_BF16_MAX_ROWS
    return PACKED_BF16_MAX_ROWS


def _bf16_tiles(weight: torch.Tensor) -> torch.Tensor | None:
    """weight in bfloat16 in cpu_ops' packed layout, where this CPU has that kernel."""
    if not cpu_ops.packed_linear_supported(torch.bfloat16):
        return None
    return cpu_ops.pack_linear_weight(weight.bfloat16())


class BFloat16Linear(nn.Module):
    """oneDNN bfloat16 `x @ W.T`: the weight rounded to bfloat16 and reordered once, at load;
    each call rounds the activations to bfloat16 and the output back to the model's dtype (or
    leaves it bfloat16 with `bf16_out`, where what reads it takes bfloat16). A single row runs
    cpu_ops' packed kernel instead (PACKED_BF16_MAX_ROWS), with the same roundings.

    oneDNN accumulates in float32 and runs on AMX tiles where the CPU has them (docs/kernels.md,
    "Linear kernels per call" and "Quality of each mode", has its speed and quality). Unlike
    DynamicInt8Linear it is not batch-invariant: oneDNN picks its blocking by row count, so a
    row's last bits can change with the batch it is in, as in float32.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.slices = [
            torch.ops.mkldnn._reorder_linear_weight(part.bfloat16().contiguous())
            for part in output_slices(weight)
        ]
        self.tiles = _bf16_tiles(weight)
        self.max_packed_rows = _bf16_packed_rows(weight.shape[1])
        self.bf16_out = False  # set by GemmaForCausalLM.fuse

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T; a sliced output (the LM head's) goes into `out` where it is given and
        shaped [rows, out_features] in the output's dtype (see slice_output)."""
        return self._run(x, self.slices, out)

    def prime(self, x: torch.Tensor) -> None:
        """forward(x) with one slice of each shape run, the rest of the output left unset:
        all that builds oneDNN's primitives for x's rows (warm_up), and the LM head's equal
        slices then cost one call, not sixteen."""
        self._run(x, list({tuple(packed.shape): packed for packed in self.slices}.values()))

    def _run(
        self, x: torch.Tensor, slices: list[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        dtype = torch.bfloat16 if self.bf16_out else x.dtype
        shape = (*x.shape[:-1], self.out_features)
        # The LM head's sliced output stays with oneDNN past a few rows (slice_output).
        max_rows = self.max_packed_rows if len(self.slices) == 1 else PACKED_BF16_MAX_ROWS
        if self.tiles is not None and x.numel() <= max_rows * self.in_features:
            rows = x.reshape(-1, self.in_features)
            out = cpu_ops.packed_linear(rows, self.tiles, self.out_features, bf16_out=True)
            return out.to(dtype).view(shape)
        rows = padded_rows(x, self.in_features, torch.bfloat16)
        real = x.numel() // self.in_features
        linear = torch.ops.mkldnn._linear_pointwise
        if len(self.slices) == 1:
            out = linear(rows, self.slices[0], None, "none", [], "")
            return out[:real].to(dtype).view(shape)
        out = slice_output(out, real, self.out_features, dtype)
        start = 0
        for packed in slices:
            part = linear(rows, packed, None, "none", [], "")
            scatter_columns(part, None, out, start)
            start += part.shape[1]
        return out.view(shape)


class BFloat16GatedMLP(nn.Module):
    """Gemma's whole GeGLU MLP, down(gelu_tanh(gate(x)) * up(x)), as three oneDNN bfloat16
    GEMMs with the elementwise work fused into them: the gate GEMM applies gelu-tanh to its
    float32 sums before rounding (an eltwise post-op), the up GEMM multiplies its sums by that
    activation (a binary post-op), and the product goes to the down GEMM in bfloat16. The
    activations stay bfloat16 from the input to the output, instead of a float32 round trip
    around the gelu and the product. Rounding differs from BFloat16Linear's (the gelu sees the
    gate's float32 sums, not their bfloat16 rounding); tests/test_linear_kernels.py bounds it,
    and docs/kernels.md, "Linear kernels per call", has the speed.
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = gate.shape[1], gate.shape[0]  # the warm_up key
        self.hidden_features = down.shape[0]
        self.gate, self.up, self.down = (
            torch.ops.mkldnn._reorder_linear_weight(w.bfloat16().contiguous())
            for w in (gate, up, down)
        )
        # The same MLP for a few rows (PACKED_BF16_MAX_ROWS), or up to AMX_BF16_MAX_ROWS on AMX
        # tiles, by cpu_ops.packed_gated_mlp.
        self.gate_up_tiles = _bf16_tiles(_alternate_tiles(gate, up))
        self.down_tiles = _bf16_tiles(down)
        self.max_packed_rows = min(
            _bf16_packed_rows(gate.shape[1]), _bf16_packed_rows(down.shape[1])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_tiles, self.down_tiles
        packed_rows = x.numel() <= self.max_packed_rows * self.in_features
        if gate_up is not None and down is not None and packed_rows:
            rows = x.reshape(-1, self.in_features)
            out = cpu_ops.packed_gated_mlp(
                rows, gate_up, down, self.out_features, self.hidden_features
            )
            return out.to(x.dtype).view(*x.shape[:-1], self.hidden_features)
        rows = padded_rows(x, self.in_features, torch.bfloat16)
        linear = torch.ops.mkldnn._linear_pointwise
        activation = linear(rows, self.gate, None, "gelu", [], "tanh")
        product = linear.binary(rows, activation, self.up, None, "mul")
        out = linear(product, self.down, None, "none", [], "")
        out = out[: x.numel() // self.in_features].to(x.dtype)
        return out.view(*x.shape[:-1], self.hidden_features)


def _alternate_tiles(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate's and up's rows in alternating runs of 64 (zero-padded to a multiple of 64), as
    cpu_ops.packed_gated_mlp takes them."""
    hidden, width = gate.shape
    tiles = -(-hidden // 64)
    runs = [
        w.new_zeros(tiles * 64, width)
        .index_copy_(0, torch.arange(hidden), w)
        .view(tiles, 64, width)
        for w in (gate, up)
    ]
    return torch.stack(runs, dim=1).reshape(2 * tiles * 64, width)


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: each output row over its largest magnitude, rounded to
    int8_weight_max (127 with VNNI, 63 without); returns the integers and float32 scales."""
    weight = weight.float().contiguous()
    top = int8_weight_max()
    scales = (weight.abs().amax(dim=1) / top).clamp(min=1e-8)
    integers = (weight / scales[:, None]).round_().clamp_(-top, top).to(torch.int8)
    return integers, scales


class PackedInt8Rows:
    """cpu_ops' int8 kernel over a layer's int8 weights, for decode-sized row counts: up to
    AMX_INT8_MAX_ROWS where it has AMX tiles, else PACKED_INT8_MAX_ROWS (VNNI). Each row is
    quantized at 127 over its largest magnitude; the sums are exact and the rescale the same at
    any row count, so a row's outputs do not depend on its batch. Both int8 modules run it
    below its row limit and their library above."""

    def __init__(self, integers: torch.Tensor, weight_scales: torch.Tensor) -> None:
        self.in_features, self.out_features = integers.shape[1], integers.shape[0]
        self.tiles = cpu_ops.pack_linear_weight(integers)
        self.scales = weight_scales / 127
        self.compensation = (integers.sum(dim=1, dtype=torch.int32) * 128).int()
        self.amx = cpu_ops.packed_amx(torch.int8, self.in_features)
        self.max_rows = AMX_INT8_MAX_ROWS if self.amx else PACKED_INT8_MAX_ROWS

    @classmethod
    def where_supported(
        cls, integers: torch.Tensor, weight_scales: torch.Tensor
    ) -> PackedInt8Rows | None:
        """The kernel's state, or None where cpu_ops has no int8 kernel on this CPU."""
        if not cpu_ops.packed_linear_supported(torch.int8):
            return None
        return cls(integers, weight_scales)

    def serves(self, rows: int) -> bool:
        return rows <= self.max_rows

    def run(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] @ W.T, float32, written into `out` where it fits (slice_output)."""
        target = slice_output(out, x.shape[0], self.out_features, torch.float32)
        return cpu_ops.packed_int8_linear(
            x, self.tiles, self.scales, self.compensation, self.out_features, target
        )

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The first maximum of each row of run(x), never written out (int64 [rows])."""
        return cpu_ops.packed_int8_linear_argmax(
            x, self.tiles, self.scales, self.compensation, self.out_features
        )


class DynamicInt8Linear(nn.Module):
    """fbgemm int8 `x @ W.T`: per-channel int8 weights, activations quantized per row per call.

    fbgemm's dynamic quantization picks one activation scale and zero point from the whole
    input's min and max, so one row with large values (Gemma's first token) would coarsen every
    other row, and a request's result would depend on who else is in the batch. Instead each row
    is divided by its largest magnitude and quantized at the fixed range [-1, 1] (uint8, scale
    1/127, zero point 128): every row gets its own scale and the same quantization alone or in
    any batch, the integers cpu_ops' kernel takes, which runs decode-sized batches where the
    CPU has VNNI (PackedInt8Rows: faster than fbgemm there, as `python -m evals.bench_kernels`
    measures on a CPU without AMX). The two rescale in another order, so a row's last bits can
    change past that row count. The row's magnitude multiplies the output back. Weights use 7
    bits on CPUs without VNNI, where 8 would saturate fbgemm's int16 pair sums
    (int8_weight_max).
    """

    # The activations' uint8 quantization once each row lies in [-1, 1]: 127 levels each side
    # of the zero point, as cpu_ops' kernel quantizes.
    INPUT_SCALE = 1 / 127
    INPUT_ZERO_POINT = 128

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        integers, scales = quantize_int8_weight(weight)
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # PyTorch warns that quantized tensor types are deprecated; fbgemm's prepacked linear
            # still takes one, and measures 2-10x faster than float32 here (see the module doc).
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch._make_per_channel_quantized_tensor(
                integers, scales.double(), zero_points, 0
            )
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.packed_rows = PackedInt8Rows.where_supported(integers, scales)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T; the rows cpu_ops' kernel serves are written into `out` where it fits."""
        shape = (*x.shape[:-1], self.out_features)
        if (packed := _packed_for(self.packed_rows, x.numel() // self.in_features)) is not None:
            result = packed.run(x.reshape(-1, self.in_features).float(), out)
            return result.view(shape).to(x.dtype)
        # Few tensor ops on purpose: at decode sizes each costs about as much as the multiply.
        dtype, rows = x.dtype, x.reshape(-1, self.in_features).float()  # fbgemm is float32
        # abs().amax(): the same values as vector_norm(inf), which measured 6x slower at 16 rows.
        row_max = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
        # Full 8-bit activations: 7 bits cost 10% perplexity here.
        result = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows / row_max, self.INPUT_SCALE, self.INPUT_ZERO_POINT, self.packed
        )
        return result.mul_(row_max).view(shape).to(dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """As OneDNNInt8Linear.argmax."""
        return _packed_argmax(self.packed_rows, x, self.in_features)


class OneDNNInt8Linear(nn.Module):
    """oneDNN int8 `x @ W.T`, the same quantization as DynamicInt8Linear by another library:
    per-channel symmetric int8 weights (7-bit without VNNI, see int8_weight_max), and each
    activation row divided by its largest magnitude and rounded to int8 in [-127, 127], so
    every row has its own scale and is quantized the same alone or in any batch. The products
    are summed exactly in int32 (AMX tiles where the CPU has them) and rescaled to float32, then
    multiplied by the row's magnitude; oneDNN picks its kernel by row count, so that rescale can
    round differently in the last bit with the batch size. Decode-sized batches run cpu_ops'
    kernel on the same integers (PackedInt8Rows); `python -m evals.bench_kernels` times both
    (docs/kernels.md, "Linear kernels per call").
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        integers, self.weight_scales = quantize_int8_weight(weight)
        self.slices = [
            (torch.ops.onednn.qlinear_prepack(part, None), scales, torch.zeros_like(scales).long())
            for part, scales in zip(
                output_slices(integers), output_slices(self.weight_scales), strict=True
            )
        ]
        self.packed_rows = PackedInt8Rows.where_supported(integers, self.weight_scales)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """As BFloat16Linear.forward: a sliced output goes into `out` where it fits."""
        return self._run(x, self.slices, out)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The first maximum of each row of forward(x) (int64 [rows]) without writing the
        outputs, where cpu_ops' kernel computes these rows; else None."""
        return _packed_argmax(self.packed_rows, x, self.in_features)

    def prime(self, x: torch.Tensor) -> None:
        """As BFloat16Linear.prime: forward(x) with one slice of each shape run (warm_up);
        nothing for the row counts cpu_ops' kernel serves (it keeps no per-shape state)."""
        if _packed_for(self.packed_rows, x.numel() // self.in_features) is not None:
            return
        self._run(x, list({tuple(part[0].shape): part for part in self.slices}.values()))

    def _run(
        self,
        x: torch.Tensor,
        slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        real = x.numel() // self.in_features
        if (kernel := _packed_for(self.packed_rows, real)) is not None:
            result = kernel.run(x.reshape(-1, self.in_features), out)
            return result.view(*x.shape[:-1], self.out_features).to(x.dtype)
        dtype, rows = x.dtype, padded_rows(x, self.in_features, torch.float32)
        row_max = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
        quantized = (rows * (127 / row_max)).round_().to(torch.int8)
        out = slice_output(out, real, self.out_features, torch.float32)
        start = 0
        for packed, scales, zero_points in slices:
            part = torch.ops.onednn.qlinear_pointwise(
                quantized, 1 / 127, 0, packed, scales, zero_points,
                None, 1.0, 0, torch.float32, "none", [], "",
            )  # fmt: skip
            # Scaled while the slice is still in cache, straight into its columns.
            scatter_columns(part, row_max, out, start)
            start += part.shape[1]
        return out.view(*x.shape[:-1], self.out_features).to(dtype)


def _packed_for(packed_rows: PackedInt8Rows | None, rows: int) -> PackedInt8Rows | None:
    """packed_rows where it exists and serves `rows` rows; None: the module's library runs."""
    if packed_rows is None or not packed_rows.serves(rows):
        return None
    return packed_rows


def _packed_argmax(
    packed_rows: PackedInt8Rows | None, x: torch.Tensor, in_features: int
) -> torch.Tensor | None:
    """packed_rows' argmax of x's rows where it serves that many, else None."""
    rows = x.reshape(-1, in_features)
    packed = _packed_for(packed_rows, rows.shape[0])
    return None if packed is None else packed.argmax(rows)


_ONEDNN_KERNELS = (PackedLinear, BFloat16Linear, BFloat16GatedMLP, OneDNNInt8Linear)


def run_head(head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """head(hidden), written into `out` by the kernels that can (slice_output)."""
    if isinstance(head, (BFloat16Linear, OneDNNInt8Linear, DynamicInt8Linear)):
        return head(hidden, out=out)
    return head(hidden)


def head_argmax(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The first maximum of each row of head(hidden) (int64 [rows]), computed without writing
    the logits out, where the head's kernel can (the int8 head on cpu_ops' kernel, float32 in
    and out: bfloat16 logits could round two of them to a tie); else None.
    A greedy step needs only that index, and at 64 rows the logits it skips are 64 MiB
    (`python -m evals.bench_step --temperature 0 [--no-greedy-head]` measures the difference)."""
    if isinstance(head, (OneDNNInt8Linear, DynamicInt8Linear)) and hidden.dtype == torch.float32:
        return head.argmax(hidden)
    return None


@torch.inference_mode()
def warm_up(model: nn.Module, max_rows: int, dtype: torch.dtype) -> int:
    """Call each distinct oneDNN kernel shape under `model` once with every row bucket up to
    `max_rows` rows of `dtype` activations, so that oneDNN has built every primitive a step can
    ask for; returns the number of calls. oneDNN caches primitives by shape, not by weight, so
    one module of each (kernel, in, out) stands for all of them. fbgemm keeps no per-shape
    state, and nothing else here does either."""
    calls = 0
    seen: set[tuple[type, int, int]] = set()
    for module in model.modules():
        if not isinstance(module, _ONEDNN_KERNELS):
            continue
        if isinstance(module, PackedLinear) and module.packed is None:
            continue  # cpu_ops' kernel: nothing to build
        key = (type(module), module.in_features, module.out_features)
        if key in seen:
            continue
        seen.add(key)
        for rows in row_buckets(max_rows):  # oneDNN kernels are CPU-only
            x = torch.zeros(rows, module.in_features, dtype=dtype)
            if isinstance(module, (BFloat16Linear, OneDNNInt8Linear)):
                module.prime(x)  # one call per slice shape: the LM head's slices are equal
            else:
                module(x)
            calls += 1
    return calls


def int8_linear_class() -> type[nn.Module]:
    """The int8 kernel for this CPU: oneDNN where it has AMX tiles (measured there, see
    OneDNNInt8Linear), fbgemm elsewhere (measured faster than float32 on an AVX2 CPU)."""
    return OneDNNInt8Linear if has_amx() else DynamicInt8Linear


_KERNELS: dict[str, type[nn.Module]] = {
    "packed": PackedLinear,
    "bf16": BFloat16Linear,
}


def make_linear(kernel: str, weight: torch.Tensor) -> nn.Module:
    """A module computing `x @ weight.T` with `kernel` (not `exact`: that is plain nn.Linear)."""
    if kernel == "int8":
        return int8_linear_class()(weight)
    return _KERNELS[kernel](weight)


def make_fused_mlp(
    kernel: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> BFloat16GatedMLP | None:
    """Gemma's whole MLP as one `kernel` module where that kernel has one (bf16:
    BFloat16GatedMLP), else None: its linears then run one by one."""
    return BFloat16GatedMLP(gate, up, down) if kernel == "bf16" else None


def quantize_model(model: nn.Module, kernel: str, head: nn.Module | None = None) -> None:
    """Replace every bias-free `nn.Linear` under `model` with `kernel`'s module, in place; the
    LM head `head`, where given, with the head's kernel of a split kernel (body_and_head)."""
    if kernel == "exact":
        return
    body_kernel, head_kernel = body_and_head(kernel)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(f"{name}: linear layers with a bias are not supported")
                chosen = head_kernel if child is head else body_kernel
                setattr(parent, name, make_linear(chosen, child.weight))
