"""The linear-layer kernels on float32 and bfloat16 weights (CPU): `packed` (PackedLinear,
oneDNN's blocked float32 layout) and `bf16` (BFloat16Linear, and BFloat16GatedMLP for a whole
Gemma MLP), with the row buckets and output slices every oneDNN kernel shares. The int8 kernels
are in engine.model.int8_kernels, the choice between all of them in engine.model.kernel_select.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model import cpu_ops

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
        self.bf16_out = False  # set by engine.model.optimize where bfloat16 is handed on

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
        self.gate_up_tiles = _bf16_tiles(alternate_tiles(gate, up))
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


def alternate_tiles(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate's and up's rows in alternating runs of 64 (zero-padded to a multiple of 64), as
    cpu_ops.packed_gated_mlp and packed_int8_gated take them."""
    hidden, width = gate.shape
    tiles = -(-hidden // 64)
    runs = [
        w.new_zeros(tiles * 64, width)
        .index_copy_(0, torch.arange(hidden), w)
        .view(tiles, 64, width)
        for w in (gate, up)
    ]
    return torch.stack(runs, dim=1).reshape(2 * tiles * 64, width)
