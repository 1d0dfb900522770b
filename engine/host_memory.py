"""Give freed host memory back to the operating system, when the engine goes idle and every
few seconds while it is busy.

Every step allocates and frees large tensors (logits alone are batch x vocabulary floats) of
shapes that change with the batch. glibc's malloc keeps what such a mix frees in its heap, so a
busy server's resident memory drifts upward even though nothing leaks (evals/soak.py: +1.3 GB
over 10 minutes of overload; mmapping every large block instead kept it flat at a fifth of the
throughput). Trimming the heap returns that memory for the price of one walk over it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


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
