"""The heap is trimmed when the engine runs out of work and every interval while it is busy;
the server's large tensors sit on huge pages; startup's objects are out of later collections."""

from __future__ import annotations

import gc
import platform
import sys
import weakref
from pathlib import Path

import pytest

from engine.host_memory import HeapTrimmer, freeze_startup_objects, keep_step_memory
from tests.conftest import RunningServer
from tests.sched_driver import FakeClock
from tests.test_huge_pages import mappings

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_freezing_takes_live_objects_out_of_later_collections_and_still_collects_new_garbage():
    startup = [Node() for _ in range(1000)]  # what loading leaves alive
    garbage = Node()
    garbage.other = Node()
    garbage.other.other = garbage  # a cycle startup dropped: only a collection frees it
    dropped = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_objects()
        assert frozen == gc.get_freeze_count() >= len(startup)
        walked = {id(o) for o in gc.get_objects()}  # what a full collection would walk
        assert not walked & {id(o) for o in [startup, *startup]}
        assert dropped() is None  # collected first, not frozen
        later = Node()
        later.other = later
        del later
        assert gc.collect() >= 1  # a cycle made after the freeze is still found
    finally:
        gc.unfreeze()  # back in the oldest generation, for the tests after this one


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
