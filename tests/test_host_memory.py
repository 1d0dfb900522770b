"""The heap is trimmed when the engine runs out of work and every interval while it is busy."""

from __future__ import annotations

from engine.host_memory import HeapTrimmer
from tests.sched_driver import FakeClock


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
