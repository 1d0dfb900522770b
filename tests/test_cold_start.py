"""Two servers starting at once on an empty model cache: one converts the embedded GGUF, the other
waits for it, and both serve the same answers from one intact checkpoint."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.model.loader import EMBEDDED_MODEL, embedded_checkpoint_dir
from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server

pytestmark = pytest.mark.slow


def complete(server: RunningServer) -> str:
    response = httpx.post(
        server.v1 + "/completions",
        json={"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0},
        timeout=120,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_two_cold_starts_share_one_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # does not exist yet: as on a machine that never served
    logs = [tmp_path / "a", tmp_path / "b"]
    for directory in logs:
        directory.mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        starts = [pool.submit(start_server, d, GEMMA_SERVE_CACHE=str(cache)) for d in logs]
        servers = [start.result() for start in starts]
    try:
        answers = [complete(server) for server in servers]
        first_start_logs = [
            s.log().count("preparing model (first start on this cache)") for s in servers
        ]
    finally:
        for server in servers:
            stop_server(server)

    assert sorted(first_start_logs) == [0, 1]  # exactly one of them converted
    assert answers[0] == answers[1]
    # The same answer as the suite's own cache gives: the checkpoint is whole, not half-written.
    expected = embedded_checkpoint_dir()
    converted = cache / EMBEDDED_MODEL
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / name).read_bytes() == (expected / name).read_bytes(), name
    assert (converted / "model.safetensors").stat().st_size == (
        expected / "model.safetensors"
    ).stat().st_size
    assert not list(cache.glob(".convert-*"))  # no scratch directory left behind
