"""A model that fails to load: both entry points exit non-zero with one log line naming the
cause, no traceback, and never answer /health."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port

ENTRY_POINTS = {
    "python -m app serve": ["-m", "app", "serve", "--host", "127.0.0.1", "--port"],
    "uvicorn app.main:app": ["-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port"],
}


def corrupt_checkpoint(directory: Path) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "gemma3_text", ')
    return directory


def run_until_exit(command: list[str], cwd: Path, model: str, port: int) -> tuple[int, str]:
    """Run the server until it exits (at most a minute), probing /health all along."""
    env = {k: v for k, v in os.environ.items() if k != "PORT"}
    env |= {"MODEL_NAME": model, "PYTHONPATH": str(ROOT)}
    log_path = cwd / f"server-{port}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        try:
            while process.poll() is None:
                assert time.monotonic() < deadline, "the server did not exit"
                try:
                    response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                except httpx.HTTPError:
                    pass
                else:
                    pytest.fail(f"/health answered {response.status_code}")
                time.sleep(0.2)
        finally:
            if process.poll() is None:
                process.kill()
    return process.wait(), log_path.read_text()


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("broken", ["missing directory", "corrupt config"])
def test_a_model_that_fails_to_load_exits_with_one_clear_line(
    tmp_path: Path, entry_point: str, broken: str
) -> None:
    if broken == "missing directory":
        model, cause = str(tmp_path / "nonexistent"), "no checkpoint directory at"
    else:
        model, cause = str(corrupt_checkpoint(tmp_path / "corrupt")), "not a valid JSON file"
    port = free_port()
    command = [sys.executable, *ENTRY_POINTS[entry_point], str(port)]
    status, log = run_until_exit(command, tmp_path, model, port)
    assert status != 0, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, log
    assert "model failed to load" in errors[0] and cause in errors[0] and model in errors[0]
    assert "Traceback" not in log
