"""cpu_ops' packed linear kernels (csrc/packed_linear.cpp) against float64 and oneDNN, and the
linear modules that run them: PackedLinear (float32) at every row count, BFloat16Linear and
BFloat16GatedMLP for a few rows, and on AMX tiles up to AMX_BF16_MAX_ROWS where they have them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_ops
from engine.model.cpu_features import has_amx, int8_weight_max
from engine.model.int8_kernels import (
    AMX_INT8_MAX_ROWS,
    DynamicInt8Linear,
    Int8GatedMLP,
    OneDNNInt8Linear,
    PackedInt8Rows,
)
from engine.model.kernel_select import warm_up
from engine.model.linear_kernels import (
    AMX_BF16_MAX_ROWS,
    OUTPUT_SLICE,
    PACKED_BF16_MAX_ROWS,
    BFloat16GatedMLP,
    BFloat16Linear,
    PackedLinear,
    alternate_tiles,
    row_buckets,
)
from tests.conftest import needs_bf16


def needs_packed(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not cpu_ops.packed_linear_supported(dtype),
        reason=f"this CPU build has no packed linear kernel for {dtype}",
    )


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bfloat16 tensors in units of the last place."""
    bits_a = a.view(torch.int16).int()
    bits_b = b.view(torch.int16).int()
    # Map the sign-magnitude bits onto a line so that neighbours differ by one.
    line_a = torch.where(bits_a < 0, -32768 - bits_a, bits_a)
    line_b = torch.where(bits_b < 0, -32768 - bits_b, bits_b)
    return int((line_a - line_b).abs().max())


# Outputs: whole tiles of 64, a partial last tile, fewer than one tile. Inputs: even and odd.
# Rows: 1-6 fill one register block each; 7, 13 and 40 run several blocks over each tile, the
# later ones prefetching the next tile.
SHAPES = [(128, 64), (100, 33), (37, 640)]
ROWS = [1, 2, 5, 6, 7, 13, 40]


@needs_packed(torch.float32)
@pytest.mark.parametrize("outputs, inputs", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_float32_against_float64(outputs: int, inputs: int, rows: int) -> None:
    weight, x = random(outputs, inputs, seed=outputs), random(rows, inputs, seed=rows)
    out = cpu_ops.packed_linear(x, cpu_ops.pack_linear_weight(weight), outputs)
    assert out.dtype == torch.float32 and out.shape == (rows, outputs)
    reference = x.double() @ weight.double().T
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5 * inputs**0.5)


# The bfloat16 kernel runs more than 6 rows on AMX tiles where it was built with them, for
# inputs in multiples of 32 (the first and last shape): in passes of 64 rows, the last partial
# (70), and in pairs of 16-row tiles, one of them alone (40, 70).
BF16_ROWS = [*ROWS, 64, 70]


@needs_packed(torch.bfloat16)
@pytest.mark.parametrize("outputs, inputs", SHAPES)
@pytest.mark.parametrize("rows", BF16_ROWS)
def test_bfloat16_against_float64(outputs: int, inputs: int, rows: int) -> None:
    """Products of bfloat16 inputs and weights, summed in float32, rounded once to bfloat16:
    within one unit in the last place of the exact sum rounded the same way."""
    weight, x = random(outputs, inputs, seed=outputs), random(rows, inputs, seed=rows)
    packed = cpu_ops.pack_linear_weight(weight.bfloat16())
    exact = x.bfloat16().double() @ weight.bfloat16().double().T
    out = cpu_ops.packed_linear(x, packed, outputs, bf16_out=True)
    assert out.dtype == torch.bfloat16
    assert bf16_ulps(out, exact.bfloat16()) <= 1
    # A bfloat16 x is read as it is: the same result.
    assert torch.equal(cpu_ops.packed_linear(x.bfloat16(), packed, outputs, bf16_out=True), out)
    # Float32 output: the float32 sums, unrounded.
    unrounded = cpu_ops.packed_linear(x, packed, outputs)
    torch.testing.assert_close(unrounded.double(), exact, rtol=0, atol=1e-5 * inputs**0.5)


@needs_packed(torch.float32)
def test_strided_rows_and_no_rows() -> None:
    """Rows with a stride wider than the row (a column slice) are read in place; zero rows
    give an empty result."""
    weight, wide = random(70, 48, seed=1), random(9, 80, seed=2)
    x = wide[:, 16:64]
    packed = cpu_ops.pack_linear_weight(weight)
    torch.testing.assert_close(cpu_ops.packed_linear(x, packed, 70), x @ weight.T)
    assert cpu_ops.packed_linear(x[:0], packed, 70).shape == (0, 70)


@needs_packed(torch.float32)
def test_bad_input_is_an_error() -> None:
    packed = cpu_ops.pack_linear_weight(random(64, 32, seed=3))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_ops.packed_linear(random(2, 31, seed=4), packed, 64)
    with pytest.raises(RuntimeError, match="outputs"):
        cpu_ops.packed_linear(random(2, 32, seed=4), packed, 65)


def int8_reference(x: torch.Tensor, integers: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OneDNNInt8Linear's quantization by hand: each row to int8 at 127 over its largest
    magnitude, exact integer sums, then float32 sums * scale * the row's magnitude."""
    row_max = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    quantized = (x * (127 / row_max)).round()
    sums = quantized.long() @ integers.long().T
    return sums.float() * scales * row_max


# The int8 kernel runs more than 6 rows on AMX tiles where it was built with them, for inputs
# in multiples of 64 (the first and last shape): 64 rows fill one pass of four row tiles, 70
# need a second, partial one. Without AMX, more than 120 rows run in panels of 120 (250: two
# whole panels and a partial one).
INT8_ROWS = [*ROWS, 64, 70, 250]


def random_int8_weight(outputs: int, inputs: int, seed: int) -> torch.Tensor:
    """Integers over the whole range the int8 kernels take on this CPU (int8_weight_max)."""
    top = int8_weight_max()
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-top, top + 1, (outputs, inputs), dtype=torch.int8, generator=generator)


@needs_packed(torch.int8)
@pytest.mark.parametrize("outputs, inputs", SHAPES)
@pytest.mark.parametrize("rows", INT8_ROWS)
def test_int8_equals_its_integers(outputs: int, inputs: int, rows: int) -> None:
    """The int32 sums are exact (the uint8 offset taken back by the compensation), and the
    rescale is the reference's float32 operations in the same order: equal bit for bit, the
    first column 100x larger than the rest as Gemma's first token is."""
    integers = random_int8_weight(outputs, inputs, seed=outputs)
    scales = random(outputs, seed=1).abs() * 1e-3
    x = random(rows, inputs, seed=rows)
    x[:, 0] *= 100
    compensation = (integers.sum(dim=1, dtype=torch.int32) * 128).int()
    packed = cpu_ops.pack_linear_weight(integers)
    out = cpu_ops.packed_int8_linear(x, packed, scales, compensation, outputs)
    assert torch.equal(out, int8_reference(x, integers, scales))


@needs_packed(torch.int8)
@pytest.mark.parametrize("sign", [1, -1])
def test_int8_sums_at_the_extremes_are_exact(sign: int) -> None:
    """Every product at its largest: each input quantized to +-127 (uint8 255 or 1) against
    weights all at +-int8_weight_max. Without VNNI the kernel sums pairs of products in int16
    (2 x 255 x 63 fits; 8-bit weights would not): the sums must still be the exact ones."""
    top, inputs, outputs = int8_weight_max(), 640, 128
    integers = torch.full((outputs, inputs), top, dtype=torch.int8)
    integers[1::2] = -top
    x = torch.full((3, inputs), float(sign))
    x[1, ::2] = -sign  # half the inputs at the other extreme
    x[2, 1::3] *= 1e-9  # a third of them near zero
    scales = torch.full((outputs,), 1e-3)
    compensation = (integers.sum(dim=1, dtype=torch.int32) * 128).int()
    packed = cpu_ops.pack_linear_weight(integers)
    out = cpu_ops.packed_int8_linear(x, packed, scales, compensation, outputs)
    assert torch.equal(out, int8_reference(x, integers, scales))
    expected_sums = torch.tensor([127 * top * inputs * sign, 0, 127 * top * (inputs - 213) * sign])
    assert torch.equal(out[:, 0], expected_sums.float() * scales[0])


@needs_packed(torch.int8)
@pytest.mark.skipif(int8_weight_max() == 127, reason="the CPU has VNNI: 8-bit weights are exact")
def test_int8_weights_past_seven_bits_are_refused_without_vnni() -> None:
    """Without VNNI a weight past int8_weight_max could saturate the kernel's int16 pair sums
    and give wrong outputs silently: packing it is an error instead."""
    integers = torch.zeros(64, 8, dtype=torch.int8)
    integers[3, 5] = -128
    with pytest.raises(RuntimeError, match="must lie in"):
        cpu_ops.pack_linear_weight(integers)


@needs_packed(torch.int8)
@pytest.mark.parametrize("linear_class", [DynamicInt8Linear, OneDNNInt8Linear])
@pytest.mark.parametrize("rows", [1, 4, 7, 64])
def test_int8_module_against_its_library(linear_class, rows: int) -> None:
    """The rows cpu_ops' kernel serves (every count on VNNI, up to AMX_INT8_MAX_ROWS on AMX)
    give what the module's library alone (fbgemm, oneDNN) gives: the same integers, rescaled
    in the last bit alike."""
    weight, x = random(200, 96, seed=21) * 0.05, random(rows, 96, seed=22)
    module = linear_class(weight)
    assert module.packed_rows is not None and module.packed_rows.serves(rows)
    library = linear_class(weight, packed=False)
    assert library.packed_rows is None
    torch.testing.assert_close(module(x), library(x), rtol=1e-6, atol=1e-6)


@needs_packed(torch.int8)
@pytest.mark.skipif(has_amx(), reason="AMX CPUs run oneDNN past AMX_INT8_MAX_ROWS")
def test_int8_module_runs_every_row_count_without_amx_and_no_library_copy() -> None:
    """Without AMX cpu_ops' int8 kernel (its VNNI form, or its AVX2 form on a CPU with no
    VNNI) runs prefill-sized calls too, and a module keeps no
    second copy of its weights for fbgemm: a row's outputs are the same alone and among 300,
    bit for bit."""
    weight, x = random(130, 96, seed=23) * 0.05, random(300, 96, seed=24)
    module = DynamicInt8Linear(weight)
    assert module.slices == [] and module.packed_rows.max_rows is None
    batched = module(x)
    alone = torch.cat([module(x[i : i + 1]) for i in (0, 150, 299)])
    assert torch.equal(batched[[0, 150, 299]], alone)
    torch.testing.assert_close(batched, DynamicInt8Linear(weight, packed=False)(x), rtol=1e-6,
                               atol=1e-6)  # fmt: skip


@needs_packed(torch.int8)
def test_int8_module_rows_do_not_depend_on_their_batch() -> None:
    """Where cpu_ops' kernel has AMX tiles it serves decode-sized batches: a row's outputs are
    the same alone and in a batch of AMX_INT8_MAX_ROWS, bit for bit, and land in the buffer
    the caller passes."""
    rows = AMX_INT8_MAX_ROWS
    weight, x = random(300, 128, seed=41) * 0.05, random(rows, 128, seed=42)
    module = OneDNNInt8Linear(weight)
    if not module.packed_rows.amx:
        pytest.skip("this build of cpu_ops has no AMX tiles")
    buffer = torch.empty(rows, 300)
    batched = module(x, out=buffer)
    assert batched.data_ptr() == buffer.data_ptr()
    alone = torch.cat([module(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(batched, alone)


@needs_packed(torch.int8)
@pytest.mark.parametrize("hidden", [128, 100])
@pytest.mark.parametrize("rows", [1, 7, 250])
def test_int8_gated_mlp_against_its_integers(hidden: int, rows: int) -> None:
    """Int8GatedMLP's product is gelu_tanh(gate) * up of the pre-activations computed by hand
    (per-channel int8 weights, each row at 127 over its largest magnitude, exact sums), the
    gelu in float64 within float32 rounding; then the down projection of that product by hand.
    A row gives the same bits alone as among `rows` (hidden 100: a partial last tile)."""
    width = 96
    if not all(PackedInt8Rows.serves_every_row_count(inputs) for inputs in (width, hidden)):
        pytest.skip("AMX tiles for these inputs: oneDNN past AMX_INT8_MAX_ROWS rows")
    gate, up, down = (random(hidden, width, seed=61) * 0.2, random(hidden, width, seed=62) * 0.2,
                      random(80, hidden, seed=63) * 0.2)  # fmt: skip
    x = random(rows, width, seed=64)
    mlp = Int8GatedMLP.where_supported(gate, up, down)
    assert mlp is not None
    (g_int, g_scales), (u_int, u_scales) = int8_integers(gate), int8_integers(up)
    pre_gate = int8_reference(x, g_int, g_scales / 127).double()
    pre_up = int8_reference(x, u_int, u_scales / 127).double()
    product = F.gelu(pre_gate, approximate="tanh") * pre_up
    packed = mlp.gate_up
    got = cpu_ops.packed_int8_gated(x, packed.tiles, packed.scales, packed.compensation, hidden)
    torch.testing.assert_close(got.double(), product, rtol=1e-5, atol=1e-6)
    d_int, d_scales = int8_integers(down)
    expected = int8_reference(got, d_int, d_scales / 127)
    out = mlp(x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(mlp(x[-1:]), out[-1:])


def eager_gated_mlp(x, gate, up, down) -> torch.Tensor:
    """What BFloat16GatedMLP's oneDNN GEMMs compute, rounded where they round: the gelu of the
    gate's float32 sums to bfloat16, the up sums times it to bfloat16, the output to
    bfloat16."""
    xb = x.bfloat16().double()
    gate_sums = (xb @ gate.bfloat16().double().T).float()
    up_sums = (xb @ up.bfloat16().double().T).float()
    activation = F.gelu(gate_sums, approximate="tanh").bfloat16().float()
    product = (up_sums * activation).bfloat16()
    return (product.double() @ down.bfloat16().double().T).bfloat16()


@needs_packed(torch.bfloat16)
@pytest.mark.parametrize("hidden", [128, 100])
@pytest.mark.parametrize("rows", [1, 8, 70])
def test_gated_mlp_against_the_eager_roundings(hidden: int, rows: int) -> None:
    """Within a few units in the last place of the eager reference: the gelu's tanh and the
    sums' order may move a rounding by one, and that moves the next product."""
    width = 96
    gate, up = random(hidden, width, seed=5) * 0.2, random(hidden, width, seed=6) * 0.2
    down = random(width, hidden, seed=7) * 0.2
    x = random(rows, width, seed=8)
    out = cpu_ops.packed_gated_mlp(
        x,
        cpu_ops.pack_linear_weight(alternate_tiles(gate, up).bfloat16()),
        cpu_ops.pack_linear_weight(down.bfloat16()),
        hidden,
        width,
    )
    reference = eager_gated_mlp(x, gate, up, down)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, width)
    torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)
    assert (out == reference).float().mean() > 0.9


@needs_packed(torch.float32)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_packed_linear_module_runs_the_packed_kernel(rows: int) -> None:
    weight, x = random(96, 40, seed=9), random(rows, 40, seed=10)
    module = PackedLinear(weight)
    assert module.tiles is not None and module.packed is None  # one copy of the weights
    torch.testing.assert_close(module(x.view(1, rows, 40)), (x @ weight.T).view(1, rows, 96))


@needs_packed(torch.float32)
def test_warm_up_skips_the_packed_kernel() -> None:
    """cpu_ops' packed kernel builds nothing per shape, so warm_up does not call it."""
    model = torch.nn.Sequential(PackedLinear(random(24, 8, seed=11)))
    assert warm_up(model, 20, torch.float32) == 0


@needs_bf16
@needs_packed(torch.bfloat16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", range(1, PACKED_BF16_MAX_ROWS + 1))
def test_bf16_modules_few_rows_against_onednn(dtype: torch.dtype, rows: int) -> None:
    """Up to PACKED_BF16_MAX_ROWS rows run cpu_ops' kernels, more rows oneDNN's: the same
    roundings, so a row's result moves by at most a unit in the last place between the two."""
    gate, up, down = (random(*shape, seed=12 + i) * 0.1 for i, shape in
                      enumerate([(256, 128), (256, 128), (128, 256)]))  # fmt: skip
    x = random(rows, 128, seed=20).to(dtype)
    linear, mlp = BFloat16Linear(gate), BFloat16GatedMLP(gate, up, down)
    assert linear.tiles is not None and mlp.down_tiles is not None
    packed = linear(x), mlp(x)
    linear.tiles, mlp.down_tiles = None, None  # oneDNN for every row count
    onednn = linear(x), mlp(x)
    for ours, theirs in zip(packed, onednn, strict=True):
        assert ours.dtype == dtype
        assert bf16_ulps(ours.bfloat16(), theirs.bfloat16()) <= 1


@needs_bf16
@needs_packed(torch.bfloat16)
@pytest.mark.parametrize("rows", [7, 33, 128])
def test_bf16_modules_amx_rows_against_onednn(rows: int) -> None:
    """Where cpu_ops' bfloat16 kernels have AMX tiles, the modules run them up to
    AMX_BF16_MAX_ROWS: the same products summed in float32 and rounded where oneDNN rounds, so
    within a unit in the last place of oneDNN's (the MLP's product can take that unit into the
    down projection: a few units there)."""
    gate, up, down = (random(*shape, seed=50 + i) * 0.1 for i, shape in
                      enumerate([(256, 128), (256, 128), (128, 256)]))  # fmt: skip
    linear, mlp = BFloat16Linear(gate), BFloat16GatedMLP(gate, up, down)
    if not cpu_ops.packed_amx(torch.bfloat16, 128):
        pytest.skip("this build of cpu_ops has no AMX tiles")
    assert linear.max_packed_rows == mlp.max_packed_rows == AMX_BF16_MAX_ROWS >= rows
    x = random(rows, 128, seed=60).bfloat16()
    packed = linear(x), mlp(x)
    linear.max_packed_rows = mlp.max_packed_rows = 0  # oneDNN for every row count
    onednn = linear(x), mlp(x)
    assert bf16_ulps(packed[0], onednn[0]) <= 1
    torch.testing.assert_close(packed[1].float(), onednn[1].float(), rtol=2e-2, atol=2e-2)
    assert (packed[1] == onednn[1]).float().mean() > 0.9


@pytest.mark.skipif(not has_amx(), reason="oneDNN's int8 and bfloat16 kernels need AMX here")
@pytest.mark.parametrize("rows", [5, 40])
def test_large_matrices_run_in_output_slices(rows: int) -> None:
    """A matrix wider than two slices (the LM head) runs as several oneDNN calls whose columns
    land in place: the int8 module matches its integers by hand, the bfloat16 one a float64
    product of the bfloat16-rounded operands, rounded to bfloat16 as oneDNN's output is."""
    outputs, inputs = 2 * OUTPUT_SLICE + 37, 64
    weight, x = random(outputs, inputs, seed=31) * 0.05, random(rows, inputs, seed=32)
    int8 = OneDNNInt8Linear(weight, packed=False)  # oneDNN at every row count
    assert len(int8.slices) == 3
    integers, scales = int8_integers(weight)
    expected = int8_reference(x, integers, scales / 127)
    torch.testing.assert_close(int8(x), expected, rtol=1e-6, atol=1e-6)
    bf16 = BFloat16Linear(weight)
    assert len(bf16.slices) == 3
    product = (x.bfloat16().double() @ weight.bfloat16().double().T).bfloat16().float()
    torch.testing.assert_close(bf16(x), product, rtol=8e-3, atol=1e-6)  # a bfloat16 step
    # warm_up primes them with one call per slice shape, and they compute the same after it.
    assert warm_up(torch.nn.Sequential(int8, bf16), rows, torch.float32) == 2 * len(
        row_buckets(rows)
    )
    torch.testing.assert_close(int8(x), expected, rtol=1e-6, atol=1e-6)


def int8_integers(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weights OneDNNInt8Linear keeps, each output row at int8_weight_max over its
    largest magnitude, and each row's scale back to the weights."""
    top = int8_weight_max()
    scales = (weight.abs().amax(dim=1) / top).clamp(min=1e-8)
    return (weight / scales[:, None]).round().clamp(-top, top).to(torch.int8), scales


@needs_packed(torch.int8)
@pytest.mark.parametrize("outputs, inputs", SHAPES)
@pytest.mark.parametrize("rows", INT8_ROWS)
def test_int8_argmax_is_the_first_maximum_of_the_outputs(
    outputs: int, inputs: int, rows: int
) -> None:
    """packed_int8_linear_argmax finds, per row, the first maximum of the outputs the
    reference computes by hand, without the kernel writing them."""
    integers = random_int8_weight(outputs, inputs, seed=outputs)
    scales = random(outputs, seed=2).abs() * 1e-3
    x = random(rows, inputs, seed=rows + 100)
    compensation = (integers.sum(dim=1, dtype=torch.int32) * 128).int()
    packed = cpu_ops.pack_linear_weight(integers)
    found = cpu_ops.packed_int8_linear_argmax(x, packed, scales, compensation, outputs)
    expected = int8_reference(x, integers, scales).max(dim=1).indices
    assert torch.equal(found, expected)


@needs_packed(torch.int8)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_argmax_takes_the_first_of_tied_outputs_and_of_nans(rows: int) -> None:
    """Outputs 5, 40, 300 and 999 have the same weights and scale, and every row is output 5's
    weights: they tie for the largest (in one tile, and in tiles that other threads may take
    first), and the first of them wins, as torch.max picks. A NaN scale makes its output NaN
    in every row, which counts as the largest: the first NaN wins."""
    outputs, inputs = 1000, 128
    integers = random_int8_weight(outputs, inputs, seed=3)
    integers[[40, 300, 999]] = integers[5].clone()
    scales = torch.full((outputs,), 1e-3)
    x = integers[5].float().repeat(rows, 1) * torch.arange(1, rows + 1)[:, None]
    compensation = (integers.sum(dim=1, dtype=torch.int32) * 128).int()
    packed = cpu_ops.pack_linear_weight(integers)
    reference = int8_reference(x, integers, scales)
    assert torch.equal(reference[:, 999], reference[:, 5])
    assert (reference.max(dim=1).indices == 5).all()
    found = cpu_ops.packed_int8_linear_argmax(x, packed, scales, compensation, outputs)
    assert found.tolist() == [5] * rows
    scales[[130, 77]] = float("nan")
    found = cpu_ops.packed_int8_linear_argmax(x, packed, scales, compensation, outputs)
    assert found.tolist() == [77] * rows


@needs_packed(torch.int8)
@pytest.mark.parametrize("linear_class", [DynamicInt8Linear, OneDNNInt8Linear])
def test_int8_module_argmax_where_its_kernel_serves_the_rows(linear_class) -> None:
    """An int8 module's argmax is its own outputs' first maximum for the row counts cpu_ops'
    kernel serves, and None past them, where its library computes the outputs."""
    weight = random(500, 128, seed=51) * 0.05
    module = linear_class(weight)
    most = module.packed_rows.max_rows  # None: every row count (VNNI without AMX)
    for rows in (1, most or 300):
        x = random(rows, 128, seed=rows)
        found = module.argmax(x)
        assert found is not None
        assert torch.equal(found, module(x).max(dim=1).indices)
    if most is not None:
        assert module.argmax(random(most + 1, 128, seed=0)) is None
