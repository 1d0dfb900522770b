"""The int8 linear kernels (CPU): weights int8 with one scale per output channel, activations
quantized per call with one scale per row, integer products rescaled to float32.

cpu_ops' own kernel (PackedInt8Rows) runs every row count on CPUs without AMX (AVX512-VNNI, or
AVX2 on a CPU with no VNNI at all), and decode-sized batches on CPUs with AMX tiles. A library
runs the rest: oneDNN in OneDNNInt8Linear (the faster one on CPUs with AMX tiles, see
engine.model.kernel_select), fbgemm in DynamicInt8Linear (on a CPU with AVX-VNNI and no AVX-512,
everything)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from engine.model import cpu_ops
from engine.model.cpu_features import int8_weight_max
from engine.model.linear_kernels import (
    alternate_tiles,
    output_slices,
    padded_rows,
    scatter_columns,
    slice_output,
)

# Rows up to which cpu_ops' int8 kernel runs on AMX tiles where it has them (decode steps):
# there it streams the weights faster than oneDNN for every layer shape, and at prefill sizes
# oneDNN's blocking wins for the wider-input shapes (`python -m evals.bench_kernels`).
AMX_INT8_MAX_ROWS = 64

# DynamicInt8Linear scales its activation rows in one cpu_ops pass where it is built; False:
# eager ops, the same values (`python -m evals.bench_prefill` times both).
FUSED_ROW_SCALE = True


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: each output row over its largest magnitude, rounded to
    int8_weight_max (127 with VNNI, 63 without); returns the integers and float32 scales."""
    weight = weight.float().contiguous()
    top = int8_weight_max()
    scales = (weight.abs().amax(dim=1) / top).clamp(min=1e-8)
    integers = (weight / scales[:, None]).round_().clamp_(-top, top).to(torch.int8)
    return integers, scales


class PackedInt8Rows:
    """cpu_ops' int8 kernel over a layer's int8 weights: every row count without AMX, up to
    AMX_INT8_MAX_ROWS where it has AMX tiles (oneDNN's blocking wins past it). Without AMX it
    outruns fbgemm from one row to prefill sizes (`python -m evals.bench_kernels`). Each row is
    quantized at 127 over its largest magnitude; the sums are exact and the rescale the same at
    any row count, so a row's outputs do not depend on its batch. Both int8 modules run it
    below its row limit and their library above."""

    def __init__(self, integers: torch.Tensor, weight_scales: torch.Tensor) -> None:
        self.in_features, self.out_features = integers.shape[1], integers.shape[0]
        self.tiles = cpu_ops.pack_linear_weight(integers)
        self.scales = weight_scales / 127
        self.compensation = (integers.sum(dim=1, dtype=torch.int32) * 128).int()
        self.amx = cpu_ops.packed_amx(torch.int8, self.in_features)
        self.max_rows: int | None = AMX_INT8_MAX_ROWS if self.amx else None

    @classmethod
    def where_supported(
        cls, integers: torch.Tensor, weight_scales: torch.Tensor
    ) -> PackedInt8Rows | None:
        """The kernel's state, or None where cpu_ops has no int8 kernel on this CPU."""
        if not cpu_ops.packed_linear_supported(torch.int8):
            return None
        return cls(integers, weight_scales)

    @staticmethod
    def serves_every_row_count(in_features: int) -> bool:
        """Whether the kernel runs every row count for weights of `in_features` inputs: built
        for this CPU, and no AMX tiles for them (those stop at AMX_INT8_MAX_ROWS)."""
        return cpu_ops.packed_linear_supported(torch.int8) and not cpu_ops.packed_amx(
            torch.int8, in_features
        )

    def serves(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows

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
    any batch, the integers cpu_ops' kernel takes. Where cpu_ops has that kernel it runs every
    call (PackedInt8Rows; on AMX CPUs decode-sized ones) and fbgemm's copy of the weights is
    never made; `packed=False` runs fbgemm alone, to compare. The two rescale in another
    order, so their last bits can differ. The row's magnitude multiplies the output back.
    Weights use 7 bits on CPUs without VNNI, where 8 would saturate the int16 pair sums of
    fbgemm's and cpu_ops' AVX2 kernels (int8_weight_max).
    """

    # The activations' uint8 quantization once each row lies in [-1, 1]: 127 levels each side
    # of the zero point, as cpu_ops' kernel quantizes.
    INPUT_SCALE = 1 / 127
    INPUT_ZERO_POINT = 128

    def __init__(self, weight: torch.Tensor, packed: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        integers, scales = quantize_int8_weight(weight)
        self.packed_rows = PackedInt8Rows.where_supported(integers, scales) if packed else None
        if serves_every_row(self.packed_rows):
            self.slices: list[torch.ScriptObject] = []
            return
        # A large matrix (the LM head) in slices of output columns, as OneDNNInt8Linear: fbgemm
        # reads the whole weight again for every few rows, from memory when it is larger than
        # the cache (168 MB), from the cache when it is a slice; each slice's output is
        # rescaled while cached, into the caller's buffer. The outputs are the same bit for bit
        # (`python -m evals.bench_kernels --rows 16 32 64` times the head as served).
        self.slices = [
            _fbgemm_prepack(part, part_scales)
            for part, part_scales in zip(
                output_slices(integers), output_slices(scales), strict=True
            )
        ]

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T, written into `out` where it fits (slice_output)."""
        shape = (*x.shape[:-1], self.out_features)
        if (packed := _packed_for(self.packed_rows, x.numel() // self.in_features)) is not None:
            result = packed.run(x.reshape(-1, self.in_features).float(), out)
            return result.view(shape).to(x.dtype)
        dtype, rows = x.dtype, x.reshape(-1, self.in_features).float()  # fbgemm is float32
        scaled, row_max = _scale_rows_by_max(rows)
        # Full 8-bit activations: 7 bits cost 10% perplexity here.
        if len(self.slices) == 1:
            result = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                scaled, self.INPUT_SCALE, self.INPUT_ZERO_POINT, self.slices[0]
            )
            return result.mul_(row_max).view(shape).to(dtype)
        result = slice_output(out, rows.shape[0], self.out_features, torch.float32)
        start = 0
        for weight_slice in self.slices:
            part = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                scaled, self.INPUT_SCALE, self.INPUT_ZERO_POINT, weight_slice
            )
            scatter_columns(part, row_max, result, start)
            start += part.shape[1]
        return result.view(shape).to(dtype)

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
    round differently in the last bit with the batch size. cpu_ops' kernel runs the row counts
    it serves on the same integers (PackedInt8Rows), and oneDNN's copy of the weights is made
    only where it does not serve them all; `packed=False` runs oneDNN alone, to compare.
    `python -m evals.bench_kernels` times both (docs/kernels.md, "Linear kernels per call").
    """

    def __init__(self, weight: torch.Tensor, packed: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        integers, self.weight_scales = quantize_int8_weight(weight)
        self.packed_rows = (
            PackedInt8Rows.where_supported(integers, self.weight_scales) if packed else None
        )
        if serves_every_row(self.packed_rows):
            self.slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            return
        self.slices = [
            (torch.ops.onednn.qlinear_prepack(part, None), scales, torch.zeros_like(scales).long())
            for part, scales in zip(
                output_slices(integers), output_slices(self.weight_scales), strict=True
            )
        ]

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


class Int8GatedMLP(nn.Module):
    """Gemma's GeGLU MLP, down(gelu_tanh(gate(x)) * up(x)), in int8 on cpu_ops' int8 kernel
    with the gelu and the product fused into the gate/up GEMM: gate and up are packed in
    alternate tiles of 64 outputs, so each pair of tiles' sums is rescaled, activated and
    multiplied while in cache, and only the [rows, hidden] product is written. The weights are
    quantized per output channel as the int8 linears quantize them, and every pre-activation
    is the one PackedInt8Rows computes; the gelu is cpu_ops' own tanh formula, whose last bits
    can differ from ATen's (`evals/quality.py` measures the mode). Used where cpu_ops' kernel
    serves every row count (where_supported); elsewhere the MLP's linears run one by one."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.hidden = gate.shape[1], gate.shape[0]
        self.out_features = down.shape[0]
        (gate_integers, gate_scales), (up_integers, up_scales) = (
            quantize_int8_weight(w) for w in (gate, up)
        )
        scales = alternate_tiles(gate_scales[:, None], up_scales[:, None])[:, 0]
        self.gate_up = PackedInt8Rows(alternate_tiles(gate_integers, up_integers), scales)
        self.down = PackedInt8Rows(*quantize_int8_weight(down))

    @staticmethod
    def where_supported(
        gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> Int8GatedMLP | None:
        """The module where cpu_ops' int8 kernel runs every row count for both its GEMMs (no
        AMX tiles), as the int8 linears then run it; else None."""
        if not all(PackedInt8Rows.serves_every_row_count(w.shape[1]) for w in (gate, down)):
            return None
        return Int8GatedMLP(gate, up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        gate_up = self.gate_up
        product = cpu_ops.packed_int8_gated(
            rows, gate_up.tiles, gate_up.scales, gate_up.compensation, self.hidden
        )
        out = self.down.run(product, None)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _scale_rows_by_max(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows / m, m), m each row's largest magnitude (at least 1e-12, [R, 1]): one pass of
    cpu_ops where it is built, else the same values from eager ops, which read the rows four
    times (abs().amax(): as vector_norm(inf), and faster at decode sizes)."""
    if FUSED_ROW_SCALE and cpu_ops.available() and rows.stride(-1) == 1:
        return cpu_ops.scale_rows_by_max(rows)
    row_max = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12)
    return rows / row_max, row_max


def _fbgemm_prepack(integers: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's prepacked form of per-channel int8 weights."""
    zero_points = torch.zeros(integers.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch warns that quantized tensor types are deprecated; fbgemm's prepacked linear
        # still takes one, and measures 2-10x faster than float32 here (see the module doc).
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_channel_quantized_tensor(
            integers.contiguous(), scales.double(), zero_points, 0
        )
    return torch.ops.quantized.linear_prepack(quantized, None)


def serves_every_row(packed_rows: PackedInt8Rows | None) -> bool:
    """Whether cpu_ops' kernel runs every call of a module with these packed_rows, so the
    module's library never does."""
    return packed_rows is not None and packed_rows.max_rows is None


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
