"""The synchronous engine: one `step()` schedules, runs the backend, samples and detokenizes.

No threads and no asyncio here (see `engine.async_engine` for serving). Each step:

    scheduler.schedule() -> runner (ForwardBatch -> model; prompt logprobs reduced)
    -> sampler (grammar masks) -> grammars advanced, detokenizers, stops decided
    -> scheduler.update(plan, StepResult)  (append tokens, advance, commit KV, retire finished)
    -> a StepOutput per sequence that got a token or finished
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import replace

import structlog
import torch
from transformers import PreTrainedTokenizerBase

from engine.backends.base import InferenceBackend
from engine.config import EngineConfig
from engine.detokenizer import DetokenizedStep, IncrementalDetokenizer, check_stop
from engine.faults import FaultInjector
from engine.kv.integrity import KVIntegrityError
from engine.kv.layout import SharedPages
from engine.kv.manager import KVCacheManager
from engine.kv.sizing import blocks_per_group, can_share_pages, shared_pages
from engine.model.kv_cache import cache_group_specs
from engine.model.loader import LoadedModel
from engine.request import FinishReason, Sequence, StepOutput, TokenLogprob
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplerOutput, SamplingRow, takes_argmax
from engine.sched.admission import AddResult
from engine.sched.config import MAX_AUTO_BATCH, SchedulerConfig
from engine.sched.output import SchedulerOutput, StepResult
from engine.sched.scheduler import Scheduler
from engine.step_profile import StepProfile
from engine.structured.compiler import GrammarCompiler

log = structlog.get_logger(__name__)

# With no MAX_ACTIVE_KV_TOKENS, the KV cache takes this share of free memory.
_AUTO_KV_MEMORY_FRACTION = 0.25


class StepFailed(RuntimeError):
    """A step raised after scheduling. The sequences in it are in an unknown state and must be
    retired; every other sequence is as scheduling left it and can go on. The original error
    is the __cause__."""

    def __init__(self, seqs: list[Sequence]) -> None:
        super().__init__(f"an engine step failed with {len(seqs)} sequences in it")
        self.seqs = seqs


class LLMEngine:
    def __init__(
        self,
        backend: InferenceBackend,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Iterable[int],
        config: EngineConfig = EngineConfig(),
        model_id: str = "model",
    ) -> None:
        self.backend = backend
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = backend.max_model_len
        num_blocks = _num_kv_blocks(backend, config)
        kv = config.kv
        self.runner = ModelRunner(backend, num_blocks, kv.block_size, kv.cache_dtype)
        quota = kv.session_quota_tokens
        self.kv = KVCacheManager(
            self.runner.cache_groups,
            num_blocks,
            kv.block_size,
            kv.enable_prefix_caching,
            sink_tokens=kv.sink_tokens,
            h2o_recent_fraction=kv.h2o_recent_fraction,
            pin_quota_blocks=None if quota is None else quota // kv.block_size,
        )
        if config.scheduler.max_num_seqs is None:
            limit = auto_max_num_seqs(self.kv.num_free_blocks, config.scheduler)
            config = replace(config, scheduler=replace(config.scheduler, max_num_seqs=limit))
            self.config = config
        self._warm_up_kernels()
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(self.eos_token_ids)
        self.profile = StepProfile()  # where each step's time goes (the async engine adds deliver)
        self.faults = FaultInjector(config.faults, tokenizer) if config.faults else None
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @classmethod
    def for_model(
        cls, loaded: LoadedModel, backend: InferenceBackend, config: EngineConfig = EngineConfig()
    ) -> LLMEngine:
        """An engine over `backend` with the loaded model's tokenizer, EOS ids and name."""
        return cls(
            backend, loaded.tokenizer, loaded.eos_token_ids, config, model_id=loaded.model_id
        )

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of output grammars for this model's tokenizer and logits, made on first
        use (cheap: its tokenizer data is built on its own worker thread, on the first compile
        or at grammars.warm_up()). Compile before submitting, e.g. in the server:

            compiled = await engine.grammars.compile(spec)   # never on the engine thread
            seq = Sequence(prompt, params, grammar=compiled.matcher())
        """
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.backend.vocab_size, self.eos_token_ids
                )
            return self._grammars

    def _warm_up_kernels(self) -> None:
        """Build the kernels' per-shape state for every step shape now, on the thread that will
        run the steps: the first requests do not pay for it, and resident memory does not grow
        with the variety of traffic later (engine.model.kernel_select.warm_up)."""
        started = time.perf_counter()
        sched = self.config.scheduler
        calls = self.backend.warm_up(
            sched.max_num_batched_tokens, sched.max_num_seqs or MAX_AUTO_BATCH
        )
        if calls:
            log.info(
                "kernels warmed up", calls=calls, seconds=round(time.perf_counter() - started, 2)
            )

    def add(self, seq: Sequence) -> AddResult:
        """Offer a sequence to the scheduler; accepted ones keep their detokenizer."""
        if seq.seq_id in self._detokenizers:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        # Created first: once the scheduler has seq, a step on the engine thread may sample it.
        self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.sampling
        )
        accepted = False
        try:
            result = self.scheduler.add(seq)
            accepted = result.accepted
            return result
        finally:
            if not accepted:
                del self._detokenizers[seq.seq_id]

    def abort(self, seq_id: int) -> bool:
        """Retire a sequence at once and free its blocks (call between steps)."""
        self._detokenizers.pop(seq_id, None)
        seq = self.scheduler.get(seq_id)
        if seq is not None:
            seq.grammar = None
        return self.scheduler.abort(seq_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def on_idle(self) -> None:
        """The work ran out: give back the buffers the steps keep (ModelRunner.release_buffers),
        and check the KV bookkeeping if asked to, logging what contradicts itself."""
        self.runner.release_buffers()
        if self.config.kv.check_integrity:
            try:
                self.kv.check_integrity()
            except KVIntegrityError as exc:
                log.error("KV bookkeeping contradicts itself", error=str(exc))

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, StepOutput]]:
        """Run one iteration; returns the output of every sequence that produced a token.
        Raises StepFailed when anything after scheduling fails."""
        profile = self.profile
        profile.begin_step()
        with profile.phase("schedule"):
            plan = self.scheduler.schedule()
        if plan.is_empty:
            profile.cancel_step()
            return []
        try:
            outputs = self._run(plan)
        except Exception as exc:
            profile.cancel_step()
            raise StepFailed([item.seq for item in plan.scheduled]) from exc
        self.num_steps += 1
        return outputs

    def _run(self, plan: SchedulerOutput) -> list[tuple[Sequence, StepOutput]]:
        """Forward, sample and detokenize the scheduled chunks, update the scheduler, and
        report what each sequence got."""
        profile, faults = self.profile, self.faults  # faults: None unless FAULT_INJECTION is set
        sampling = [item.seq for item in plan.scheduled if item.samples]
        with profile.phase("batch"):
            batch = self.runner.prepare(plan)
            rows = [SamplingRow.from_sequence(seq) for seq in sampling]
            greedy = self.config.greedy_head and all(takes_argmax(row) for row in rows)
        with profile.phase("forward"):
            if faults is not None:
                faults.check("forward", plan.scheduled)
            result = self.runner.forward(batch, greedy=greedy)

        finished: dict[int, FinishReason] = {}
        texts: list[DetokenizedStep] = []
        sampled = SamplerOutput([], [])
        if sampling:
            with profile.phase("sample"):
                if result.token_ids is not None:
                    sampled = SamplerOutput(result.token_ids, [None] * len(sampling))
                else:
                    assert result.logits is not None
                    sampled = self.sampler.sample(result.logits, rows)
            with profile.phase("detokenize"):
                for seq, token in zip(sampling, sampled.token_ids, strict=True):
                    texts.append(self._detokenize(seq, token, finished))
        prefill_only = [
            item.seq
            for item in plan.scheduled
            if item.ends_prefill and item.seq.sampling.max_tokens == 0
        ]
        for seq in prefill_only:  # its prompt is computed: it ends without a token
            finished[seq.seq_id] = FinishReason.LENGTH
            self._detokenizers.pop(seq.seq_id, None)
            seq.grammar = None
        if faults is not None:
            faults.check("step", plan.scheduled)
        tokens = {seq.seq_id: token for seq, token in zip(sampling, sampled.token_ids, strict=True)}
        with profile.phase("schedule"):
            self.scheduler.update(
                plan, StepResult(tokens, finished, result.prompt_logprobs, result.attention_mass)
            )
        outputs = [
            (seq, _token_output(seq, token, logprob, text))
            for seq, token, logprob, text in zip(
                sampling, sampled.token_ids, sampled.logprobs, texts, strict=True
            )
        ]
        return outputs + [(seq, _prefill_only_output(seq)) for seq in prefill_only]

    def _detokenize(
        self, seq: Sequence, token: int, finished: dict[int, FinishReason]
    ) -> DetokenizedStep:
        """The text `token` adds to seq's output and whether it ends it (noted in `finished`)."""
        reason = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
        completed_grammar = False
        if seq.grammar is not None:
            reason, completed_grammar = self._advance_grammar(seq, token, reason)
        text = self._detokenizers[seq.seq_id].update(
            token, reason, stop_token=not completed_grammar
        )
        if text.finish_reason is not None:
            finished[seq.seq_id] = text.finish_reason
            self._detokenizers.pop(seq.seq_id)
            seq.grammar = None
        return text

    @staticmethod
    def _advance_grammar(
        seq: Sequence, token: int, reason: FinishReason | None
    ) -> tuple[FinishReason | None, bool]:
        """Advance seq's grammar by `token`, given check_stop's `reason`; returns the finish
        reason and whether the grammar completed the output with this token (whose text, unlike
        a stop token's, is part of the output).

        STOP from check_stop is a stop token, which the sampler allows only where the grammar
        is complete: it ends the output and is not the grammar's. Otherwise the token is
        the grammar's next; once nothing but EOS can follow, the output ends now, as STOP,
        rather than after a step that could only sample EOS. Until then LENGTH (max_tokens,
        the context) ends it as LENGTH: never STOP with the grammar incomplete.
        """
        grammar = seq.grammar
        if grammar is None or reason is FinishReason.STOP:
            return reason, False
        if not grammar.accept(token):
            # The sampler draws from what the grammar allows, so this is a parser limit or a
            # bug; the output is incomplete.
            log.warning(
                "grammar refused a sampled token",
                request_id=seq.request_id,
                token=token,
                error=grammar.error,
            )
            return FinishReason.LENGTH, False
        if grammar.is_terminated:
            return FinishReason.STOP, True
        return reason, False


def _token_output(
    seq: Sequence, token: int, logprob: TokenLogprob | None, text: DetokenizedStep
) -> StepOutput:
    """What a sequence got this step, its token appended already."""
    return StepOutput(
        request_id=seq.request_id,
        new_token_ids=[token],
        new_text=text.text,
        logprobs=None if logprob is None else [logprob],
        # With the first token: its step ended the prompt's prefill.
        prompt_logprobs=_prompt_logprobs(seq) if seq.num_output_tokens == 1 else None,
        finished=text.finish_reason is not None,
        finish_reason=text.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_prompt_tokens,
    )


def _prefill_only_output(seq: Sequence) -> StepOutput:
    """A sequence with max_tokens 0 whose prompt is computed: it ends without a token
    (LENGTH), with its prompt logprobs if it asked for them."""
    return StepOutput(
        request_id=seq.request_id,
        new_token_ids=[],
        new_text="",
        prompt_logprobs=_prompt_logprobs(seq),
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_tokens=seq.num_cached_prompt_tokens,
    )


def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
    return list(seq.prompt_logprobs) if seq.sampling.prompt_logprobs is not None else None


def auto_max_num_seqs(kv_blocks: int, sched: SchedulerConfig) -> int:
    """MAX_BATCH_SIZE when unset: as many sequences as can each hold a KV block of their own
    and a decode row in one step's token budget, at most MAX_AUTO_BATCH. More rows make each
    step longer but not slower per token (a decode step reads the weights once for all of its
    rows); a batch too full for the KV pool preempts, as it does under any limit."""
    return max(1, min(MAX_AUTO_BATCH, kv_blocks, sched.max_num_batched_tokens))


def _num_kv_blocks(backend: InferenceBackend, config: EngineConfig) -> dict[str, int] | SharedPages:
    """The KV memory out of a budget of MAX_ACTIVE_KV_TOKENS tokens of K/V in every storing
    layer (at the cache's dtype), or of a share of free memory: one page pool all cache groups
    share when their layers can (engine.kv.sizing), else blocks per group by layer kind."""
    kv = config.kv
    groups = cache_group_specs(backend.arch, kv.cache_dtype or backend.dtype)
    bytes_per_token = sum(group.bytes_per_token for group in groups)
    sched = config.scheduler
    max_context: int | None = None
    if kv.max_active_tokens is not None:
        budget = kv.max_active_tokens * bytes_per_token
    else:
        budget = int(_free_memory_bytes(backend.device) * _AUTO_KV_MEMORY_FRACTION)
        # More than every sequence at full length is never needed.
        max_context = backend.max_model_len * (sched.max_num_seqs or MAX_AUTO_BATCH)
    size = shared_pages if can_share_pages(groups) else blocks_per_group
    return size(
        groups,
        budget,
        kv.block_size,
        sched.max_num_seqs or MAX_AUTO_BATCH,
        sched.max_num_batched_tokens,
        max_context,
    )


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
