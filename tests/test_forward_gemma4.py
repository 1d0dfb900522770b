"""Our Gemma 4 forward over the paged cache against transformers' Gemma4ForCausalLM (eager
attention, float32 on CPU), on tiny random-weight configs built with Gemma4TextConfig that
between them switch on every text-model feature: per-layer head sizes (global_head_dim),
separate KV-head counts on full layers, k=v attention, V-norm, KV sharing across the last
layers, per-layer embeddings (PLE), the double-wide MLP, proportional partial RoPE, final
logit softcapping, layer scalars.

As for Gemma 3 (see tests/test_forward_gemma3.py): prefill is bit-exact; decode is bit-exact
when every query head has its own KV head, otherwise bounded tightly with equal greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4TextConfig

from engine.backends.custom import CustomBackend
from engine.backends.hf import HFBackend
from engine.model.architecture import architecture_from_config
from engine.model.int8_kernels import DynamicInt8Linear, Int8GatedMLP
from engine.model.kernel_select import (
    int8_linear_class,
    make_fused_mlp,
    make_linear,
    quantize_model,
)
from engine.model.linear_kernels import BFloat16GatedMLP
from engine.model.optimize import GateUpMLP
from engine.runner import ModelRunner
from tests.conftest import bf16_param
from tests.forward_contract import (  # noqa: F401  (shared tests, collected in this module too)
    prompt,
    test_hf_backend_matches_custom_on_a_mixed_batch,
    test_scattered_blocks_give_the_same_logits,
)
from tests.paged_driver import PagedDriver, engine_greedy, hf_greedy, hf_model

CPU = torch.device("cpu")
DECODE_STEPS = 64
S, F = "sliding_attention", "full_attention"


def full_featured_config() -> Gemma4TextConfig:
    """Layers 5 and 6 reuse the K/V of layers 3 (sliding) and 4 (full)."""
    return Gemma4TextConfig(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=101,
        use_double_wide_mlp=True,
        final_logit_softcapping=5.0,
        sliding_window=6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        layer_types=[S, F, S, S, F, S, F],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "factor": 2.0,
                "rope_theta": 20_000.0,
            },
        },
    )


def mha_config() -> Gemma4TextConfig:
    """One KV head per query head; KV sharing without PLE or k=v; default RoPE settings."""
    return Gemma4TextConfig(
        vocab_size=89,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
        sliding_window=5,
        max_position_embeddings=256,
        layer_types=[S, F, S, S, F],
    )


CONFIGS = {"full_featured": full_featured_config, "mha": mha_config}


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request):
    config = CONFIGS[request.param]()
    reference = hf_model(config, seed=1)
    return request.param, config, reference, reference.state_dict()


def test_configs_switch_on_every_feature():
    arch = architecture_from_config(full_featured_config())
    assert [spec.stores_kv for spec in arch.layers] == [True] * 5 + [False] * 2
    assert [spec.kv_source for spec in arch.layers] == [0, 1, 2, 3, 4, 3, 4]
    assert [spec.head_dim for spec in arch.layers] == [8, 16, 8, 8, 16, 8, 16]
    assert [spec.num_kv_heads for spec in arch.layers] == [2, 1, 2, 2, 1, 2, 1]
    assert [spec.k_eq_v for spec in arch.layers] == [False, True, False, False, True, False, True]
    assert [spec.intermediate_size for spec in arch.layers] == [64] * 5 + [128] * 2
    assert (
        arch.per_layer_input_size == 8 and arch.rope["full_attention"].rope_type == "proportional"
    )


@pytest.mark.parametrize("backend_class", [CustomBackend, HFBackend])
def test_prefill_equals_transformers_bit_for_bit(setup, backend_class):
    _, config, reference, weights = setup
    backend = backend_class(config, weights, CPU, torch.float32, 256)
    tokens = prompt(15, seed=2, vocab=config.vocab_size)  # longer than the sliding window
    logits, _ = PagedDriver(backend, shuffle_blocks=3).step({0: tokens}, all_logits=True)
    with torch.no_grad():
        # Rows as an index: with an int, transformers slices rows before its KV-shared layers,
        # and fails doing so for configs without PLE.
        expected = reference(
            torch.tensor([tokens]), logits_to_keep=torch.arange(len(tokens))
        ).logits[0]
    assert torch.equal(logits[0], expected)


def test_decode_over_paged_cache_matches_dynamic_cache(setup):
    name, config, reference, weights = setup
    backend = CustomBackend(config, weights, CPU, torch.float32, 256)
    tokens = prompt(9, seed=4, vocab=config.vocab_size)
    ours = engine_greedy(PagedDriver(backend, shuffle_blocks=5), {0: tokens}, DECODE_STEPS)[0]
    theirs = hf_greedy(reference, tokens, DECODE_STEPS)
    assert [int(x.argmax()) for x in ours] == [int(x.argmax()) for x in theirs]
    assert torch.equal(ours[0], theirs[0])  # the prefill
    if name == "mha":
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    else:
        assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 2e-5


def test_batch_of_different_lengths_matches_each_alone(setup):
    _, config, _, weights = setup
    backend = CustomBackend(config, weights, CPU, torch.float32, 256)
    prompts = {
        0: prompt(4, 10, config.vocab_size),
        1: prompt(12, 11, config.vocab_size),
        2: prompt(7, 12, config.vocab_size),
    }
    together = engine_greedy(
        PagedDriver(backend, num_blocks=128, shuffle_blocks=6),
        {0: prompts[0], 1: prompts[1]},
        20,
        joins={2: {2: prompts[2]}},
    )
    for seq, tokens in prompts.items():
        alone = engine_greedy(PagedDriver(backend, num_blocks=128), {seq: tokens}, 20)[seq]
        assert [int(x.argmax()) for x in together[seq]] == [int(x.argmax()) for x in alone]
        pairs = zip(together[seq], alone, strict=True)
        assert max((a - b).abs().max().item() for a, b in pairs) < 2e-5


@pytest.mark.parametrize("kernel", ["packed", bf16_param("bf16"), "int8"])
def test_fused_projections_compute_what_separate_ones_do(setup, kernel):
    """The approximate kernels run q/k(/v) and gate/up as one linear each (bf16: the whole MLP as
    one module, gelu and product inside its GEMMs): on k=v, KV-shared and double-wide layers
    alike, fed the same tokens, the logits equal those of the same kernel on separate linears:
    bit for bit in fbgemm's int8, whose per-channel rows quantize alike; to float rounding in
    packed and in oneDNN's int8, whose rescale to float32 depends on the GEMM's shape. In bf16
    the fused MLP rounds at other places (its gelu sees float32 sums), so both are held to
    float32 instead: each step within 5% of it, the fused no further on average than the
    separate linears (both measured 1.5% here)."""
    _, config, _, weights = setup
    # The separate linears' eager norms, RoPE and residual adds on both sides.
    fused = CustomBackend(config, weights, CPU, torch.float32, 256, kernel, fuse_ops=False)
    mlps = [layer.mlp for layer in fused.model.model.layers]
    # int8 on cpu_ops' VNNI kernel without AMX: the whole MLP as one module too, its gelu
    # cpu_ops' own (the last bits can differ from ATen's).
    int8_mlp = kernel == "int8" and make_fused_mlp("int8", *[torch.ones(64, 64)] * 3) is not None
    whole = {"bf16": BFloat16GatedMLP, "int8": Int8GatedMLP if int8_mlp else GateUpMLP}
    assert all(isinstance(mlp, whole.get(kernel, GateUpMLP)) for mlp in mlps)
    separate = CustomBackend(config, weights, CPU, torch.float32, 256)
    quantize_model(separate.model.model, kernel)
    separate.model.fast_head = make_linear(kernel, separate.model.lm_head_weight)
    separate.exact = False  # the same (fused) attention as the approximate kernels run
    tokens = prompt(15, seed=7, vocab=config.vocab_size)
    # The same continuation fed to each: greedy paths would part at the first near-tie.
    continuation = prompt(8, seed=8, vocab=config.vocab_size)

    def forced(backend: CustomBackend) -> list[torch.Tensor]:
        driver = PagedDriver(backend)
        return [driver.step({0: ids})[0][0][-1] for ids in [tokens, *([t] for t in continuation)]]

    fused_logits, separate_logits = forced(fused), forced(separate)
    if kernel == "bf16":
        exact = forced(CustomBackend(config, weights, CPU, torch.float32, 256))

        def errors(logits: list[torch.Tensor]) -> list[float]:
            return [((a - e).norm() / e.norm()).item() for a, e in zip(logits, exact, strict=True)]

        fused_errors, separate_errors = errors(fused_logits), errors(separate_logits)
        assert max(fused_errors + separate_errors) < 0.05
        assert sum(fused_errors) <= 1.25 * sum(separate_errors), (fused_errors, separate_errors)
        return
    for a, b in zip(fused_logits, separate_logits, strict=True):
        if int8_mlp:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        elif kernel == "int8" and int8_linear_class() is DynamicInt8Linear:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kv_shared_layers_store_nothing(setup):
    _, config, _, weights = setup
    backend = CustomBackend(config, weights, CPU, torch.float32, 256)
    runner = ModelRunner(backend, 8, 4)
    stored = sorted(runner.kv_cache.keys)
    assert stored == [spec.index for spec in backend.arch.layers if spec.stores_kv]
    assert sum(len(group.layer_ids) for group in runner.cache_groups) == len(stored)


def test_mixture_of_experts_is_rejected_by_name():
    config = mha_config()
    (
        config.enable_moe_block,
        config.num_experts,
        config.top_k_experts,
        config.moe_intermediate_size,
    ) = True, 4, 2, 16
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        CustomBackend(config, {}, CPU, torch.float32, 256)
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        HFBackend(config, {}, CPU, torch.float32, 256)


def test_bidirectional_attention_is_rejected():
    config = mha_config()
    config.use_bidirectional_attention = "all"
    with pytest.raises(NotImplementedError, match="bidirectional"):
        architecture_from_config(config)


@pytest.mark.parametrize("backend_class", [CustomBackend, HFBackend])
def test_checkpoint_without_layer_scalars_and_with_shared_kv_weights(backend_class):
    """Absent layer scalars mean 1 (as transformers initializes them); K/V weights a checkpoint
    carries for KV-shared layers are ignored (those layers have none)."""
    config = full_featured_config()
    weights = {
        k: v
        for k, v in hf_model(config, seed=3).state_dict().items()
        if not k.endswith("layer_scalar")
    }
    weights["model.layers.5.self_attn.k_proj.weight"] = torch.ones(16, 48)
    reference = hf_model(config, state_dict=weights)
    assert all(float(layer.layer_scalar) == 1.0 for layer in reference.model.layers)
    tokens = prompt(6, seed=9, vocab=config.vocab_size)
    logits, _ = PagedDriver(backend_class(config, weights, CPU, torch.float32, 256)).step(
        {0: tokens}, all_logits=True
    )
    with torch.no_grad():
        assert torch.equal(
            logits[0], reference(torch.tensor([tokens]), logits_to_keep=torch.arange(6)).logits[0]
        )
