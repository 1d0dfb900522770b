"""Helpers for the engine tests on the real embedded model (Gemma 3 270M, float32 on CPU).

- `shared_backend(loaded)`: one `custom` CPU backend per loaded model, shared by the engine test
  modules. Its weights are the loaded tensors; its KV cache is reallocated by every engine
  built on it, so only the newest engine over it may be stepped.
- `new_engine(loaded, scheduler=..., **kv)`: a fresh LLMEngine over that backend (cheap: no
  weights move).
- `one_torch_thread`: a module fixture the engine test modules use (see its docstring).
- `greedy_alone(loaded, prompt, n)`: the greedy tokens of a prompt generated with no other
  sequence, no prefix cache and its whole prompt in one step, on a second backend of its own;
  memoized, a shorter request being a prefix of a longer one (EOS is ignored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.backends import InferenceBackend, create_backend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.model.batch import ForwardBatch
from engine.model.loader import LoadedModel
from engine.request import Sequence, StepOutput
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig

# Short prompts of different lengths (6 to 25 tokens with BOS).
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
    "Water boils at a temperature of exactly",
    "The three primary colors are red, yellow and",
    "In 1969, the first person to walk on the Moon was Neil Armstrong. After the landing, he",
]

_backends: dict[tuple[int, str], InferenceBackend] = {}
_references: dict[tuple[int, tuple[int, ...]], list[int]] = {}


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """CPU matmuls on one thread for a module: on a two-core machine shared with other
    processes, OpenMP threads waiting on each other cost far more than a second core gains
    (measured: the engine tests take 2.5x less wall and half the CPU time)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def shared_backend(loaded: LoadedModel, role: str = "test") -> InferenceBackend:
    key = (id(loaded), role)
    if key not in _backends:
        _backends[key] = create_backend("custom", loaded, torch.device("cpu"), torch.float32)
    return _backends[key]


def new_engine(
    loaded: LoadedModel,
    role: str = "test",
    scheduler: SchedulerConfig | None = None,
    **kv: Any,
) -> LLMEngine:
    """An engine over the shared backend with `scheduler` and the KVConfig fields `kv`."""
    config = EngineConfig(scheduler=scheduler or SchedulerConfig(), kv=KVConfig(**kv))
    return LLMEngine.for_model(loaded, shared_backend(loaded, role), config)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens (EOS ignored), as the references use."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def encode(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer(text).input_ids


def long_prompt(loaded: LoadedModel, num_tokens: int, topic: str = "square") -> list[int]:
    """Exactly num_tokens token ids (BOS first) of varied text."""
    text = " ".join(f"Fact {i}: the {topic} of {i} is {i * i}." for i in range(num_tokens))
    ids = encode(loaded, text)[:num_tokens]
    assert len(ids) == num_tokens
    return ids


def run(engine: LLMEngine, seqs: list[Sequence] = ()) -> list[list[tuple[Sequence, StepOutput]]]:
    """Add seqs, step until the engine is idle; the outputs of every step."""
    for seq in seqs:
        assert engine.add(seq).accepted
    steps = []
    while engine.has_work:
        steps.append(engine.step())
    return steps


def greedy_alone(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    key = (id(loaded), tuple(prompt))
    known = _references.get(key, [])
    if len(known) < max_tokens:
        engine = new_engine(
            loaded,
            role="reference",
            max_active_tokens=len(prompt) + max_tokens + 64,
            scheduler=SchedulerConfig(max_num_batched_tokens=max(512, len(prompt))),
            enable_prefix_caching=False,
        )
        seq = Sequence(list(prompt), greedy(max_tokens))
        steps = run(engine, [seq])
        assert all(len(outputs) == 1 for outputs in steps)  # alone, in one prefill step
        assert len(steps) == max_tokens
        _references[key] = known = list(seq.output_token_ids)
    return known[:max_tokens]


@contextlib.contextmanager
def recorded_forwards(runner: ModelRunner) -> Iterator[list[ForwardBatch]]:
    """Every ForwardBatch the runner runs inside the block (the real forward still runs)."""
    batches: list[ForwardBatch] = []
    forward = runner.forward

    def recording(batch: ForwardBatch, greedy: bool = False):
        batches.append(batch)
        return forward(batch, greedy=greedy)

    runner.forward = recording  # type: ignore[method-assign]
    try:
        yield batches
    finally:
        del runner.forward  # back to the class's method
