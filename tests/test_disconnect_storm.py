"""The disconnect storm's fast mode (`python -m evals.disconnect_storm --fast`): 100 clients hang
up abruptly, half over SSE and half over the WebSocket, mid-prefill or mid-decode; afterwards
the server holds no sequence and exactly the KV blocks it held before, and still serves."""

from __future__ import annotations

import json

import pytest

from evals.disconnect_storm import parse_args, run

pytestmark = pytest.mark.slow


def test_a_storm_of_abrupt_disconnects_leaves_nothing_behind(tmp_path) -> None:
    out = tmp_path / "storm.json"
    summary = run(parse_args(["--fast", "--out", str(out)]))
    # Every client hung up as planned: none was refused, failed or saw its stream cut.
    assert summary["outcomes"] == {"sse:aborted": 50, "ws:aborted": 50}, summary
    # The server saw each hang-up and aborted that request, freeing its blocks.
    assert summary["aborted_by_server"] == 100, summary
    assert summary["blocks_restored"] and summary["no_sequence_left"], summary
    assert summary["healthy"]
    assert json.loads(out.read_text())["summary"] == summary
