"""Greedy steps on the embedded Gemma 3 270M with the int8 LM head take their tokens from the
head's own argmax (EngineConfig.greedy_head), never writing the logits: the tokens are those
the logits and the sampler give, and a step with a row that needs the logits takes them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.config import EngineConfig, KVConfig
from engine.model import cpu_ops
from engine.offline import LLM
from engine.sampling import SamplingParams
from tests.engine_harness import one_torch_thread  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not cpu_ops.packed_linear_supported(torch.int8),
        reason="this CPU build has no int8 packed kernel",
    ),
]

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def llm(embedded_model) -> LLM:
    return LLM(
        embedded_model,
        device="cpu",
        weights="int8",
        numerics="fast",
        config=EngineConfig(kv=KVConfig(max_active_tokens=4096, enable_prefix_caching=False)),
    )


def head_calls(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by the row count of every call of the backend's logits."""
    calls: list[int] = []
    logits = llm.engine.backend.logits

    def counted(hidden, out=None):
        calls.append(hidden.shape[0])
        return logits(hidden, out)

    monkeypatch.setattr(llm.engine.backend, "logits", counted)
    return calls


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[str]:
    """As many prompts as the int8 head's kernel serves rows, at most 9: more than the kernel's
    register blocks (6 rows), so that the step runs two blocks, or AMX tiles where it has them
    (PackedInt8Rows)."""
    head = llm.engine.backend.model.fast_head
    rows = min(9, head.packed_rows.max_rows or 9)
    return [f"Item {i}: the best thing about the number {i} is" for i in range(rows)]


def generate(llm: LLM, prompts: list[str], greedy_head: bool, params) -> list:
    llm.engine.config = replace(llm.engine.config, greedy_head=greedy_head)
    return llm.generate(prompts, params)


def test_greedy_steps_give_the_samplers_tokens_without_logits(llm, prompts, monkeypatch) -> None:
    calls = head_calls(llm, monkeypatch)
    fused = generate(llm, prompts, True, GREEDY)
    assert calls == []
    plain = generate(llm, prompts, False, GREEDY)
    assert calls and max(calls) == len(prompts)
    assert [r.token_ids for r in fused] == [r.token_ids for r in plain]
    assert all(len(r.token_ids) == GREEDY.max_tokens or r.finish_reason.value == "stop"
               for r in fused)  # fmt: skip


def test_a_row_that_needs_the_logits_takes_them_for_the_whole_step(
    llm, prompts, monkeypatch
) -> None:
    """One row asks for logprobs: every step computes the logits, that row gets its logprobs
    and every row the same tokens as in the all-greedy run."""
    alone = generate(llm, prompts, True, GREEDY)
    calls = head_calls(llm, monkeypatch)
    params = [GREEDY] * (len(prompts) - 1) + [replace(GREEDY, logprobs=2)]
    mixed = generate(llm, prompts, True, params)
    assert calls
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    assert len(mixed[-1].logprobs) == len(mixed[-1].token_ids)
    assert mixed[0].logprobs == []
