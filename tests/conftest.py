"""Shared fixtures: a real server (uvicorn in a subprocess on a free port), the embedded model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.settings import Settings
from engine.model.cpu_features import has_bf16

ROOT = Path(__file__).resolve().parent.parent
# oneDNN's bfloat16 GEMM needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; WEIGHTS=bf16 is refused
# without it (test_linear_kernels.py), so its numerics are tested where it runs.
needs_bf16 = pytest.mark.skipif(not has_bf16(), reason="this CPU has no oneDNN bfloat16 GEMM")


def bf16_param(*values: object) -> object:
    """A parametrize case that runs only where the CPU has oneDNN's bfloat16 GEMM."""
    return pytest.param(*values, marks=needs_bf16)


MODEL_ID = "gemma-3-270m"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(tmp_dir: Path, **settings: str) -> RunningServer:
    """Start `uvicorn app.main:app` with the given settings (env vars) and wait for /health."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in _SETTING_NAMES}
    env.update({"HOST": "127.0.0.1", "PORT": str(port), "MAX_ACTIVE_KV_TOKENS": "32768"})
    env.update({k: str(v) for k, v in settings.items()})
    log_path = tmp_dir / f"server-{port}.log"
    log_file = log_path.open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "app.main:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=tmp_dir,  # no stray .env from the checkout
        env=env | {"PYTHONPATH": str(ROOT)},
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def stop_server(server: RunningServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()


_SETTING_NAMES = set(Settings.__struct_fields__)  # every server setting, kept out of env


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One default server shared by every gateway test that does not need special settings."""
    running = start_server(tmp_path_factory.mktemp("server"))
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded Gemma 3 270M, loaded once per test session (float32)."""
    from engine.model.loader import load_model

    return load_model()
