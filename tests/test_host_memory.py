"""The heap is trimmed when the engine runs out of work and every interval while it is busy;
the server's large tensors sit on huge pages."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from engine.host_memory import HeapTrimmer, keep_step_memory
from tests.conftest import RunningServer
from tests.sched_driver import FakeClock

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_trims_on_going_idle_and_every_interval_of_busy_time():
    clock = FakeClock(0.0)
    trimmer = HeapTrimmer(interval_s=10.0, clock=clock)
    trimmer.on_idle()
    assert trimmer.trims == 0  # idle from the start: nothing was freed
    for _ in range(5):
        clock.now += 3.0
        trimmer.on_step()
    assert trimmer.trims == 1  # at 12 s of busy time
    trimmer.on_idle()
    trimmer.on_idle()
    assert trimmer.trims == 2  # once per transition to idle


def _huge_pages_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
    reason="this kernel has no transparent huge pages",
)
def test_the_server_holds_its_weights_on_huge_pages(server: RunningServer) -> None:
    """The server's packed weights and KV pools sit on huge pages (engine/model/huge_pages.py):
    at least the embedded model's 368 MB of default-mode weights that decode streams (bf16
    layers, int8 LM head)."""
    assert _huge_pages_kb(server.process.pid) > 368 * 1024


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_glibc_accepts_the_step_memory_settings() -> None:
    """mallopt refuses a threshold above its maximum (HEAP_MAX_SIZE / 2) by returning 0: each
    value the engine sets must be one glibc takes."""
    assert keep_step_memory()
