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
from tests.test_huge_pages import mappings

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


@pytest.mark.skipif(
    not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
    reason="this kernel has no transparent huge pages",
)
def test_the_server_holds_its_weights_on_huge_pages(server: RunningServer) -> None:
    """The server's weights and KV pools sit in mappings advised as huge pages
    (engine/model/huge_pages.py), which the kernel backs with huge pages: nine tenths or more
    of each, and together at least the weights a default-mode decode token streams, Gemma 3
    270M's int8 LM head (262,144 x 640 bytes) and 18 layers of int8 projections (640 x (1,536
    + 4,096) + (1,024 + 2,048) x 640 bytes each; bf16 layers are twice that). That the decode
    step's own tensors are among them, tests/test_cpu_ops.py checks on a CustomBackend."""
    weights_kb = (262_144 * 640 + 18 * (640 * (1_536 + 4_096) + (1_024 + 2_048) * 640)) // 1024
    advised = [m for m in mappings(server.process.pid) if "hg" in m.flags and m.rss_kb > 4096]
    assert sum(m.rss_kb for m in advised) >= weights_kb, advised
    assert all(m.huge_kb >= 0.9 * m.rss_kb for m in advised), advised


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_glibc_accepts_the_step_memory_settings() -> None:
    """mallopt refuses a threshold above its maximum (HEAP_MAX_SIZE / 2) by returning 0: each
    value the engine sets must be one glibc takes."""
    assert keep_step_memory()
