"""Prompt logprobs through the whole engine on every device this machine has (CPU, and CUDA
where present), on a tiny random-weight Gemma 3 against transformers' model on the same
device: the scored rows' logits are made a slice at a time on the device the model runs on.

Needs no server and no checkpoint (a word-level tokenizer is built in place), so it also runs
with `pytest --noconftest` on a machine that has only the engine's own dependencies.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import Gemma3TextConfig, PreTrainedTokenizerFast

from engine.backends.custom import CustomBackend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.prompt_logprobs import SLICE_ROWS
from engine.request import FinishReason, Sequence
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from tests.paged_driver import hf_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 131


def _config() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=8, max_position_embeddings=256, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=4.0,
    )  # fmt: skip


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w3")),
        bos_token="w2", eos_token="w1", unk_token="w3", pad_token="w0",
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_logprobs_match_transformers_on_the_device(device):
    config = _config()
    reference = hf_model(config, seed=5).to(device)
    backend = CustomBackend(
        config, reference.state_dict(), torch.device(device), torch.float32, 256
    )
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512),
        kv=KVConfig(max_active_tokens=2048),
    )
    engine = LLMEngine(backend, _tokenizer(), [1], engine_config)
    generator = torch.Generator().manual_seed(6)
    # Longer than one slice, so a full slice and a padded one are both made.
    prompt = [2, *torch.randint(4, VOCAB, (SLICE_ROWS + 9,), generator=generator).tolist()]
    scoring = Sequence(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    sampling = Sequence(
        prompt[:7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0)
    )
    for seq in (scoring, sampling):
        engine.add(seq)
    outputs: dict[int, list] = {scoring.seq_id: [], sampling.seq_id: []}
    while engine.has_work:
        for seq, out in engine.step():
            outputs[seq.seq_id].append(out)

    with torch.no_grad():
        logits = reference(torch.tensor([prompt], device=device)).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1).cpu()
    (scored,) = outputs[scoring.seq_id]
    assert scored.new_token_ids == [] and scored.finish_reason is FinishReason.LENGTH
    entries = scored.prompt_logprobs
    assert [e.token_id for e in entries] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries])
    want = torch.stack([expected[p, prompt[p + 1]] for p in range(len(prompt) - 1)])
    if device == "cpu":
        assert torch.equal(got, want)
    else:  # cuBLAS picks kernels by shape: a slice's rows may round differently
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
    for position, entry in enumerate(entries):
        row = expected[position]
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
        assert entry.rank == int((row > row[prompt[position + 1]]).sum()) + 1
    # A sampling sequence gets its prompt's logprobs once, with its first token.
    first, *rest = outputs[sampling.seq_id]
    assert len(first.prompt_logprobs) == 6 and all(o.prompt_logprobs is None for o in rest)
    assert len(rest) == 2
