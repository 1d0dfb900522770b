"""What one `Scheduler.schedule()` call decides: a plain record the engine turns into a
ForwardBatch and hands back to `Scheduler.update()` after the step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Sequence


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

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute this step (there may still be finished ids to clean up)."""
        return not self.scheduled
