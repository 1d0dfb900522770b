"""The step profile's bookkeeping, with a fake clock: exact per-phase means and shares."""

from __future__ import annotations

import pytest

from engine.step_profile import PHASES, StepProfile


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spend(profile: StepProfile, clock: FakeClock, phase: str, seconds: float) -> None:
    with profile.phase(phase):
        clock.now += seconds


def test_means_and_shares_over_the_window() -> None:
    clock = FakeClock()
    profile = StepProfile(window=2, clock=clock)
    for forward_s in (0.030, 0.010, 0.020):  # the first step falls out of a window of 2
        profile.begin_step()
        spend(profile, clock, "schedule", 0.001)
        spend(profile, clock, "forward", forward_s)
        spend(profile, clock, "forward", 0.002)  # a phase can be entered twice in a step
        spend(profile, clock, "deliver", 0.003)
    profile.end_step()
    summary = profile.summary()
    assert summary["steps"] == 2
    assert summary["step_ms"] == pytest.approx(1 + 17 + 3)
    assert summary["phases"]["forward"]["ms"] == pytest.approx(17)
    assert summary["phases"]["forward"]["share"] == pytest.approx(17 / 21)
    assert summary["phases"]["sample"] == {"ms": 0.0, "share": 0.0}
    assert list(summary["phases"]) == list(PHASES)


def test_time_outside_a_step_and_cancelled_steps_are_not_counted() -> None:
    clock = FakeClock()
    profile = StepProfile(clock=clock)
    spend(profile, clock, "forward", 1.0)  # before any step
    profile.begin_step()
    spend(profile, clock, "schedule", 1.0)
    profile.cancel_step()  # an empty plan: nothing ran
    spend(profile, clock, "deliver", 1.0)
    assert profile.summary() == {
        "steps": 0,
        "step_ms": 0.0,
        "phases": {phase: {"ms": 0.0, "share": 0.0} for phase in PHASES},
    }
