"""One way to build an engine from an EngineConfig, for the server, the offline API, Ray Serve
replicas and the evals: resolve the device, dtype and linear kernel (refusing combinations
that cannot run here, before anything loads), load the model, make the backend, build the
engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends import create_backend
from engine.config import EngineConfig, ModelConfig
from engine.device import resolve_device, resolve_dtype
from engine.llm_engine import LLMEngine
from engine.model.kernel_select import CPU_ONLY_LIBRARIES, kernel_for
from engine.model.loader import LoadedModel, load_model

# WEIGHTS modes that only CPU libraries run (oneDNN, fbgemm).
CPU_WEIGHTS = tuple(CPU_ONLY_LIBRARIES)


@dataclass(frozen=True)
class EnginePlan:
    """What a config resolves to on this machine, before anything loads."""

    device: torch.device
    dtype: torch.dtype
    kernel: str  # the linear layers' kernel (engine.model.kernel_select.kernel_for)
    config: EngineConfig  # with KV_CACHE_DTYPE=auto resolved


def plan_engine(config: EngineConfig) -> EnginePlan:
    """The device, dtype, linear kernel and KV cache dtype `config` gives on this machine;
    ValueError naming the settings that cannot serve together here, why, and what to use."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    kernel = linear_kernel(config.model, device, dtype)
    return EnginePlan(device, dtype, kernel, config.with_auto_kv_cache_dtype(kernel, dtype))


def linear_kernel(model: ModelConfig, device: torch.device, dtype: torch.dtype) -> str:
    """kernel_for(WEIGHTS, NUMERICS) on `device`, or ValueError naming the settings that
    conflict. Every WEIGHTS and NUMERICS runs under both BACKENDs and every KV_CACHE_DTYPE
    (tests/test_settings_matrix.py); what can conflict is a CPU kernel with the device, the
    CPU or DTYPE."""
    weights = model.weights
    if weights in CPU_WEIGHTS and device.type != "cpu":
        raise ValueError(
            f"WEIGHTS={weights} with DEVICE={model.device or 'auto'} ({device.type}): "
            f"{weights} runs CPU kernels only (oneDNN, fbgemm); use WEIGHTS=fp32 or auto "
            "there, or DEVICE=cpu"
        )
    # Raises where the CPU lacks oneDNN's bfloat16 GEMM, naming WEIGHTS and what is missing.
    kernel = kernel_for(weights, model.numerics, device)
    if kernel in CPU_WEIGHTS and dtype == torch.float16:
        chosen = weights if weights == kernel else f"{weights} ({kernel} on this CPU)"
        raise ValueError(
            f"WEIGHTS={chosen} with DTYPE=float16: the {kernel} kernels take float32 or "
            "bfloat16 activations; use DTYPE=float32 or bfloat16, or WEIGHTS=fp32"
        )
    return kernel


def build_engine(
    config: EngineConfig, loaded: LoadedModel | None = None, plan: EnginePlan | None = None
) -> LLMEngine:
    """The engine `config` describes: its model loaded in the plan's dtype, or `loaded` (a
    model loaded once and shared, e.g. by tests; the backend casts its weights), under its
    backend with the plan's linear kernel. `plan`: plan_engine(config), where the caller
    already made it."""
    plan = plan or plan_engine(config)
    if loaded is None:
        loaded = load_model(config.model.name, plan.dtype)
    backend = create_backend(config.model.backend, loaded, plan.device, plan.dtype, plan.kernel)
    return LLMEngine.for_model(loaded, backend, plan.config)
