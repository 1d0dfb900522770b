"""The fused CPU kernels (engine/model/cpu_ops.py) against the eager ops they replace, and the
model's use of them: every approximate CPU mode runs them, NUMERICS=exact never does, and a
tiny random Gemma 3 / Gemma 4 gives the same logits either way to float32 rounding (decode
attention read in place from the pools included)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

from engine.backends.custom import CustomBackend
from engine.model import cpu_ops, huge_pages
from engine.model.gemma import Attention, DecoderLayer, RMSNorm, TextModel, rotate
from engine.model.int8_kernels import PackedInt8Rows
from engine.model.optimize import (
    CpuOpsAttention,
    FusedDecoderLayer,
    FusedRMSNorm,
    Int8DecoderLayer,
    Int8TextModel,
)
from tests.conftest import needs_bf16
from tests.paged_driver import PagedDriver, hf_model
from tests.test_forward_gemma3 import gqa_config
from tests.test_forward_gemma4 import full_featured_config
from tests.test_huge_pages import mapping_of, needs_madvise

CPU = torch.device("cpu")
EPS = 1e-6

pytestmark = pytest.mark.skipif(
    not cpu_ops.available(), reason="no C++ compiler to build the fused CPU kernels"
)


def eager_norm(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return h if scale is None else h * scale


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


# 3 rows run on the calling thread; 100 rows are split over tasks of 32 (the parallel path).
@pytest.mark.parametrize("rows", [3, 100])
@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_equals_the_eager_ops(rows: int, with_scale: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, 96, generator=generator) * 3
    scale = torch.randn(96, generator=generator) + 1 if with_scale else None
    close(cpu_ops.rms_norm(x, scale, EPS), eager_norm(x, scale))
    # A strided input (every other column block) is read as it is.
    wide = torch.randn(rows, 192, generator=generator)[:, :96]
    close(cpu_ops.rms_norm(wide, scale, EPS), eager_norm(wide, scale))


@pytest.mark.parametrize("rows", [1, 70])
def test_add_rms_norm_updates_the_residual_and_returns_the_next_input(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 64, generator=generator)
    x = torch.randn(rows, 64, generator=generator) * 5
    post, pre = torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    expected_residual = residual + eager_norm(x, post)
    updated = residual.clone()
    out = cpu_ops.add_rms_norm_(updated, x, post, pre, EPS)
    close(updated, expected_residual)
    close(out, eager_norm(expected_residual, pre))
    # Without a next norm: only the residual changes, and nothing is returned.
    again = residual.clone()
    assert cpu_ops.add_rms_norm_(again, x, post, None, EPS).numel() == 0
    close(again, expected_residual)


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin as TextModel.rotary makes them."""
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = (positions[:, None].float() * inv_freq).repeat(1, 2)
    sin, half = angles.sin(), head_dim // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return angles.cos()[:, None], signed[:, None]


@pytest.mark.parametrize("tokens", [1, 40])
def test_norm_rope_equals_norm_then_rotate_on_a_projection(tokens: int) -> None:
    """Query heads at column 0 and key heads after them, read from one [T, W] projection (whose
    rows hold values too, so its row stride is wider than the heads)."""
    heads, kv_heads, dim = 4, 2, 32
    generator = torch.Generator().manual_seed(tokens)
    projected = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    q_scale, k_scale = torch.randn(dim, generator=generator), torch.randn(dim, generator=generator)
    cos, sin = rope_tables(torch.arange(100, 100 + tokens), dim)
    query = projected[:, : heads * dim].reshape(tokens, heads, dim)
    keys = projected[:, heads * dim : (heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    close(
        cpu_ops.norm_rope(projected, 0, heads, dim, q_scale, cos, sin, EPS),
        rotate(eager_norm(query, q_scale), cos, sin),
    )
    close(
        cpu_ops.norm_rope(projected, heads * dim, kv_heads, dim, k_scale, cos, sin, EPS),
        rotate(eager_norm(keys, k_scale), cos, sin),
    )


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 1, 64), (8, 2, 128), (6, 2, 64), (2, 2, 48)],  # vector tiles, and the loops' remainders
)
@pytest.mark.parametrize(("seqs", "keys"), [(5, 37), (1, 203)])  # tasks whole, and shared
def test_paged_decode_attention_against_float64(
    pool_dtype, heads, kv_heads, head_dim, seqs, keys
) -> None:
    """Keys and values read at scattered slots, padding and window-masked columns skipped: the
    softmax-weighted values of float64 arithmetic on the same (rounded) keys and values."""
    slots_total, scale = 400, head_dim**-0.5
    generator = torch.Generator().manual_seed(heads * head_dim)
    key_pool = torch.randn(slots_total, kv_heads, head_dim, generator=generator).to(pool_dtype)
    value_pool = torch.randn(slots_total, kv_heads, head_dim, generator=generator).to(pool_dtype)
    query = torch.randn(seqs, heads, head_dim, generator=generator) * 2
    slots = torch.randperm(slots_total, generator=generator)[: seqs * keys].view(seqs, keys)
    visible = torch.rand(seqs, keys, generator=generator) > 0.3
    visible[:, 0] = True  # every query sees at least one key (its own, in the engine)
    mask = torch.zeros(seqs, keys, dtype=pool_dtype).masked_fill(
        ~visible, torch.finfo(pool_dtype).min
    )
    # A masked column may point anywhere: its slot must never be read.
    slots = slots.masked_fill(~visible, 10**9)
    out = cpu_ops.paged_decode_attention(query, key_pool, value_pool, slots, mask, scale)

    expected = torch.empty(seqs, heads, head_dim, dtype=torch.float64)
    group = heads // kv_heads
    for b in range(seqs):
        seen = slots[b][visible[b]]
        for h in range(heads):
            k = key_pool[seen, h // group].double()
            v = value_pool[seen, h // group].double()
            weights = torch.softmax(k @ query[b, h].double() * scale, dim=0)
            expected[b, h] = weights @ v
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 1, 256), (6, 2, 64), (2, 2, 48)])
def test_paged_decode_attention_is_the_same_shared_between_threads(
    pool_dtype, heads, kv_heads, head_dim
) -> None:
    """With fewer (sequence, KV head) pairs than threads, every thread takes a share of each
    pair's keys and output columns: the result must be the one thread's, bit for bit, so a
    decode row's attention does not depend on how many others share its step."""
    keys, slots_total = 300, 1000
    generator = torch.Generator().manual_seed(head_dim)
    key_pool = torch.randn(slots_total, kv_heads, head_dim, generator=generator).to(pool_dtype)
    value_pool = torch.randn(slots_total, kv_heads, head_dim, generator=generator).to(pool_dtype)
    query = torch.randn(1, heads, head_dim, generator=generator) * 2
    slots = torch.randperm(slots_total, generator=generator)[:keys].view(1, keys)
    visible = torch.rand(1, keys, generator=generator) > 0.2
    visible[:, 0] = True
    mask = torch.zeros(1, keys).masked_fill(~visible, torch.finfo(torch.float32).min)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_ops.paged_decode_attention(query, key_pool, value_pool, slots, mask, 0.1)
        torch.set_num_threads(4)
        shared = cpu_ops.paged_decode_attention(query, key_pool, value_pool, slots, mask, 0.1)
        # Five sequences: the pairs go whole to the threads, one each.
        many = cpu_ops.paged_decode_attention(
            query.expand(5, -1, -1), key_pool, value_pool, slots.expand(5, -1),
            mask.expand(5, -1), 0.1,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
    assert torch.equal(many, alone.expand(5, -1, -1))


def test_bfloat16_activations_in_and_out() -> None:
    """bfloat16 inputs are widened exactly and bfloat16 outputs are the float32 results rounded
    as PyTorch rounds: the same values as casting around the float32 kernels."""
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(20, 64, generator=generator) * 3).bfloat16()
    scale, pre = torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    assert torch.equal(
        cpu_ops.rms_norm(x, scale, EPS, bf16_out=True),
        cpu_ops.rms_norm(x.float(), scale, EPS).bfloat16(),
    )
    residual = torch.randn(20, 64, generator=generator)
    from_bf16, from_float = residual.clone(), residual.clone()
    out = cpu_ops.add_rms_norm_(from_bf16, x, scale, pre, EPS, bf16_out=True)
    expected = cpu_ops.add_rms_norm_(from_float, x.float(), scale, pre, EPS)
    assert torch.equal(from_bf16, from_float) and torch.equal(out, expected.bfloat16())
    cos, sin = rope_tables(torch.arange(20), 32)
    assert torch.equal(
        cpu_ops.norm_rope(x, 32, 1, 32, scale[:32], cos, sin, EPS),
        cpu_ops.norm_rope(x.float(), 32, 1, 32, scale[:32], cos, sin, EPS),
    )


@needs_bf16
def test_bfloat16_handover_changes_no_logit() -> None:
    """Under bf16 layers the norms hand bfloat16 to the GEMMs, and the attention's output
    projection to the residual add, all of which would round to it anyway: the logits equal
    those of the same model passing float32, bit for bit. Decode steps of one row run cpu_ops'
    packed kernels, the prefill oneDNN's: both hand over."""
    config = full_featured_config()
    weights = hf_model(config, seed=4).state_dict()
    handed = CustomBackend(config, weights, CPU, torch.float32, 256, "bf16")
    layers = list(handed.model.model.layers)
    assert all(layer.bf16_activations and layer.self_attn.o_proj.bf16_out for layer in layers)
    float_io = CustomBackend(config, weights, CPU, torch.float32, 256, "bf16")
    for layer in float_io.model.model.layers:
        layer.bf16_activations = layer.input_layernorm.bf16_out = False
        layer.self_attn.o_proj.bf16_out = False

    def logits(backend: CustomBackend) -> list[torch.Tensor]:
        driver = PagedDriver(backend)
        steps = [{0: [5, 9, 2, 7, 1, 3, 8], 1: [4, 4, 6]}, {0: [11], 1: [12]}, {0: [13]}]
        return [out for tokens in steps for out in driver.step(tokens)[0].values()]

    for a, b in zip(logits(handed), logits(float_io), strict=True):
        assert torch.equal(a, b)


def test_bad_inputs_are_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.rms_norm(x.double(), None, EPS)
    with pytest.raises(RuntimeError, match="row width"):
        cpu_ops.rms_norm(x, torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_ops.norm_rope(x, 4, 1, 8, torch.ones(8), torch.ones(2, 8), torch.ones(2, 8), EPS)


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_scale", [True, False])
def test_scatter_columns_writes_what_torch_writes(part_dtype, with_scale) -> None:
    """A slice's rows (more than out has: a GEMM's padded rows) land in their columns of out,
    times each row's scale, as torch.mul rounds it; the other columns are untouched."""
    generator = torch.Generator().manual_seed(7)
    part = torch.randn(8, 48, generator=generator).to(part_dtype)
    scale = torch.rand(8, 1, generator=generator) + 0.5
    out = torch.full((5, 130), -7.0)
    cpu_ops.scatter_columns(part, scale if with_scale else None, out, 40)
    expected = torch.full((5, 130), -7.0)
    rows = part[:5].float()
    expected[:, 40:88] = rows * scale[:5] if with_scale else rows
    assert torch.equal(out, expected)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_scale_rows_by_max_equals_the_eager_division(rows) -> None:
    """Each row over its largest magnitude (1e-12 for an all-zero row), from strided rows (a
    column slice of a wider tensor), as abs, amax, clamp and torch's division give it, bit for
    bit: the int8 kernels quantize the same integers either way."""
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn(rows, 700, generator=generator) * 5
    wide[0] = 0.0
    x = wide[:, 30:670]
    scaled, row_max = cpu_ops.scale_rows_by_max(x)
    expected_max = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    assert row_max.shape == (rows, 1)
    assert torch.equal(row_max, expected_max)
    assert torch.equal(scaled, x / expected_max)
    assert float(row_max[0]) == pytest.approx(1e-12) and not scaled[0].any()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_equals_index_copy_of_the_cast_rows(pool_dtype, value_dtype) -> None:
    """Keys contiguous, values a column slice of a wider projection (strided rows), written at
    scattered slots: the pools end up as index_copy_ of the rows cast to their dtype leaves
    them, bit for bit (the cast rounds to nearest even, as the kernel does)."""
    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(5, 2, 8, generator=generator)
    projection = torch.randn(5, 40, generator=generator).to(value_dtype)
    values = projection[:, 16:32].view(5, 2, 8)
    slots = torch.tensor([9, 0, 31, 4, 17])
    pools = [torch.randn(32, 2, 8, generator=generator).to(pool_dtype) for _ in range(2)]
    expected = [pool.clone() for pool in pools]
    expected[0].index_copy_(0, slots, keys.to(pool_dtype))
    expected[1].index_copy_(0, slots, values.to(pool_dtype))
    cpu_ops.store_kv(pools[0], pools[1], slots, keys, values)
    assert torch.equal(pools[0], expected[0]) and torch.equal(pools[1], expected[1])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.store_kv(pools[0], pools[1], torch.tensor([32]), keys[:1], values[:1])


def test_store_kv_rounds_model_width_rows_to_bfloat16_bit_for_bit_as_the_cast() -> None:
    """Rows as wide as the model's (one KV head of 256, whole 64-byte lines: where AVX-512 has
    the kernel round with integer ops and stream the lines), with rounding ties either way,
    denormals, infinities and NaN among them: the pool's bits are the cast's, NaN as c10's
    scalar conversion writes it (0x7FC0; PyTorch's vectorized cast writes another NaN)."""
    generator = torch.Generator().manual_seed(11)
    rows = torch.randn(6, 1, 256, generator=generator)
    rows.view(torch.int32)[0, 0, :4] = torch.tensor(
        [0x3F808000, 0x3F818000, 0x00000001, 0x807FFFFF - (1 << 32)], dtype=torch.int32
    )  # a tie rounding down to even, one rounding up to even, two denormals
    rows[1, 0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    rows[2] *= 1e-39  # all denormal
    slots = torch.tensor([40, 3, 17, 62, 0, 25])
    pools = [torch.zeros(64, 1, 256, dtype=torch.bfloat16) for _ in range(2)]
    cpu_ops.store_kv(pools[0], pools[1], slots, rows, rows * -2)
    for pool, stored in zip(pools, (rows, rows * -2), strict=True):
        cast = stored.to(torch.bfloat16).view(torch.int16)
        cast[stored.isnan()] = 0x7FC0
        expected = torch.zeros_like(pool).index_copy_(0, slots, cast.view(torch.bfloat16))
        assert torch.equal(pool.view(torch.int16), expected.view(torch.int16))


def fused_flags(backend: CustomBackend) -> set[bool]:
    """Whether each norm, attention and layer runs the fused CPU kernels."""
    fused = FusedRMSNorm | CpuOpsAttention | FusedDecoderLayer
    modules = backend.model.model.modules()
    return {
        isinstance(m, fused) for m in modules if isinstance(m, RMSNorm | DecoderLayer | Attention)
    }


@pytest.mark.parametrize("make_config", [gqa_config, full_featured_config])
@pytest.mark.parametrize("kernel", ["packed", "int8"])
def test_the_model_gives_the_same_logits_with_and_without_them(
    make_config, kernel, monkeypatch
) -> None:
    """On Gemma 3 (GQA, softcaps) and Gemma 4 (k=v, KV sharing, PLE, value norms), a prefill and
    decode steps through the fused kernels give the eager path's logits to float rounding.

    Under int8 an activation a rounding's width from a quantization boundary (x * 127 / its
    row's largest magnitude at k + 0.5) rounds to different integers on the two paths, and from
    there on their values part by a whole quantum, as any two float orders would. So the int8
    case records every int8 input's integers on both paths, through their modules (the flat
    layers equal those bit for bit, test_the_flat_int8_layer_gives_its_modules_values_bit_for_bit),
    and compares the steps before the first one rounded differently."""
    config = make_config()
    weights = hf_model(config, seed=3).state_dict()
    flat_layers = kernel != "int8"
    fused = CustomBackend(config, weights, CPU, torch.float32, 256, kernel, flat_layers=flat_layers)
    eager = CustomBackend(config, weights, CPU, torch.float32, 256, kernel, fuse_ops=False)
    assert fused_flags(fused) == {True} and fused_flags(eager) == {False}
    assert fused_flags(CustomBackend(config, weights, CPU, torch.float32, 256)) == {False}

    integers: list[torch.Tensor] = []
    for name in ("packed_int8_linear", "packed_int8_gated", "packed_int8_linear_argmax"):
        op = getattr(cpu_ops, name)

        def recorded(x: torch.Tensor, *args, op=op, **kwargs) -> torch.Tensor:
            row_max = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
            integers.append((x * (127 / row_max)).round())
            return op(x, *args, **kwargs)

        monkeypatch.setattr(cpu_ops, name, recorded)

    def logits(backend: CustomBackend) -> list[tuple[list[torch.Tensor], int]]:
        """Each step's logits, and how many int8 inputs had been recorded after it."""
        driver = PagedDriver(backend)
        assert driver.runner.paged_decode
        driver.runner.paged_decode = backend is fused  # eager: gathered K/V and sdpa
        integers.clear()
        steps = [{0: [5, 9, 2, 7, 1, 3, 8], 1: [4, 4, 6]}, {0: [11], 1: [12]}, {0: [13], 1: [2]}]
        return [(list(driver.step(tokens)[0].values()), len(integers)) for tokens in steps]

    fused_steps = logits(fused)
    fused_integers = list(integers)
    eager_steps = logits(eager)
    agree = [torch.equal(a, b) for a, b in zip(fused_integers, integers, strict=True)]
    first_apart = agree.index(False) if False in agree else len(agree)
    compared = 0
    for (fused_out, recorded), (eager_out, _) in zip(fused_steps, eager_steps, strict=True):
        if recorded > first_apart:
            break
        for a, b in zip(fused_out, eager_out, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= 1 and (kernel == "int8" or compared == len(fused_steps))


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 4099])
def test_row_argmax_is_torchs_first_maximum(width: int) -> None:
    """The first maximum of each row, as torch.max(dim).indices gives it: ties (small
    integers repeat) go to the first column, a row of -inf to column 0, a NaN wins and the
    first NaN of several does."""
    generator = torch.Generator().manual_seed(width)
    rows = [
        torch.randn(width, generator=generator),
        torch.randint(0, 3, (width,), generator=generator).float(),
        torch.full((width,), float("-inf")),
    ]
    with_nans = torch.randn(width, generator=generator)
    with_nans[width // 2] = float("nan")
    with_nans[-1] = float("nan")
    rows.append(with_nans)
    logits = torch.stack(rows)
    expected = logits.max(dim=1).indices
    assert expected[3] == width // 2 and expected[2] == 0
    assert torch.equal(cpu_ops.row_argmax(logits), expected)
    # Rows with a stride (a slice of wider rows) are read in place.
    wide = torch.randn(5, width + 7, generator=generator)
    assert torch.equal(
        cpu_ops.row_argmax(wide[:, 3 : 3 + width]), wide[:, 3 : 3 + width].max(1).indices
    )


def flat_int8_config() -> Gemma3TextConfig:
    """A small Gemma 3 config whose layers run as Int8DecoderLayer: no softcap, as Gemma 3 270M."""
    config = gqa_config()
    config.intermediate_size = 128
    config.attn_logit_softcapping = None
    return config


def int8_script_logits(backend: CustomBackend) -> list[torch.Tensor]:
    """The logits of a prefill, a mixed step and two pure decode steps of two rows each."""
    driver = PagedDriver(backend, shuffle_blocks=1)
    steps = [
        {0: [5, 9, 2, 7, 1, 3, 8]},
        {0: [11], 1: [4, 4, 6, 1]},
        {0: [13], 1: [2]},
        {0: [7], 1: [9]},
    ]
    return [out for tokens in steps for out in driver.step(tokens)[0].values()]


@pytest.mark.skipif(
    not PackedInt8Rows.serves_every_row_count(48),
    reason="the flat int8 layer runs where cpu_ops' int8 kernel serves every row count",
)
def test_the_flat_int8_layer_gives_its_modules_values_bit_for_bit(monkeypatch) -> None:
    """Int8DecoderLayer calls the kernels its modules call, in the same order: a prefill, a
    mixed step and decode steps (its direct paged-decode path, the whole stack in one call:
    Int8TextModel) give the same logits as the same layers run through their modules
    (FusedDecoderLayer, flat_layers=False), bit for bit."""
    config = flat_int8_config()
    weights = hf_model(config, seed=5).state_dict()
    flat = CustomBackend(config, weights, CPU, torch.float32, 256, "int8")
    modules = CustomBackend(config, weights, CPU, torch.float32, 256, "int8", flat_layers=False)
    assert all(type(layer) is Int8DecoderLayer for layer in flat.model.model.layers)
    assert all(type(layer) is FusedDecoderLayer for layer in modules.model.model.layers)
    assert type(flat.model.model) is Int8TextModel and type(modules.model.model) is TextModel
    stack_calls = []
    stack = torch.ops.gemma_cpu.int8_decoder_stack

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        stack_calls.append(x.shape[0])
        return stack(x, *args)

    monkeypatch.setattr(torch.ops.gemma_cpu, "int8_decoder_stack", counted)

    for a, b in zip(int8_script_logits(flat), int8_script_logits(modules), strict=True):
        assert torch.equal(a, b)
    assert stack_calls == [2, 2]  # the two pure decode steps, of two rows each


@needs_madvise
@pytest.mark.skipif(
    not PackedInt8Rows.serves_every_row_count(48),
    reason="the flat int8 layer runs where cpu_ops' int8 kernel serves every row count",
)
def test_the_int8_stack_reads_its_weights_from_huge_pages_with_the_same_values(
    monkeypatch,
) -> None:
    """CustomBackend places what a decode step streams on huge pages (engine/model/huge_pages):
    the int8 stack's packed weights, scales and norms, and the int8 head's packed rows, all in
    one mapping advised MADV_HUGEPAGE, where the kernels read them; the logits are those of
    the same backend left on PyTorch's allocator, bit for bit."""
    config = flat_int8_config()
    weights = hf_model(config, seed=9).state_dict()
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # a tiny model: place it all the same
    placed = CustomBackend(config, weights, CPU, torch.float32, 256, "int8")
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    unplaced = CustomBackend(config, weights, CPU, torch.float32, 256, "int8")
    stack = placed.model.model
    assert isinstance(stack, Int8TextModel) and placed.model.fast_head is not None
    head = placed.model.fast_head.packed_rows
    streamed = [t for t in stack.stack_args[0] if t is not None] + stack.stack_args[1]
    streamed += [head.tiles, head.scales, head.compensation]
    assert {mapping_of(t).span for t in streamed} == {mapping_of(head.tiles).span}
    assert "hg" in mapping_of(head.tiles).flags
    unplaced_head = unplaced.model.fast_head.packed_rows
    assert "hg" not in mapping_of(unplaced_head.tiles).flags
    for a, b in zip(int8_script_logits(placed), int8_script_logits(unplaced), strict=True):
        assert torch.equal(a, b)
