"""Give freed host memory back to the operating system, when the engine goes idle and every
few seconds while it is busy; and keep the garbage collector off what startup made.

Every step allocates and frees large tensors (logits alone are batch x vocabulary floats) of
shapes that change with the batch. glibc's malloc keeps what such a mix frees in its heap, so a
busy server's resident memory drifts upward even though nothing leaks (evals/soak.py: +1.3 GB
over 10 minutes of overload; mmapping every large block instead kept it flat at a fifth of the
throughput). Trimming the heap returns that memory for the price of one walk over it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable


def _glibc_function(symbol: str) -> Callable[..., int] | None:
    """A glibc malloc function, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), symbol)
    except (OSError, AttributeError):
        return None


_TRIM = _glibc_function("malloc_trim")

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
# Blocks up to this size come from the heap: glibc's largest (HEAP_MAX_SIZE / 2 on 64 bits).
_MMAP_THRESHOLD = 32 << 20
# Free memory the heap keeps at its top between steps; HeapTrimmer returns it all when idle.
_TRIM_THRESHOLD = 512 << 20


def keep_step_memory() -> bool:
    """Let freed step tensors be reused instead of given back and faulted in again: one heap
    for every thread (the engine thread's own arena cannot hold blocks of megabytes, so each
    was a fresh mapping), large blocks from it, and its free top kept up to _TRIM_THRESHOLD.
    `python -m evals.bench_prefill [--default-heap]` counts a prefill step's page faults with
    and without. Call before the engine thread starts; False where the C library is not glibc."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    settings = (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
    )
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system; False where that is not available."""
    return bool(_TRIM is not None and _TRIM(0))


class HeapTrimmer:
    """Trims the heap when the engine runs out of work, and at most every `interval_s` of
    busy time (a server that never idles would otherwise never trim)."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self._busy = False
        self.trims = 0

    def on_step(self) -> None:
        """A step is about to run."""
        self._busy = True
        if self._clock() - self._last >= self.interval_s:
            self._trim()

    def on_idle(self) -> None:
        """The engine has no work."""
        if self._busy:
            self._busy = False
            self._trim()

    def _trim(self) -> None:
        release_free_memory()
        self._last = self._clock()
        self.trims += 1


def freeze_startup_objects() -> int:
    """Collect once, then move every object the process holds into the collector's permanent
    generation (gc.freeze), where collections no longer walk it; returns how many moved.

    Loading the model, its tokenizer and the server leaves most of the process's Python
    objects, and they live as long as it does. A full collection walks every one of them while
    holding the GIL, so the engine thread, and every stream with it, stalls for the whole
    walk; serving's own garbage sets one off from time to time. Frozen, they are out of every
    later walk. Call once, when startup is done. `python -m evals.gc_pause` times a full
    collection of a loaded engine's process with and without."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
