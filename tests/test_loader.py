"""Loading local checkpoint directories: Gemma 4 text, the text tower of a multimodal Gemma 4
checkpoint, and clear errors for what cannot be served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4TextConfig

from engine.backends.custom import CustomBackend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.model.batch import ForwardBatch, GroupAttention
from engine.model.loader import ModelLoadError, embedded_checkpoint_dir, load_model
from engine.request import Sequence
from engine.runner import ModelRunner
from engine.sched.config import SchedulerConfig
from tests.engine_harness import greedy, run
from tests.kv_invariants import assert_all_released
from tests.paged_driver import hf_greedy, hf_model

S, F = "sliding_attention", "full_attention"


def tiny_text_config(**overrides) -> Gemma4TextConfig:
    settings = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16,
        num_kv_shared_layers=1, hidden_size_per_layer_input=4, vocab_size_per_layer_input=97,
        sliding_window=4, max_position_embeddings=128, layer_types=[S, F, S, F],
    )  # fmt: skip
    settings.update(overrides)
    return Gemma4TextConfig(**settings)


@pytest.fixture(scope="module")
def reference() -> Gemma4ForCausalLM:
    """Random weights everywhere (norms and layer scalars too), eager attention."""
    return hf_model(tiny_text_config(), seed=0)


def copy_tokenizer(directory: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_checkpoint_dir() / name, directory / name)


def same_weights(loaded: dict[str, torch.Tensor], model: Gemma4ForCausalLM) -> None:
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(loaded) - {"lm_head.weight"} == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_gemma4_text_checkpoint_directory(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.model_id == tmp_path.name
    assert isinstance(loaded.config, Gemma4TextConfig)
    assert loaded.max_model_len == 128
    same_weights(loaded.state_dict, reference)
    # The loaded weights serve: our forward's prefill equals transformers' bit for bit.
    backend = CustomBackend(
        loaded.config, loaded.state_dict, torch.device("cpu"), torch.float32, 128
    )
    runner = ModelRunner(backend, num_blocks=4, block_size=4)
    tokens = [5, 17, 3, 88, 41, 9]
    slots = torch.arange(len(tokens))
    group = GroupAttention(
        slots, slots[None], slots[None], torch.ones(1, len(tokens), dtype=torch.bool)
    )
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens), positions=slots, query_start=[0, len(tokens)],
        groups={g.name: group for g in runner.cache_groups},
        logits_indices=torch.tensor([len(tokens) - 1]),
    )  # fmt: skip
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens]), logits_to_keep=torch.tensor([len(tokens) - 1]))
    assert torch.equal(runner.forward(batch).logits[0], theirs.logits[0, -1].float())


def test_the_engine_serves_a_gemma4_checkpoint_on_shared_pages(tmp_path, reference):
    """Full-attention layers twice as wide as sliding ones share the page pool: the two
    sliding layers split a lane, the full layer has one. Three sequences, past the window,
    in fewer pages than they would hold without it, generate
    what transformers generates for each alone, and every page comes back."""
    reference.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    backend = CustomBackend(
        loaded.config, loaded.state_dict, torch.device("cpu"), torch.float32, 128
    )
    engine = LLMEngine.for_model(
        loaded,
        backend,
        EngineConfig(
            # 48 tokens of 32 K elements (8 + 8 + 16): 24 pages of 4 tokens of 16. The three
            # hold 22 pages at their peak, 26 without the window.
            kv=KVConfig(block_size=4, max_active_tokens=48),
            scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16),
        ),
    )
    pools = engine.kv.pools
    assert (pools["full"].pages_per_block, pools["sliding"].pages_per_block) == (1, 1)
    assert engine.kv.stats()["shared_pages"]["total"] == 24
    prompts = [[2, 5, 17, 3, 88, 41, 9], [2, 60, 61, 62], [2, 5, 17, 3, 88, 30]]
    seqs = [Sequence(list(p), greedy(12)) for p in prompts]
    run(engine, seqs)
    for prompt, seq in zip(prompts, seqs, strict=True):
        theirs = hf_greedy(reference, prompt, 11)
        assert seq.output_token_ids == [int(x.argmax()) for x in theirs]
    assert engine.kv.stats()["window_freed_blocks"] > 0
    assert_all_released(engine.kv)


def test_text_tower_of_a_multimodal_checkpoint(tmp_path, reference):
    text = reference.config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(Gemma4Config(text_config=text).to_dict()))
    weights = {
        "model.language_model." + name.removeprefix("model."): tensor.contiguous()
        for name, tensor in reference.state_dict().items()
        if name != "lm_head.weight"
    }
    weights["model.vision_tower.patch_embedder.weight"] = torch.ones(2, 2)
    weights["model.embed_vision.embedding_projection.weight"] = torch.ones(2, 2)
    save_file(weights, str(tmp_path / "model.safetensors"))
    copy_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.config, Gemma4TextConfig)
    same_weights(loaded.state_dict, reference)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(str(tmp_path))


def test_missing_weights_are_named(tmp_path, reference):
    reference.config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(str(tmp_path))


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path))


def test_mixture_of_experts_is_refused_by_name(tmp_path):
    tiny_text_config(enable_moe_block=True, num_experts=4, top_k_experts=2).save_pretrained(
        tmp_path
    )
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        load_model(str(tmp_path))


def test_unknown_name_is_refused():
    with pytest.raises(ModelLoadError, match="unknown model 'gemma-9'"):
        load_model("gemma-9")
