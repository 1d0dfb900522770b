"""Cold start: `make serve` on an empty model cache to the first answered /v1/completions.

    python -m evals.cold_start

Runs `make serve` twice against one new, empty cache directory (GEMMA_SERVE_CACHE): the first
start converts the embedded GGUF, the second finds it converted. Each run is timed from the
`make serve` command to /health answering 200 and to the first completion's answer; the first
run's conversion phases come from the server's own log lines. The virtual environment must
already exist (`make install`): this measures the model's preparation, not pip.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from evals.harness import RESULTS, free_port, running_process, write_results
from evals.plots import bar_chart


def timed_start(cache: Path, log_path: Path) -> dict:
    """Seconds from `make serve` to healthy and to the first answered completion, plus its log."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, GEMMA_SERVE_CACHE=str(cache), LOG_FORMAT="json")
    command = ["make", "--no-print-directory", "serve", "HOST=127.0.0.1", f"PORT={port}"]
    start = time.perf_counter()
    with running_process(command, log_path, base + "/health", env):
        healthy_s = time.perf_counter() - start
        response = httpx.post(
            base + "/v1/completions",
            json={"model": "gemma-3-270m", "prompt": "The capital of France is",
                  "max_tokens": 8, "temperature": 0},
            timeout=120,
        )  # fmt: skip
        response.raise_for_status()
        answered_s = time.perf_counter() - start
    return {
        "healthy_s": round(healthy_s, 2),
        "first_answer_s": round(answered_s, 2),
        "answer": response.json()["choices"][0]["text"],
        "phases_s": _conversion_phases(log_path),
    }


def _conversion_phases(log_path: Path) -> dict[str, float]:
    """{phase: seconds} from the server's JSON log lines of a first start (empty if warm)."""
    phases = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "preparing model" and "done_in_s" in event:
            phases[event["phase"]] = event["done_in_s"]
        elif event.get("event") == "model prepared":
            phases["total conversion"] = event["seconds"]
    return phases


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gemma-serve-cold-") as cache:
        cold = timed_start(Path(cache), RESULTS / "cold_start.cold.server.log")
        warm = timed_start(Path(cache), RESULTS / "cold_start.warm.server.log")
    for name, run in (("cold cache", cold), ("warm cache", warm)):
        print(
            f"{name}: healthy after {run['healthy_s']:.1f} s, "
            f"first completion answered after {run['first_answer_s']:.1f} s"
        )
    for phase, seconds in cold["phases_s"].items():
        print(f"  {phase}: {seconds:.1f} s")
    path = write_results("cold_start", {"cold": cold, "warm": warm})
    bar_chart(
        path.with_suffix(".png"),
        "`make serve` to the first answered completion",
        {"cold cache": cold["first_answer_s"], "warm cache": warm["first_answer_s"]},
        "seconds",
        {k: v for k, v in cold["phases_s"].items() if k != "total conversion"},
        "first start: conversion phase (s)",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
