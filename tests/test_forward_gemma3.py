"""Our Gemma 3 forward over the paged cache against transformers' Gemma3ForCausalLM (eager
attention, float32 on CPU), on tiny random-weight configs and on the real Gemma 3 270M.

The exact comparisons use transformers' eager attention: our prefill follows its order of
operations (keys repeated per query head), so prefill logits are equal bit for bit.
Decode is bit-exact too when every query head has its own KV head. With grouped-query
attention our decode folds the query heads of a KV head into one matmul (no per-head copy of
the cache); the matmul then has G rows instead of 1 and the float sums round differently, so
those runs are bounded tightly instead and must pick the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

from engine.backends import create_backend
from engine.backends.custom import CustomBackend
from engine.backends.hf import HFBackend
from engine.model.architecture import architecture_from_config
from tests.forward_contract import (  # noqa: F401  (shared tests, collected in this module too)
    prompt,
    test_hf_backend_matches_custom_on_a_mixed_batch,
    test_scattered_blocks_give_the_same_logits,
)
from tests.paged_driver import PagedDriver, engine_greedy, hf_greedy, hf_model

CPU = torch.device("cpu")
DECODE_STEPS = 64


def gqa_config() -> Gemma3TextConfig:
    """Grouped-query attention, QK-norm, sliding + full layers with linear-scaled RoPE on the full
    ones, both softcaps, an untied LM head, query_pre_attn_scalar != head_dim."""
    return Gemma3TextConfig(
        vocab_size=131,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
        },
        final_logit_softcapping=4.0,
        attn_logit_softcapping=3.0,
    )


def mha_config() -> Gemma3TextConfig:
    """One KV head per query head, tied embeddings, no softcaps."""
    return Gemma3TextConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=5,
        max_position_embeddings=256,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
    )


CONFIGS = {"gqa": gqa_config, "mha": mha_config}


def hf_kwargs(config: Gemma3TextConfig) -> dict:
    # transformers' Gemma 3 ignores config.attn_logit_softcapping (only Gemma 2 passed it on);
    # we apply it as configured, and hand it to transformers' eager attention explicitly.
    cap = config.attn_logit_softcapping
    return {} if cap is None else {"softcap": cap}


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request):
    config = CONFIGS[request.param]()
    reference = hf_model(config, seed=1)
    return request.param, config, reference, reference.state_dict()


@pytest.mark.parametrize("backend_class", [CustomBackend, HFBackend])
def test_prefill_equals_transformers_bit_for_bit(setup, backend_class):
    _, config, reference, weights = setup
    backend = backend_class(config, weights, CPU, torch.float32, 256)
    tokens = prompt(14, seed=2, vocab=config.vocab_size)  # longer than the sliding window
    logits, _ = PagedDriver(backend, shuffle_blocks=3).step({0: tokens}, all_logits=True)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens]), **hf_kwargs(config)).logits[0]
    assert torch.equal(logits[0], expected)


def test_decode_over_paged_cache_matches_dynamic_cache(setup):
    name, config, reference, weights = setup
    backend = CustomBackend(config, weights, CPU, torch.float32, 256)
    tokens = prompt(9, seed=4, vocab=config.vocab_size)
    ours = engine_greedy(PagedDriver(backend, shuffle_blocks=5), {0: tokens}, DECODE_STEPS)[0]
    theirs = hf_greedy(reference, tokens, DECODE_STEPS, **hf_kwargs(config))
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
        0: prompt(5, 10, config.vocab_size),
        1: prompt(13, 11, config.vocab_size),
        2: prompt(8, 12, config.vocab_size),
    }
    # Sequences 0 and 1 prefill together; 2 joins at step 3 next to their decodes (a mixed batch).
    together = engine_greedy(
        PagedDriver(backend, num_blocks=128, shuffle_blocks=6),
        {0: prompts[0], 1: prompts[1]},
        20,
        joins={3: {2: prompts[2]}},
    )
    for seq, tokens in prompts.items():
        alone = engine_greedy(PagedDriver(backend, num_blocks=128), {seq: tokens}, 20)[seq]
        assert [int(x.argmax()) for x in together[seq]] == [int(x.argmax()) for x in alone]
        pairs = zip(together[seq], alone, strict=True)
        assert max((a - b).abs().max().item() for a, b in pairs) < 2e-5


def test_bidirectional_attention_is_rejected():
    config = mha_config()
    config.use_bidirectional_attention = True
    with pytest.raises(NotImplementedError, match="bidirectional"):
        architecture_from_config(config)


# --- the real embedded Gemma 3 270M ---------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    from engine.model.loader import load_model

    loaded = load_model("gemma-3-270m", torch.float32)
    reference = hf_model(loaded.config, state_dict=loaded.state_dict)
    return loaded, reference


def test_real_model_prefill_bit_exact_and_greedy_decode(real):
    loaded, reference = real
    backend = create_backend("custom", loaded, CPU, torch.float32)
    tokens = loaded.tokenizer("The capital of France is")["input_ids"]
    logits, _ = PagedDriver(backend, block_size=16).step({0: tokens}, all_logits=True)
    with torch.no_grad():
        assert torch.equal(logits[0], reference(torch.tensor([tokens])).logits[0])

    # 1 KV head for 4 query heads: decode is folded (see the module docstring), so bounded.
    ours = engine_greedy(
        PagedDriver(backend, block_size=16, shuffle_blocks=9), {0: tokens}, DECODE_STEPS
    )[0]
    theirs = hf_greedy(reference, tokens, DECODE_STEPS)
    assert [int(x.argmax()) for x in ours] == [int(x.argmax()) for x in theirs]
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_real_model_hf_backend_matches_custom(real):
    loaded, _ = real
    prompts = {
        0: loaded.tokenizer("Hello, my name is")["input_ids"],
        1: loaded.tokenizer("1, 2, 3,")["input_ids"],
    }
    results = [
        engine_greedy(
            PagedDriver(create_backend(kind, loaded, CPU, torch.float32), block_size=16), prompts, 4
        )
        for kind in ("custom", "hf")
    ]
    for seq in prompts:
        assert all(torch.equal(a, b) for a, b in zip(results[0][seq], results[1][seq], strict=True))


@pytest.mark.parametrize("weights", ["auto", "fp32", "bf16", "bf16-int8head", "int8"])
def test_both_backends_take_every_weights_mode(setup, weights):
    """Every WEIGHTS mode this CPU offers builds under both backends, with the same kernel for
    the layers and for the LM head (bf16-int8head splits them), and they agree."""
    from engine.model.cpu_features import has_bf16
    from engine.model.kernel_select import body_and_head, kernel_for

    if weights.startswith("bf16") and not has_bf16():
        pytest.skip("this CPU has no oneDNN bfloat16 GEMM")
    _, config, _, weights_dict = setup
    kernel = kernel_for(weights, "fast", CPU)
    backends = [cls(config, weights_dict, CPU, torch.float32, 256, kernel) for cls in
                (CustomBackend, HFBackend)]  # fmt: skip
    head_kernel = body_and_head(kernel)[1]
    heads = [backends[0].model.fast_head, backends[1].model.get_output_embeddings()]
    if head_kernel not in ("exact", "packed"):
        assert type(heads[0]) is type(heads[1])
    # Each near its own exact forward (transformers' Gemma 3 ignores the attention softcap,
    # so the two backends are compared each with itself).
    tokens = prompt(12, seed=40, vocab=config.vocab_size)
    for backend in backends:
        exact = type(backend)(config, weights_dict, CPU, torch.float32, 256)
        got, want = (PagedDriver(b).step({0: tokens}, all_logits=True)[0][0]
                     for b in (backend, exact))  # fmt: skip
        # Tiny random weights amplify quantization error: bounded loosely, on average.
        assert (got - want).abs().mean() < 0.1
