"""The continuous-batching scheduler: admission, iteration-level batching with chunked
prefill under a token budget, KV-aware preemption, and fairness accounting.

How the engine drives it, once per step:

    result = sched.add(seq)                  # any time; refused requests get a reason
    out = sched.schedule()                   # what to compute this step
    ... run out (each scheduled chunk carries its positions start .. start+n-1 and its KV
        slots and blocks), sample a token for every item with `samples`, decide stops
    sched.update(out, StepResult(sampled, finished, ...))  # append, advance, commit, retire
    sched.abort(seq_id)                      # any time between steps: the client went away

The split: the engine computes and decides; the scheduler changes state. update() appends
the sampled tokens, advances seq.num_computed_tokens, commits KV blocks and retires finished
sequences; schedule() charges the fairness counters when the tokens are scheduled.

Every public method takes one lock, so stats() may be read (and add() or abort() called)
from another thread while the engine loop runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

from engine.kv.manager import KVCacheManager
from engine.request import FinishReason, Sequence, SequenceStatus
from engine.sched.admission import AddResult, Admission
from engine.sched.config import MAX_AUTO_BATCH, SchedulerConfig
from engine.sched.output import ScheduledSeq, SchedulerOutput, StepResult
from engine.sched.policy import make_policy
from engine.sched.stats import SchedulerStats, ServiceCharges, TenantLedger, tenant_stats
from engine.sched.tenants import IdleTenants


def _prefilling(seq: Sequence) -> bool:
    """Whether a running seq still has prompt (or recomputed) tokens beyond its next one."""
    return seq.num_tokens - seq.num_computed_tokens > 1


def _urgency(seq: Sequence) -> tuple[int, float, int]:
    """Sort key, most urgent first: lower priority value, then earlier arrival, then the
    smaller seq id."""
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    """Decides, step by step, which tokens of which sequences the model computes.

    Each schedule():
      1. Every running decode gets its 1 token, most urgent first (_urgency).
      2. The rest of the token budget (max_num_batched_tokens) goes out as prefill chunks,
         one sequence at a time, each getting as much as is left: to running sequences still
         prefilling and, while fewer than max_num_seqs run, the policy's pick from the
         waiting queue (admitted with its first chunk), in the order _next_prefill gives.
         When the policy's pick does not fit the KV cache, admission stops for this step, so
         a large request is not starved by smaller ones. Once the step's prefill chunks hold
         prefill_group_tokens, no further sequence joins it.
    A long prompt is thus prefilled over several steps and never delays anyone's next token.
    A seeded request's last prompt token gets a step of its own (_prefill_chunk).

    Preemption: a running sequence's prefill chunk shrinks to the KV blocks free; when not
    even one of its tokens fits, the least urgent running sequence not yet scheduled in this
    step is preempted, possibly the sequence itself; repeat until something fits or the
    sequence was the victim. Decodes come before prefill chunks, so a decode never loses its
    blocks to a chunk. A preempted sequence frees its blocks, restarts from
    num_computed_tokens = 0 (recomputed later, helped by the prefix cache) and goes back to
    the front of the waiting queue; it is never dropped. Waiting sequences never preempt.

    Fairness: tenants are charged as chunks are scheduled (engine.sched.stats.ServiceCharges).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.max_num_seqs = config.max_num_seqs or MAX_AUTO_BATCH
        self.kv = kv
        self.policy = make_policy(config.policy, config.token_cost)
        self._clock = clock
        self._lock = threading.RLock()
        self.waiting: list[Sequence] = []  # queue order; preempted sequences re-enter at the front
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}  # accepted and not retired, by seq id
        self._finished_ids: list[int] = []  # retired since the last schedule()
        self.admission = Admission(config)
        self.ledger = TenantLedger(config.token_cost)
        self._charges = ServiceCharges(self.policy, self.ledger)
        self._idle_tenants = IdleTenants(config.tenant_idle_s, config.max_idle_tenants)
        self.num_retired_tenants = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0

    # ------------------------------------------------------------------ capacity

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of context the KV cache holds (the primary group's blocks times the block
        size; sliding-window groups only ever hold a window per sequence)."""
        return self.kv.max_blocks_per_sequence * self.kv.block_size

    # ------------------------------------------------------------------ requests

    def holding(self) -> AbstractContextManager[bool]:
        """The scheduler's (reentrant) lock, to hold around several add() calls: no step is
        scheduled in between, so the sequences of one request (its n choices, its prompts)
        start in the same step."""
        return self._lock

    def add(self, seq: Sequence) -> AddResult:
        """Offer a new sequence. Accepted ones join the waiting queue and will finish or
        be aborted; refused ones say why, with a Retry-After hint where retrying helps."""
        with self._lock:
            if seq.seq_id in self._seqs:
                raise ValueError(f"sequence {seq.seq_id} was already added")
            if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens != 0:
                raise ValueError(f"sequence {seq.seq_id} is not a fresh waiting sequence")
            capacity, now = self.kv_capacity_tokens, self._clock()
            result = self.admission.offer(seq, capacity, len(self.waiting), now)
            if not result.accepted:
                return result
            self.policy.on_arrival(seq, self._prefill_queue())
            self.waiting.append(seq)
            self._seqs[seq.seq_id] = seq
            self._idle_tenants.busy(seq.tenant)
            return result

    def abort(self, seq_id: int) -> bool:
        """Retire a waiting or running sequence at once (FinishReason.ABORT), freeing its
        blocks. False if it is unknown or already retired. If it is in the step being run,
        update() skips it."""
        return self.finish(seq_id, FinishReason.ABORT)

    def finish(self, seq_id: int, reason: FinishReason) -> bool:
        """Retire a sequence with `reason`: free its KV blocks, drop it from the queues.
        False if it is unknown or already retired."""
        with self._lock:
            seq = self._seqs.get(seq_id)
            if seq is None:
                return False
            self._retire(seq, reason)
            return True

    def get(self, seq_id: int) -> Sequence | None:
        with self._lock:
            return self._seqs.get(seq_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        """True while any accepted sequence is unfinished."""
        return bool(self._seqs)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        """Decide this step: decodes, then prefill chunks, then admissions (see the class doc)."""
        with self._lock:
            out = SchedulerOutput(finished=self._finished_ids)
            self._finished_ids = []
            now = self._clock()
            if self.config.session_kv_idle_s is not None:
                self.kv.release_idle_sessions(now - self.config.session_kv_idle_s)
            for tenant in self._idle_tenants.expired(now):
                self.policy.forget(tenant)
                self.ledger.forget(tenant)
                self.num_retired_tenants += 1
            budget = self.config.max_num_batched_tokens
            by_urgency = sorted(self.running, key=_urgency)
            pending = {s.seq_id: s for s in by_urgency}  # running, not yet scheduled this step
            for decode in [s for s in by_urgency if self._remaining(s) == 1]:
                if budget == 0:
                    break
                if decode.seq_id in pending:  # else preempted earlier in this step
                    budget -= self._run_chunk(decode, 1, pending, out)
            admitting = True  # until the policy's pick does not fit the KV cache
            group = self.config.prefill_group_tokens
            prefilled = 0
            while (
                budget > 0
                and (group is None or prefilled < group)
                and (seq := self._next_prefill(pending, admitting)) is not None
            ):
                if seq.status is SequenceStatus.RUNNING:
                    num_new = self._run_chunk(seq, self._prefill_chunk(seq, budget), pending, out)
                else:
                    num_new = self._admit(seq, budget, out)
                    admitting = num_new > 0
                budget -= num_new
                prefilled += num_new
                if num_new and self._remaining(seq) - num_new <= 1:
                    self.policy.on_prefilled(seq)  # no prefill chunk left, decodes from here
            out.block_copies = self.kv.take_block_copies()
            out.page_assignments = self.kv.take_page_assignments()
            return out

    def _prefill_queue(self) -> list[Sequence]:
        """The sequences waiting for prefill tokens: the waiting queue, then running
        sequences whose prompt is not all computed (chunked prefill serves a prompt piece by
        piece, so these still queue for the step's budget)."""
        return self.waiting + [s for s in self.running if _prefilling(s)]

    def charge_remote(self, usage: Mapping[str, tuple[int, int]]) -> None:
        """Service other replicas gave tenants (tenant -> prompt, output tokens), charged to
        the policy's counters so that fairness spans replicas (deploy/fairness.py); the service
        ledger keeps this scheduler's own. Only tenants the policy knows are charged: a tenant
        new here is lifted on arrival anyway, and unknown names must not grow its state."""
        with self._lock:
            known = self.policy.counters()
            for tenant, (prompt, output) in usage.items():
                if tenant in known:
                    self.policy.charge(tenant, prompt, output)

    def end_session(self, tenant: str, session: str) -> bool:
        """A conversation ended: release its pinned KV to the prefix cache (reclaimable)."""
        with self._lock:
            return self.kv.end_session(tenant, session)

    def update(self, output: SchedulerOutput, result: StepResult) -> None:
        """After the engine ran `output`: per scheduled sequence, record its prompt logprobs and
        (where its chunk asked) its keys' attention mass, append its sampled token, advance
        num_computed_tokens and commit its KV blocks; then retire `result.finished`. Sequences
        aborted meanwhile are skipped."""
        with self._lock:
            for row, item in enumerate(output.scheduled):
                seq = item.seq
                if self._seqs.get(seq.seq_id) is not seq:
                    continue  # aborted after schedule()
                if result.prompt_logprobs is not None:
                    seq.prompt_logprobs.extend(result.prompt_logprobs[row])
                if result.attention is not None and item.kv.wants_attention:
                    self.kv.record_attention(seq, result.attention[row])
                if (token := result.sampled.get(seq.seq_id)) is not None:
                    seq.output_token_ids.append(token)
                seq.num_computed_tokens = item.start + item.num_new_tokens
                self.kv.commit(seq)
            for seq_id, reason in result.finished.items():
                self.finish(seq_id, reason)

    # ------------------------------------------------------------------ statistics

    def stats(self) -> SchedulerStats:
        """A snapshot: queue lengths, preemptions, refusals, per-tenant service and counters."""
        with self._lock:
            return SchedulerStats(
                policy=self.policy.name,
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                num_preemptions=self.num_preemptions,
                num_finished=self.num_finished,
                num_aborted=self.num_aborted,
                rejected=dict(self.admission.rejected),
                kv_usage=self.kv.usage,
                completions_per_s=self.admission.completions.per_second(self._clock()),
                retired_tenants=self.num_retired_tenants,
                tenants=tenant_stats(
                    self.ledger, self.policy.counters(), self.running, self.waiting, _prefilling
                ),
            )

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        """Tokens of seq whose K/V is not computed yet; 1 means a decode."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining < 1:
            raise RuntimeError(
                f"sequence {seq.seq_id} has nothing to compute: its sampled token was not "
                "given to update()"
            )
        return remaining

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """How many of seq's uncomputed tokens its prefill chunk takes: as many as the budget
        allows, except the last token of a seeded request's prompt, which is left for a step of
        its own. A cached prompt recomputes just that token, as a one-row chunk attending over
        the cached KV; computed cold inside a longer chunk it would take other kernels (prefill
        attention, many-row GEMMs) that round its logits differently, and a seeded text could
        then differ cold and cached."""
        remaining = self._remaining(seq)
        num_new = min(remaining, budget)
        if seq.sampling.seed is not None and not seq.num_output_tokens and 1 < num_new == remaining:
            num_new -= 1
        return num_new

    def _run_chunk(
        self, seq: Sequence, wanted: int, pending: dict[int, Sequence], out: SchedulerOutput
    ) -> int:
        """Schedule up to `wanted` tokens of a running seq (fewer if blocks are short); 0 when
        seq itself was preempted to make room."""
        num_new = self._allocate_or_preempt(seq, wanted, pending, out)
        if num_new:
            del pending[seq.seq_id]
            self._add_to_step(out, seq, num_new)
        return num_new

    def _next_prefill(self, pending: dict[int, Sequence], admitting: bool) -> Sequence | None:
        """Who gets the step's next prefill tokens: a running sequence still prefilling, or the
        policy's pick from the waiting queue while a batch slot is free and admission is open.
        The policy's prefill rank decides first (vtc: the smallest finish tag, so an
        under-served tenant's prompt is not queued behind others' long prompts); on a tie,
        running sequences before admissions, each most urgent first."""
        candidates = [s for s in pending.values() if _prefilling(s)]
        if admitting and self.waiting and len(self.running) < self.max_num_seqs:
            candidates.append(self.policy.select(self.waiting))
        if not candidates:
            return None
        return min(
            candidates,
            key=lambda s: (
                *self.policy.prefill_rank(s),
                s.status is not SequenceStatus.RUNNING,
                _urgency(s),
            ),
        )

    def _allocate_or_preempt(
        self, seq: Sequence, wanted: int, pending: dict[int, Sequence], out: SchedulerOutput
    ) -> int:
        """Get KV blocks for up to `wanted` next tokens of a running seq: a prefill chunk
        shrinks to what fits; only when not even one token fits is a sequence preempted (by
        the class's rule) and the fit retried. Returns the tokens granted, 0 when seq itself
        was preempted."""
        while True:
            # Counts blocks held only by session pins as free: the KV manager releases them
            # before a chunk shrinks or anyone is preempted.
            num_new = self.kv.largest_fit(seq, wanted)
            if num_new and self.kv.allocate(seq, num_new):
                return num_new
            victim = max(pending.values(), key=_urgency)
            del pending[victim.seq_id]
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.insert(0, seq)
        out.preempted.append(seq.seq_id)
        self.num_preemptions += 1

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Move seq from waiting to running with a first chunk of at most `budget` tokens.
        Returns the chunk size, or 0 (changing nothing) when its blocks do not fit."""
        if self.kv.is_exhausted:
            return 0  # every step computes at least one token into a fresh or copied block
        cached_before = seq.num_cached_prompt_tokens
        self.kv.match_prefix(seq)
        if seq.num_preemptions:
            # A recompute hits the sequence's own blocks; report the first admission's hit.
            seq.num_cached_prompt_tokens = cached_before
        num_new = self._prefill_chunk(seq, budget)
        if not self.kv.allocate(seq, num_new):
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.num_cached_prompt_tokens = cached_before
            return 0
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        self._add_to_step(out, seq, num_new)
        return num_new

    def _add_to_step(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        """Record seq's chunk in the step and charge its tenant for the new service."""
        start = seq.num_computed_tokens
        # A sequence with max_tokens 0 computes its prompt and samples nothing (the engine
        # finishes it after this step).
        samples = start + num_new == seq.num_tokens and seq.sampling.max_tokens > 0
        self._charges.charge(seq, start, start + num_new, samples)
        out.scheduled.append(
            ScheduledSeq(seq, start, num_new, samples, self.kv.address(seq, num_new))
        )

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        # A session's finished turn keeps its KV pinned for the next turn; an aborted one not.
        self.kv.free(seq, pin_at=None if reason is FinishReason.ABORT else self._clock())
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        self._charges.forget(seq.seq_id)
        if self.admission.retired(seq, self._clock()):
            self._idle_tenants.idle(seq.tenant, self._clock())
        self._finished_ids.append(seq.seq_id)
        if reason is FinishReason.ABORT:
            self.num_aborted += 1
        else:
            self.num_finished += 1
