"""Fairness through the real server over HTTP (`python -m evals.fairness_http --fast`): a heavy,
a light and a late tenant, each an API key, under `fcfs` and `vtc`, plus the light tenant alone.

Only comparisons within the one run are asserted (this machine's timing moves by up to a third
between runs): the light tenant waits clearly less for its first token under vtc than under
fcfs, and under vtc the service gap between continuously backlogged tenants stays within the
VTC paper's bound 2 max(w_p L_input, w_q M) for these settings."""

from __future__ import annotations

import json

import pytest

from evals.fairness_http import parse_args, run

pytestmark = pytest.mark.slow


def test_vtc_protects_the_light_tenant_and_keeps_the_gap_within_the_bound(tmp_path) -> None:
    out = tmp_path / "fairness_http.json"
    summary = run(parse_args(["--fast", "--out", str(out)]))
    fcfs, vtc = summary["fcfs"], summary["vtc"]

    # The settings really made a backlog: the heavy and late tenants queued together.
    assert vtc["gaps"]["heavy/late"]["backlogged_s"] > 2.0, vtc["gaps"]
    assert fcfs["gaps"]["heavy/late"]["backlogged_s"] > 2.0, fcfs["gaps"]
    assert summary["solo_light_requests"] > 0

    # The light tenant (below its fair share) gets its first token far sooner under vtc.
    light_fcfs = fcfs["tenants"]["light"]["ttft_p95_s"]
    light_vtc = vtc["tenants"]["light"]["ttft_p95_s"]
    assert light_vtc * 2 < light_fcfs, summary["table"]
    # Under fcfs its prompts queue behind the others' long ones: far past twice its solo wait.
    assert fcfs["light_vs_solo"] > 2, summary["table"]

    # The paper's bound on the service gap between backlogged tenants holds under vtc. By hand
    # for the eval's tenants and --fast settings: L_input = 448 (the heavy tenant's longest
    # prompt); 14 streams, fewer than MAX_BATCH_SIZE 32, each holding at most 448 + 48 tokens,
    # so M = 14 * 496 = 6,944 (under MAX_ACTIVE_KV_TOKENS 8,192); U = max(1 * 448, 2 * 6,944).
    bound_2u = 2 * max(1 * 448, 2 * 14 * (448 + 48))
    assert summary["bound"]["bound_2U"] == bound_2u
    assert vtc["max_service_gap"] <= bound_2u, summary["table"]

    # Both artefacts were written, the JSON with every request.
    payload = json.loads(out.read_text())
    assert payload["series"]["vtc"]["records"]
    assert out.with_suffix(".png").stat().st_size > 10_000
