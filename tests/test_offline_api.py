"""The offline API (engine.offline.LLM) on the real embedded Gemma 3 270M: seeded sampling,
stop strings, input validation and logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, KVConfig
from engine.model.loader import ModelLoadError
from engine.offline import LLM
from engine.request import FinishReason, Sequence
from engine.sampling import InvalidRequestError, SamplingParams
from engine.sched.config import SchedulerConfig
from engine.sched.output import plan_of
from tests.engine_harness import one_torch_thread  # noqa: F401 (a fixture)
from tests.kv_invariants import assert_all_released

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KV_TOKENS = 2048


@pytest.fixture(scope="module")
def llm(embedded_model) -> LLM:
    return LLM(
        embedded_model,
        device="cpu",
        weights="fp32",  # exact: the logprob tests compare against a separate forward
        config=EngineConfig(
            kv=KVConfig(max_active_tokens=KV_TOKENS), scheduler=SchedulerConfig(max_queue_len=2)
        ),
    )


def _sampled(seed: int | None, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=seed)


def test_seeded_sampling_repeats_alone_and_batched_and_depends_on_the_seed(llm):
    prompt = "My favourite animal is the"
    alone = llm.generate(prompt, _sampled(1234))[0]
    assert len(alone.token_ids) == 8 and alone.finish_reason is FinishReason.LENGTH

    # The same request among others (an unseeded sampled one, a greedy one, another seed);
    # more prompts than max_queue_len=2, so they are fed in as the queue drains.
    batch = llm.generate(
        ["Tell me a story about", prompt, "The capital of Italy is", prompt],
        [
            _sampled(None),
            _sampled(1234),
            SamplingParams(max_tokens=8, temperature=0),
            _sampled(4321),
        ],
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].text == alone.text
    assert batch[3].token_ids != alone.token_ids
    assert_all_released(llm.engine.kv)


def test_stop_string_cuts_the_text_where_it_starts(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert full.finish_reason is FinishReason.LENGTH
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    # A stop string known to occur, starting mid-text (and possibly mid-token).
    stop = full.text[len(full.text) // 3 :][:6]
    cut = full.text.find(stop)
    assert cut > 0

    stopped, kept = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
            SamplingParams(
                max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                include_stop_str_in_output=True,
            ),
        ],
    )  # fmt: skip
    assert stopped.text == full.text[:cut]
    assert stopped.finish_reason is FinishReason.STOP
    assert kept.text == full.text[: cut + len(stop)]
    assert kept.finish_reason is FinishReason.STOP
    # Generation ended with the token that completed the stop string.
    for result in (stopped, kept):
        assert result.token_ids == full.token_ids[: len(result.token_ids)]
        completed = llm.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert stop in completed
        assert stop not in llm.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)


def test_bad_inputs_raise_clear_errors(llm):
    vocab = llm.engine.backend.vocab_size

    def refused(param: str, *args) -> InvalidRequestError:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(*args)
        assert info.value.param == param, info.value
        return info.value

    assert "empty" in str(refused("prompt", ""))
    assert "empty" in str(refused("prompt", []))
    assert "empty" in str(refused("prompt", [[]]))
    for bad in ([2, vocab], [2, -1], [2, 1.5]):
        assert str(vocab) in str(refused("prompt", [bad]))
    too_long = refused(
        "max_tokens", [2] * (llm.engine.max_model_len - 3), SamplingParams(max_tokens=4)
    )
    assert str(llm.engine.max_model_len) in str(too_long)
    # Fits the context but never the KV cache: refused, and nothing of the batch stays queued.
    # (One sequence alone may hold more than KV_TOKENS: past the window, sliding layers keep
    # only a window of it.)
    capacity = llm.engine.scheduler.kv_capacity_tokens
    assert KV_TOKENS < capacity < llm.engine.max_model_len - 4
    too_large = refused("prompt", ["Hello", [2] * capacity], SamplingParams(max_tokens=4))
    assert str(capacity) in str(too_large)
    assert not llm.engine.has_work

    for kwargs, param in [
        ({"max_tokens": -1}, "max_tokens"),  # 0 is allowed: the prompt alone is computed
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == param
        assert str(kwargs[param]) in str(info.value)
    SamplingParams(top_p=1.0), SamplingParams(top_p=0.0)  # both bounds are allowed
    mutated = SamplingParams(max_tokens=4)
    mutated.top_p = 2.0
    refused("top_p", "Hello", mutated)

    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM("no-such-model", device="cpu")
    assert_all_released(llm.engine.kv)


def _prefill_logits(llm: LLM, token_ids: list[int], first_row: int) -> torch.Tensor:
    """Next-token logits of rows first_row.. of one plain prefill over token_ids, run on the
    engine's backend in fresh KV blocks that are released afterwards."""
    seq = Sequence(list(token_ids), SamplingParams(max_tokens=1))
    kv = llm.engine.kv
    assert kv.allocate(seq, len(token_ids))
    try:
        runner = llm.engine.runner
        batch = runner.prepare(plan_of(kv, [(seq, len(token_ids))]))
        batch.logits_indices = torch.arange(first_row, len(token_ids))
        return runner.forward(batch).logits
    finally:
        kv.free(seq)


def test_logprobs_equal_log_softmax_of_a_separate_forward(llm):
    prompt = llm.encode("The largest planet in the solar system is")
    result = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    tokens = result.token_ids
    assert [lp.token_id for lp in result.logprobs] == tokens

    logits = _prefill_logits(llm, prompt + tokens[:-1], len(prompt) - 1)
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert expected.shape[0] == len(tokens)
    for row, (token, lp) in enumerate(zip(tokens, result.logprobs, strict=True)):
        assert lp.logprob == pytest.approx(expected[row, token].item(), abs=1e-4)
        assert token == int(expected[row].argmax())  # greedy
        top_values, top_ids = expected[row].topk(3)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert lp.top[0] == (token, lp.logprob)
    assert_all_released(llm.engine.kv)
