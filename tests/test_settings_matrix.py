"""Every combination of BACKEND, WEIGHTS, NUMERICS and KV_CACHE_DTYPE (auto, float32), 40 in
all, either serves or is refused at start with a line naming the settings that conflict.

In process, each combination goes the server's way from settings to engine (load_settings,
Settings.engine_plan, engine.build.build_engine) on the embedded model loaded once, and generates
two tokens; a refused one exits at engine_plan, before anything loads. Which are refused depends
on the CPU (bf16 needs oneDNN's bfloat16 GEMM), so the expectation is computed from it. Building
a backend quantizes and packs the whole model, seconds each: the combinations that build the
same backend (BACKEND and linear kernel; NUMERICS and KV_CACHE_DTYPE change none or only the
engine around it) share one, built once, as consecutive cases.

Then real servers (uvicorn, as the deployment starts them): BACKEND=hf serves a completion, and
a refused combination exits with status 1 and one "invalid setting" line, no traceback. Last,
the refusals beside the matrix: DTYPE=float16 under a CPU kernel, and CPU kernels on a GPU (the
device faked: only the plan is made).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from app.settings import Settings, load_settings
from engine import build as engine_build
from engine.backends import InferenceBackend, create_backend
from engine.model.cpu_features import has_amx, has_bf16
from engine.model.loader import LoadedModel
from engine.request import Sequence
from engine.sampling import SamplingParams
from tests.conftest import MODEL_ID, ROOT, free_port, start_server, stop_server
from tests.engine_harness import one_torch_thread  # noqa: F401 (a fixture)

# One torch thread (tests.engine_harness.one_torch_thread): on two cores shared with other
# processes this file took 64 s, against 145 s with two threads waiting on each other.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NO_ENV_FILE = Path("/nonexistent/.env")
BACKENDS = ("custom", "hf")
WEIGHTS = ("auto", "fp32", "bf16", "int8", "bf16-int8head")
NUMERICS = ("exact", "fast")
KV_CACHE_DTYPES = ("auto", "float32")
# Small engines: the matrix is about which settings start, not about capacity. Each engine
# warms its kernels up for every row count up to the step budget (whole-model GEMMs): a budget
# of 4 tokens keeps that short, and prefills the prompt in chunks.
SMALL = {"DEVICE": "cpu", "MAX_ACTIVE_KV_TOKENS": 256, "MAX_NUM_BATCHED_TOKENS": 4,
         "MAX_BATCH_SIZE": 1}  # fmt: skip
PROMPT = "The capital of France is"
_SETTING_NAMES = set(Settings.__struct_fields__)


def expected_kernel(weights: str, numerics: str) -> str:
    """The linear kernel a CPU runs WEIGHTS / NUMERICS with (README, settings table)."""
    if weights == "auto":
        return "bf16-int8head" if has_amx() else "int8"
    if weights == "fp32":
        return "packed" if numerics == "fast" and torch.backends.mkldnn.is_available() else "exact"
    return weights


def expected_refusal(weights: str) -> str | None:
    """What a refusal of WEIGHTS must say on this CPU (a regex), or None where it serves: every
    BACKEND, NUMERICS and KV_CACHE_DTYPE runs every WEIGHTS this CPU has a kernel for."""
    if weights in ("bf16", "bf16-int8head") and not has_bf16():
        return rf"^invalid setting: WEIGHTS={weights} needs oneDNN's bfloat16 GEMM, .*; use "
    return None


def _order(combination: tuple[str, str, str, str]) -> tuple[object, ...]:
    backend, weights, numerics, _ = combination
    return backend, expected_refusal(weights) is None, expected_kernel(weights, numerics)


# Consecutive cases share a backend (see _shared_backend).
MATRIX = sorted(itertools.product(BACKENDS, WEIGHTS, NUMERICS, KV_CACHE_DTYPES), key=_order)


def settings_for(**values: object) -> Settings:
    """Settings as the server reads them, from these values alone (no environment, no .env)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in _SETTING_NAMES:
            patch.delenv(name, raising=False)
        return load_settings(NO_ENV_FILE, **values)


_backends: dict[tuple[object, ...], InferenceBackend] = {}


def _shared_backend(
    kind: str, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, kernel: str
) -> InferenceBackend:
    """create_backend, built once for consecutive cases that ask for the same backend (only
    the newest one is kept: each holds a copy of the model's weights)."""
    key = (kind, id(loaded), str(device), dtype, kernel)
    if key not in _backends:
        _backends.clear()
        _backends[key] = create_backend(kind, loaded, device, dtype, kernel)
    return _backends[key]


@pytest.fixture(scope="module", autouse=True)
def _free_backends() -> Iterator[None]:
    yield
    _backends.clear()


@pytest.mark.parametrize(("backend", "weights", "numerics", "kv_cache_dtype"), MATRIX,
                         ids=["-".join(combination) for combination in MATRIX])  # fmt: skip
def test_every_combination_serves_or_is_refused_at_start(
    embedded_model: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    weights: str,
    numerics: str,
    kv_cache_dtype: str,
) -> None:
    settings = settings_for(
        BACKEND=backend, WEIGHTS=weights, NUMERICS=numerics, KV_CACHE_DTYPE=kv_cache_dtype,
        **SMALL,
    )  # fmt: skip
    refusal = expected_refusal(weights)
    if refusal is not None:
        with pytest.raises(SystemExit, match=refusal):
            settings.engine_plan()
        return
    plan = settings.engine_plan()
    kernel = expected_kernel(weights, numerics)
    assert plan.kernel == kernel
    approximate = kernel in ("bf16", "bf16-int8head", "int8")
    kv_dtype = torch.bfloat16 if kv_cache_dtype == "auto" and approximate else torch.float32
    assert plan.config.kv.cache_dtype == kv_dtype

    monkeypatch.setattr(engine_build, "create_backend", _shared_backend)
    engine = engine_build.build_engine(plan.config, embedded_model, plan)
    assert engine.runner.kv_dtype == kv_dtype
    assert engine.backend.exact == (kernel == "exact")
    seq = Sequence(
        embedded_model.tokenizer(PROMPT).input_ids,
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
    )
    assert engine.add(seq).accepted
    text = ""
    while engine.has_work:
        text += "".join(out.new_text for _, out in engine.step())
    assert len(seq.output_token_ids) == 2
    assert text.strip(), f"no text: {seq.output_token_ids}"


def test_an_hf_server_serves_a_completion(tmp_path: Path) -> None:
    """BACKEND=hf with the default WEIGHTS (auto: bf16-int8head on an AMX CPU, which used to
    exit at start with KeyError: 'bf16-int8head')."""
    small = {name: str(value) for name, value in SMALL.items()}
    running = start_server(tmp_path, **small | {"BACKEND": "hf", "MAX_NUM_BATCHED_TOKENS": "16"})
    try:
        response = httpx.post(
            running.v1 + "/completions",
            json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2, "temperature": 0},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"].strip() and response.json()["usage"]["completion_tokens"] == 2
        assert f"linear_kernel={expected_kernel('auto', 'exact')}" in running.log()
    finally:
        stop_server(running)


def refused_combination() -> tuple[dict[str, str], str]:
    """Settings a server must refuse on this CPU, and what its line must say: one of the
    matrix's where this CPU refuses any, else DTYPE=float16 under a CPU kernel (refused
    everywhere: those kernels take float32 or bfloat16 activations)."""
    for backend, weights, numerics, kv_cache_dtype in MATRIX:
        if (refusal := expected_refusal(weights)) is not None:
            settings = {"BACKEND": backend, "WEIGHTS": weights, "NUMERICS": numerics,
                        "KV_CACHE_DTYPE": kv_cache_dtype}  # fmt: skip
            return settings, refusal
    return {"BACKEND": "hf", "WEIGHTS": "int8", "DTYPE": "float16"}, (
        r"^invalid setting: WEIGHTS=int8 with DTYPE=float16: .*; use DTYPE=float32 or bfloat16"
    )


def test_a_refused_combination_exits_at_start_naming_the_settings(tmp_path: Path) -> None:
    settings, refusal = refused_combination()
    env = {k: v for k, v in os.environ.items() if k not in _SETTING_NAMES}
    env |= settings | {"DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    port = free_port()
    finished = subprocess.run(
        [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1",
         "--port", str(port)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    log = finished.stdout + finished.stderr
    assert finished.returncode == 1, log
    lines = [line for line in log.splitlines() if "invalid setting" in line]
    assert len(lines) == 1 and re.search(refusal, lines[0]), log
    assert "loading model" not in log and "Traceback" not in log


@pytest.mark.parametrize("weights", ["auto", "bf16", "int8", "bf16-int8head"])
def test_cpu_weights_with_float16_are_refused(weights: str) -> None:
    """DTYPE=float16 under a CPU kernel (WEIGHTS=auto picks one on a CPU): those kernels take
    float32 or bfloat16 activations; without this refusal the server died in their warm-up,
    on "x must be a float32 or bfloat16 CPU matrix"."""
    settings = settings_for(WEIGHTS=weights, DTYPE="float16", DEVICE="cpu")
    with pytest.raises(SystemExit) as refused:
        settings.engine_plan()
    if (bf16_refusal := expected_refusal(weights)) is not None:
        assert re.search(bf16_refusal, str(refused.value))
        return
    kernel = expected_kernel(weights, "exact")
    chosen = weights if weights == kernel else f"{weights} ({kernel} on this CPU)"
    assert re.search(
        rf"^invalid setting: WEIGHTS={re.escape(chosen)} with DTYPE=float16: .*; "
        "use DTYPE=float32 or bfloat16, or WEIGHTS=fp32$",
        str(refused.value),
    )


@pytest.mark.parametrize("weights", ["bf16", "int8", "bf16-int8head"])
def test_cpu_weights_on_a_gpu_are_refused(monkeypatch: pytest.MonkeyPatch, weights: str) -> None:
    """Where DEVICE is (or auto-detects) a GPU, the CPU-only WEIGHTS are refused naming both;
    auto and fp32 run the DTYPE weights there."""
    monkeypatch.setattr(engine_build, "resolve_device", lambda name: torch.device("cuda"))
    for serving in ("auto", "fp32"):
        assert settings_for(WEIGHTS=serving).engine_plan().kernel == "exact"
    with pytest.raises(SystemExit) as refused:
        settings_for(WEIGHTS=weights).engine_plan()
    assert re.search(
        rf"^invalid setting: WEIGHTS={weights} with DEVICE=auto \(cuda\): .*CPU kernels only"
        ".*; use WEIGHTS=fp32 or auto there, or DEVICE=cpu$",
        str(refused.value),
    )
