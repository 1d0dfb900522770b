"""The scale-out eval's fast mode (`python -m evals.scaleout --fast`): 2 replicas on Ray
Serve, the affinity router against Ray's default on a multi-turn chat, fairness across 2
replicas. Only what holds on any machine is asserted: every request was answered, affinity
routing kept each conversation's history in one replica's cache at least as well as the
default router, and the service gap between backlogged tenants stayed within the VTC bound."""

from __future__ import annotations

import json
import os

import pytest

from evals.scaleout import parse_args, run

pytestmark = pytest.mark.slow


def test_scaleout_fast(tmp_path) -> None:
    out = tmp_path / "scaleout.json"
    args = parse_args(["--fast", "--out", str(out)])
    summary = run(args)

    assert list(summary["throughput"]) == [f"2 replicas, {(os.cpu_count() or 1) / 2:g} CPU each"]
    for rows in summary["throughput"].values():
        assert [rows[n]["requests"] for n in args.users] == [
            n * args.requests_per_user for n in args.users
        ]
    affinity, default = summary["affinity"]["affinity"], summary["affinity"]["power_of_two"]
    # The whole history but its last partial 16-token block, every turn.
    assert affinity["history_hit_rate"] >= 0.75, affinity
    assert affinity["history_hit_rate"] >= default["history_hit_rate"], summary["affinity"]
    # The VTC bound 2U for evals.fairness_http's tenants and default settings, by hand (see
    # tests/test_fairness_http.py): U = max(w_p * 448, w_q * 14 streams * (448 + 48) tokens).
    bound_2u = 2 * max(1 * 448, 2 * 14 * (448 + 48))
    assert summary["fairness"]["bound"]["bound_2U"] == bound_2u
    shared = summary["fairness"]["shared"]
    assert shared["max_service_gap"] <= bound_2u, shared["gaps"]
    assert shared["tenants"]["heavy"]["requests"] > 0 and shared["tenants"]["light"]["requests"] > 0

    assert json.loads(out.read_text())["summary"]["affinity"]
    assert out.with_suffix(".png").stat().st_size > 10_000
