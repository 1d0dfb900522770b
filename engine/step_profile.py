"""Where an engine step's time goes, over the last steps: what to optimise next.

Phases, in the order a step runs them:
- schedule: the scheduler's plan for the step and its update after it;
- batch: copy-on-write block copies and building the ForwardBatch tensors;
- forward: the model over the paged KV cache (the backend);
- sample: the batched sampler over the step's logits;
- detokenize: incremental detokenization and stop checks, per sampled token;
- deliver: handing outputs to the waiting requests and updating metrics (the async engine).

Written by the engine thread, read by the API: a lock guards the window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES = ("schedule", "batch", "forward", "sample", "detokenize", "deliver")


class StepProfile:
    """Per-phase seconds of the last `window` steps."""

    def __init__(self, window: int = 256, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._steps: deque[dict[str, float]] = deque(maxlen=window)
        self._current: dict[str, float] | None = None
        self._lock = threading.Lock()

    def begin_step(self) -> None:
        """Start timing a new step; the previous one (if any) joins the window."""
        self.end_step()
        self._current = dict.fromkeys(PHASES, 0.0)

    def end_step(self) -> None:
        if self._current is not None:
            with self._lock:
                self._steps.append(self._current)
            self._current = None

    def cancel_step(self) -> None:
        """Forget the current step (it did no work)."""
        self._current = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside to `name` of the current step (no-op outside a step)."""
        start = self._clock()
        try:
            yield
        finally:
            if self._current is not None:
                self._current[name] += self._clock() - start

    def summary(self) -> dict:
        """{"steps": n, "step_ms": mean, "phases": {phase: {"ms": mean, "share": of the step}}}."""
        with self._lock:
            steps = list(self._steps)
        count = len(steps)
        means = {p: sum(s[p] for s in steps) / count if count else 0.0 for p in PHASES}
        total = sum(means.values())
        return {
            "steps": count,
            "step_ms": 1000 * total,
            "phases": {
                p: {"ms": 1000 * means[p], "share": means[p] / total if total else 0.0}
                for p in PHASES
            },
        }
