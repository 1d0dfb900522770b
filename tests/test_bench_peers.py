"""bench_peers' record of the machine's drift: the read bandwidth before and after each engine,
and a warning in the tables where the readings differ by more than DRIFT_WARNING (pure logic,
expected lines written out by hand)."""

from __future__ import annotations

from evals.bench_peers import DRIFT_WARNING, drift_lines

LABELS = {"ours": "gemma-serve defaults", "llama": "llama.cpp Q4_K_M"}


def test_steady_bandwidth_is_reported_without_a_warning() -> None:
    lines = drift_lines({"ours": [25.0, 24.4], "llama": [24.0, 23.0]}, LABELS)
    assert lines == [
        "",
        "Read bandwidth before / after each engine (a sum over 1 GiB, every core, best of five): "
        "gemma-serve defaults 25.0 / 24.4, llama.cpp Q4_K_M 24.0 / 23.0 GB/s.",
    ]


def test_a_machine_that_slowed_between_engines_gets_a_warning() -> None:
    assert DRIFT_WARNING == 1.2  # 40.2 / 19.5 is past it; 25.0 / 23.0 above is not
    lines = drift_lines({"ours": [40.2, 38.0], "llama": [21.0, 19.5]}, LABELS)
    assert lines[-2:] == [
        "",
        "**The machine drifted during this run**: its bandwidth ranged 19.5 to 40.2 GB/s. The "
        "engines ran one after another, so the ratios between them carry that drift.",
    ]


def test_no_engine_ran_no_lines() -> None:
    assert drift_lines({}, LABELS) == []
