"""What one `Scheduler.schedule()` call decides: a plain record of the step, with everything
the model runner needs (each chunk's KV slots and held blocks, the block copies and page
mappings to apply first), handed back to `Scheduler.update()` after the step with what the
step produced (`StepResult`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from engine.kv.block_pool import Block
from engine.kv.block_tables import BlockCopy, ChunkKV
from engine.kv.manager import KVCacheManager
from engine.kv.session_eviction import KeyMass
from engine.request import FinishReason, Sequence, TokenLogprob


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence in this step: compute positions [start, start + num_new_tokens).

    `start` equals seq.num_computed_tokens during the step (the scheduler advances it in
    update()). `samples` is True when the chunk reaches the last known token, so the step
    yields this sequence's next token; a prefill chunk that stops short of it samples nothing,
    nor does the last chunk of a sequence with max_tokens 0.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    kv: ChunkKV  # where the chunk's K/V go and the keys it attends over

    @property
    def ends_prefill(self) -> bool:
        """The chunk reaches the last known token (it samples unless max_tokens is 0)."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """The step: decodes first, then prefill chunks (continuing ones, then new admissions)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)  # seq ids moved back to waiting this step
    # seq ids that finished or were aborted since the previous schedule(): backends and
    # detokenizers may drop per-sequence state for them.
    finished: list[int] = field(default_factory=list)
    # Applied by the runner, in order, before the forward writes any K/V: copy-on-write
    # block copies, and the pages of newly allocated multi-page blocks (SharedPages).
    block_copies: list[BlockCopy] = field(default_factory=list)
    page_assignments: list[Block] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute this step (there may still be finished ids to clean up)."""
        return not self.scheduled


@dataclass(frozen=True)
class StepResult:
    """What a step produced, for `Scheduler.update()`: the one place sequences change."""

    sampled: Mapping[int, int] = field(default_factory=dict)  # seq id -> its new token
    finished: Mapping[int, FinishReason] = field(default_factory=dict)  # seq id -> why
    # Per scheduled sequence, in the plan's order (engine.runner.RunnerOutput): the prompt
    # tokens it scored, and the attention mass its keys got where its chunk asked for it.
    prompt_logprobs: SequenceOf[list[TokenLogprob]] | None = None
    attention: SequenceOf[KeyMass] | None = None


def plan_of(kv: KVCacheManager, chunks: Iterable[tuple[Sequence, int]]) -> SchedulerOutput:
    """A step of these (sequence, new tokens) chunks, allocated already and each sampling at
    its end, as schedule() would hand it to the runner: for drivers that manage the KV cache
    themselves (evals, tests)."""
    scheduled = [
        ScheduledSeq(seq, seq.num_computed_tokens, count, True, kv.address(seq, count))
        for seq, count in chunks
    ]
    return SchedulerOutput(
        scheduled,
        block_copies=kv.take_block_copies(),
        page_assignments=kv.take_page_assignments(),
    )
