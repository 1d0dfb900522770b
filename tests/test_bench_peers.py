"""bench_peers' record of the machine's drift: the read bandwidth before and after each engine,
a warning in the tables where the readings differ by more than DRIFT_WARNING, and the rounds
the engines take turns in, pooled per point (pure logic, expected values worked out by hand)."""

from __future__ import annotations

from evals.bench_peers import (
    DRIFT_WARNING,
    Engine,
    Measured,
    Point,
    drift_lines,
    pooled,
    round_lines,
)
from evals.harness import RequestTiming

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


def test_rounds_readings_are_listed_and_the_warning_says_the_engines_took_turns() -> None:
    lines = drift_lines(
        {"ours": [30.0, 24.0, 22.0, 21.0], "llama": [25.0, 23.0, 21.5, 20.0]}, LABELS, 2
    )
    assert lines == [
        "",
        "Read bandwidth before / after each engine's turn, 2 rounds (a sum over 1 GiB, every "
        "core, best of five): gemma-serve defaults 30.0 / 24.0 / 22.0 / 21.0, llama.cpp Q4_K_M "
        "25.0 / 23.0 / 21.5 / 20.0 GB/s.",
        "",
        "**The machine drifted during this run**: its bandwidth ranged 20.0 to 30.0 GB/s. The "
        "engines took turns over 2 rounds and each point pools its rounds, so each engine met "
        "the drift alike; one round's ratios would carry it.",
    ]


POINT = Point("N=1", "N=1", 1, 128)


def test_a_point_pools_its_rounds_requests() -> None:
    # Round 1: two requests of 10 tokens in 2 s (10 tok/s); round 2: one of 10 tokens in 0.5 s
    # (20 tok/s). Pooled: 30 tokens in 2.5 s, 12 tok/s, not the mean of the rounds (15).
    first = Measured(
        [RequestTiming(0.1, 1.0, 10), RequestTiming(0.3, 1.2, 10)], 2.0, {"step_ms": 1.0}
    )
    second = Measured([RequestTiming(0.2, 0.47, 10)], 0.5, {"step_ms": 2.0})
    row = pooled([{"N=1": first}, {"N=1": second}], [POINT], output_tokens=10)["N=1"]
    assert row["requests"] == 3 and row["output_tokens"] == 30
    assert row["throughput_tok_s"] == 12.0
    assert row["rounds_tok_s"] == [10.0, 20.0]
    assert row["completed_requests"] == 3
    assert row["step_profile"] == {"step_ms": 2.0}  # the last round's


def test_one_round_has_no_round_table() -> None:
    only = Measured([RequestTiming(0.1, 1.0, 10)], 1.0)
    rows = pooled([{"N=1": only}], [POINT], output_tokens=10)
    assert "rounds_tok_s" not in rows["N=1"] and "step_profile" not in rows["N=1"]
    engine = Engine("ours", "ours", None, {})
    assert round_lines([engine], {"ours": rows}, [POINT]) == []


def test_round_table_lists_each_rounds_tokens_per_second() -> None:
    engine = Engine("ours", "ours", None, {})
    results = {"ours": {"N=1": {"rounds_tok_s": [44.12, 41.0, 43.56]}}}
    assert round_lines([engine], results, [POINT]) == [
        "",
        "Each round's tokens/s (the table above pools the rounds' requests):",
        "",
        "| engine | point | round 1 | round 2 | round 3 |",
        "|---|---|---:|---:|---:|",
        "| ours | N=1 | 44.1 | 41.0 | 43.6 |",
    ]
