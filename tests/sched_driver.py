"""Test helpers for the scheduler: real Sequences, a real KVCacheManager with a tiny block
count, and a stand-in for the engine step that "samples" a fixed token and stops at max_tokens."""

from __future__ import annotations

import itertools

from engine.kv.layout import CacheGroupSpec
from engine.kv.manager import KVCacheManager
from engine.request import FinishReason, Sequence
from engine.sampling import SamplingParams
from engine.sched import Scheduler, SchedulerConfig, SchedulerOutput, StepResult

SAMPLED_TOKEN = 7
_prompt_tokens = itertools.count(1000)  # distinct prompts: no accidental prefix-cache hits


def make_kv(
    num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = False
) -> KVCacheManager:
    group = CacheGroupSpec(name="full", layer_ids=(0,), sliding_window=None, bytes_per_token=8)
    return KVCacheManager([group], num_blocks, block_size, enable_prefix_caching=prefix_caching)


def make_seq(
    prompt_len: int,
    max_tokens: int = 4,
    tenant: str = "default",
    priority: int = 0,
    session_id: str | None = None,
    arrival_time: float | None = None,
    seed: int | None = None,
    **kwargs,
) -> Sequence:
    seq = Sequence(
        prompt_token_ids=[next(_prompt_tokens) for _ in range(prompt_len)],
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed),
        tenant=tenant,
        priority=priority,
        session_id=session_id,
        **kwargs,
    )
    if arrival_time is not None:
        seq.arrival_time = arrival_time
    return seq


def make_scheduler(kv: KVCacheManager | None = None, clock=None, **config) -> Scheduler:
    kwargs = {"clock": clock} if clock is not None else {}
    return Scheduler(SchedulerConfig(**config), kv or make_kv(), **kwargs)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """schedule() -> "model" -> update(): every sampling sequence gets SAMPLED_TOKEN and
    finishes with LENGTH at max_tokens."""
    out = sched.schedule()
    sampled, finished = {}, {}
    for item in out.scheduled:
        if item.samples:
            sampled[item.seq.seq_id] = SAMPLED_TOKEN
            if item.seq.num_output_tokens + 1 >= item.seq.sampling.max_tokens:
                finished[item.seq.seq_id] = FinishReason.LENGTH
    sched.update(out, StepResult(sampled, finished))
    return out


def plan(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    """The step as (seq_id, start, num_new_tokens, samples) tuples, in order."""
    return [(i.seq.seq_id, i.start, i.num_new_tokens, i.samples) for i in out.scheduled]


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
