"""The asyncio-facing engine: `submit()` returns an async stream of outputs while the step
loop runs on its own thread, so serving HTTP never waits on a forward pass.

Admission happens at once on the caller's thread (the scheduler is locked briefly), so a
refusal can become an HTTP 429 before anything is streamed. Aborts are queued and applied by
the engine thread between steps, where it is safe to free blocks.

The engine is built on the engine thread too, so that every tensor operation of the process runs
on that one thread: CPU kernels run on one OpenMP thread team per calling thread, and a second
team (from loading weights on the main thread, say) competes with the first for the cores
(measured on 2 cores: a decode step took 90 ms instead of 66 ms).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import structlog
from transformers import PreTrainedTokenizerBase

from engine import status
from engine.host_memory import HeapTrimmer, keep_step_memory
from engine.llm_engine import LLMEngine, StepFailed
from engine.metrics import EngineGauges, ServingMetrics
from engine.request import FinishReason, Sequence, StepOutput
from engine.sched.admission import AddResult, AdmissionStatus
from engine.structured.compiler import GrammarCompiler

log = structlog.get_logger(__name__)


# An idle engine that receives a request waits for the rest of a burst before its first step
# (AsyncEngine._gather_arrivals): while requests keep coming at most this far apart, for at
# most the second figure in all.
ARRIVAL_GAP_S = 0.003
ARRIVAL_WAIT_MAX_S = 0.03


class EngineOverloaded(RuntimeError):
    """The engine refused a request for now; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLarge(ValueError):
    """The request can never fit the KV cache."""


class EngineDraining(RuntimeError):
    """The server is shutting down: nothing new is admitted, and the requests still running at
    the end of the grace period fail with this."""


class GenerationFailed(RuntimeError):
    """The engine step computing this request failed; the request is over."""


# How long drain() waits for the engine thread to end the requests it cut (between steps).
_END_TIMEOUT_S = 5.0
_CUT_MESSAGE = "The server shut down before this request finished."
_FAILED_MESSAGE = "The engine failed while computing this request."


@dataclass
class _Tracked:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None


class RequestStream:
    """Async iterator over one request's StepOutputs; ends after the finished one."""

    def __init__(self, engine: AsyncEngine, tracked: _Tracked) -> None:
        self._engine = engine
        self._tracked = tracked
        self.seq = tracked.seq

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                item = await self._tracked.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer went away: free the request's blocks
                self._engine.abort(self.seq.request_id)

    def abort(self) -> None:
        self._engine.abort(self.seq.request_id)


@dataclass(frozen=True)
class EngineInfo:
    """What a gateway needs to know of the engine it serves from, fixed once it is built."""

    model_id: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int  # tokens of context a sequence may reach
    vocab_size: int
    kv_capacity_tokens: int  # the most KV one sequence can ever hold (Scheduler.kv_capacity_tokens)
    max_queue_len: int  # waiting sequences before submissions are refused
    max_num_seqs: int  # sequences running at once (MAX_BATCH_SIZE, or sized from memory)
    kv_blocks: dict[str, int]  # KV blocks per cache group


class AsyncEngine:
    def __init__(
        self,
        build: Callable[[], LLMEngine],
        metrics_window_s: float = 60.0,
        metrics_max_tenants: int = 64,
    ) -> None:
        """`build` makes the LLMEngine; start() calls it on the engine thread."""
        self._build = build
        self._metrics_window_s = metrics_window_s
        self._metrics_max_tenants = metrics_max_tenants
        self._engine: LLMEngine | None = None
        self._metrics: ServingMetrics | None = None
        self._tracked: dict[str, _Tracked] = {}
        # Requests to end between steps: with an error to fail them with, or None (aborted).
        self._aborts: queue.SimpleQueue[tuple[str, BaseException | None]] = queue.SimpleQueue()
        self._ended_sessions: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._accepting = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Build the engine on its own thread and start the step loop; returns once the engine
        is ready, raising what building it raised."""
        keep_step_memory()  # before the engine thread makes its heap
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._engine = self._build()
                self._metrics = ServingMetrics(
                    self._engine.model_id, self._metrics_window_s, self._metrics_max_tenants
                )
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, let in-flight requests finish for up to grace_s, then fail the rest
        with EngineDraining, so that their streams end with an error rather than just stop.
        Returns how many were cut."""
        self._accepting = False
        await self._until_idle(grace_s)
        cut = list(self._tracked)
        for request_id in cut:
            self._end_later(request_id, EngineDraining(_CUT_MESSAGE))
        await self._until_idle(_END_TIMEOUT_S)
        return len(cut)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Drain (see drain()), then stop the engine thread."""
        await self.drain(grace_s)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    @property
    def engine(self) -> LLMEngine:
        """The engine start() built."""
        if self._engine is None:
            raise RuntimeError("the engine is not started")
        return self._engine

    @property
    def info(self) -> EngineInfo:
        """The started engine's tokenizer, context length, vocabulary and limits."""
        engine = self.engine
        return EngineInfo(
            model_id=engine.model_id,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            vocab_size=engine.backend.vocab_size,
            kv_capacity_tokens=engine.scheduler.kv_capacity_tokens,
            max_queue_len=engine.scheduler.config.max_queue_len,
            max_num_seqs=engine.scheduler.max_num_seqs,
            kv_blocks={name: pool.num_total for name, pool in engine.kv.pools.items()},
        )

    @property
    def num_queued(self) -> int:
        """Sequences running or waiting: the load a router balances."""
        scheduler = self.engine.scheduler
        return scheduler.num_running + scheduler.num_waiting

    def tenant_service(self) -> dict[str, tuple[int, int]]:
        """Prompt and output tokens served per tenant so far (the scheduler's ledger)."""
        tenants = self.engine.scheduler.stats().tenants
        return {name: (t.prompt_tokens, t.output_tokens) for name, t in tenants.items()}

    def charge_remote(self, usage: Mapping[str, tuple[int, int]]) -> None:
        """Charge the fairness counters for service other replicas gave tenants
        (Scheduler.charge_remote)."""
        self.engine.scheduler.charge_remote(usage)

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's grammar compiler (LLMEngine.grammars): `await grammars.compile(spec)`
        before submit(), then give each choice's Sequence its own `compiled.matcher()`."""
        return self.engine.grammars

    @property
    def metrics(self) -> ServingMetrics:
        """The serving metrics, created by start() with the engine."""
        if self._metrics is None:
            raise RuntimeError("the engine is not started")
        return self._metrics

    async def _until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    @property
    def is_alive(self) -> bool:
        """The step loop runs, draining included (a liveness probe's question)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_ready(self) -> bool:
        """Alive and admitting new requests; false from the start of a drain (readiness)."""
        return self._accepting and self.is_alive

    # ------------------------------------------------------------------ requests

    def submit(self, seq: Sequence) -> RequestStream:
        """Admit `seq` (its request_id must be unique) and stream its outputs.

        Raises EngineOverloaded (queue full, tenant/session limit), EngineDraining (shutting
        down) or RequestTooLarge (can never fit the KV cache)."""
        if not self._accepting:
            raise EngineDraining("The server is shutting down.")
        if seq.request_id in self._tracked:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        tracked = _Tracked(seq, asyncio.get_running_loop(), asyncio.Queue())
        self._tracked[seq.request_id] = tracked
        result: AddResult = self.engine.add(seq)
        if not result.accepted:
            del self._tracked[seq.request_id]
            if result.status is AdmissionStatus.TOO_LARGE:
                raise RequestTooLarge(result.message)
            raise EngineOverloaded(result.message, result.retry_after_s or 1)
        self._wake.set()
        return RequestStream(self, tracked)

    def submitting_together(self) -> AbstractContextManager[bool]:
        """Hold around several submit() calls: the engine thread schedules none of them before
        all are in, so a request's choices start in one step. Without it, a step could take
        the first alone, and where the kernels' last bits follow the batch's shape (the
        approximate weight modes) a seeded request would not repeat its text."""
        return self.engine.scheduler.holding()

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the next step."""
        self._end_later(request_id, None)

    def _end_later(self, request_id: str, error: BaseException | None) -> None:
        """Have the engine thread end a request before the next step (see _end)."""
        if request_id in self._tracked:
            self._aborts.put((request_id, error))
            self._wake.set()

    def end_session(self, tenant: str, session: str) -> None:
        """A conversation is over: its pinned KV is released before the next step."""
        self._ended_sessions.put((tenant, session))
        self._wake.set()

    # ------------------------------------------------------------------ statistics

    def gauges(self) -> EngineGauges:
        """Scheduler and KV state for Prometheus (engine.status.gauges)."""
        return status.gauges(self.engine)

    def snapshot(self) -> dict:
        """Everything the dashboard shows (engine.status.snapshot)."""
        return status.snapshot(self.engine, self.metrics)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        trimmer = HeapTrimmer()
        while not self._stopping:
            self._apply_aborts()
            if not self.engine.has_work:
                self.engine.on_idle()
                trimmer.on_idle()  # the work just ran out: a good moment to give memory back
                self._wake.wait(0.5)
                self._wake.clear()
                if self.engine.has_work:
                    self._gather_arrivals()
                continue
            trimmer.on_step()
            try:
                outputs = self.engine.step()
            except StepFailed as exc:
                # A bug or device failure in the step: its requests fail, the others go on.
                log.exception("engine step failed", requests=len(exc.seqs))
                self._fail([seq.request_id for seq in exc.seqs])
                continue
            except Exception:
                # Scheduling itself failed: no request's state can be trusted.
                log.exception("engine scheduling failed")
                self._fail(list(self._tracked))
                continue
            with self.engine.profile.phase("deliver"):
                self._deliver(outputs)
        self._apply_aborts()

    def _gather_arrivals(self) -> None:
        """Work just reached an idle engine: wait while more keeps arriving, each request
        within ARRIVAL_GAP_S of the one before (ARRIVAL_WAIT_MAX_S in all), so that the
        first step prefills as much of a burst as the scheduler lets one step take (its
        prefill group). Otherwise its first request is prefilled alone and the rest wait for
        that step: a closed loop's clients, all finished by one step, send again within a few
        milliseconds of each other. A lone request waits ARRIVAL_GAP_S."""
        deadline = time.monotonic() + ARRIVAL_WAIT_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            if not self._wake.wait(min(ARRIVAL_GAP_S, left)):
                return
            self._wake.clear()

    def _apply_aborts(self) -> None:
        """Aborts, then ended sessions (after their aborted turns, which pin nothing)."""
        while True:
            try:
                request_id, error = self._aborts.get_nowait()
            except queue.Empty:
                break
            self._end(request_id, error)
        while not self._ended_sessions.empty():
            self.engine.scheduler.end_session(*self._ended_sessions.get_nowait())

    def _deliver(self, outputs: list[tuple[Sequence, StepOutput]]) -> None:
        now = time.monotonic()
        generated = 0
        for seq, out in outputs:
            tracked = self._tracked.get(seq.request_id)
            if tracked is None:
                continue
            generated += len(out.new_token_ids)
            if tracked.first_token_at is None and out.new_token_ids:  # max_tokens 0 has none
                tracked.first_token_at = now
                self.metrics.record_first_token(now - tracked.arrival, seq.tenant)
            self._push(tracked, out)
            if out.finished:
                del self._tracked[seq.request_id]
                self._record_finish(tracked, out.finish_reason or FinishReason.STOP)
        self.metrics.record_generated(generated)

    def _record_finish(self, tracked: _Tracked, reason: FinishReason) -> None:
        now = time.monotonic()
        self.metrics.record_finished(
            e2e_s=now - tracked.arrival,
            ttft_s=None
            if tracked.first_token_at is None
            else tracked.first_token_at - tracked.arrival,
            prompt_tokens=tracked.seq.num_prompt_tokens,
            output_tokens=tracked.seq.num_output_tokens,
            finish_reason=reason.value,
        )

    def _end(self, request_id: str, error: BaseException | None) -> None:
        """On the engine thread: retire a request, freeing its blocks, and end its stream with
        `error`, or as aborted when there is none."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.engine.abort(tracked.seq.seq_id)
        if error is not None:
            self._push(tracked, error)
            return
        self._push(
            tracked,
            StepOutput(
                request_id, [], "", finished=True, finish_reason=FinishReason.ABORT,
                num_prompt_tokens=tracked.seq.num_prompt_tokens,
                num_output_tokens=tracked.seq.num_output_tokens,
                num_cached_tokens=tracked.seq.num_cached_prompt_tokens,
            ),
        )  # fmt: skip
        self._record_finish(tracked, FinishReason.ABORT)

    def _fail(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._end(request_id, GenerationFailed(_FAILED_MESSAGE))

    @staticmethod
    def _push(tracked: _Tracked, item: StepOutput | BaseException) -> None:
        tracked.loop.call_soon_threadsafe(tracked.outputs.put_nowait, item)
