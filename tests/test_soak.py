"""The soak's fast mode (`python -m evals.soak --fast`): a minute of Poisson arrivals at twice
the capacity just measured, mixing completions and chat over SSE, JSON and the WebSocket, n > 1,
random lengths and 5% of clients hanging up mid-request. Nothing accepted may be lost, nothing
may be a 5xx, and after the drain the KV blocks and the server's memory are back."""

from __future__ import annotations

import pytest

from evals.soak import parse_args, run

pytestmark = pytest.mark.slow


def test_a_minute_of_overload_loses_nothing_and_leaves_the_server_as_it_was(tmp_path) -> None:
    summary = run(parse_args(["--fast", "--out", str(tmp_path / "soak.json")]))
    brief = {k: v for k, v in summary.items() if k != "samples"}
    # Each condition from the soak's own counts, not from its verdict.
    assert summary["responses_5xx"] == 0, brief
    assert summary["lost_accepted"] == 0, brief
    assert summary["accepted"] == summary["completed"] + summary["aborted_by_client"], brief
    assert summary["blocks_in_use_after"] == summary["blocks_in_use_baseline"], brief
    assert summary["left_running_or_waiting"] == 0, brief
    assert abs(summary["rss_change"]) <= 0.05, brief
    assert summary["healthy_after"], brief
    assert summary["completed"] > 0 and summary["sent"] > summary["capacity_req_s"] * 60, brief
    assert (tmp_path / "soak.png").stat().st_size > 10_000
