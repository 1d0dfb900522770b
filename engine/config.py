"""What an engine is built from, as nested frozen dataclasses: the model and how its forward
runs, the KV cache, the scheduler (engine.sched.scheduler.SchedulerConfig), and the step.
The server makes one from its settings (app.settings.Settings.engine_config); the offline API,
Ray Serve replicas and the evals build theirs directly; engine.build.build_engine builds an
engine from any of them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.faults import FaultRule
from engine.model.kv_cache import auto_kv_cache_dtype
from engine.model.loader import EMBEDDED_MODEL
from engine.sched.config import SchedulerConfig


@dataclass(frozen=True)
class ModelConfig:
    """Which model, and how its forward runs."""

    name: str = EMBEDDED_MODEL  # MODEL_NAME: a name load_model() knows, or a checkpoint path
    backend: str = "custom"  # BACKEND: "custom" (ours) or "hf" (transformers')
    device: str | None = None  # DEVICE; None: CUDA, then MPS, then the CPU
    dtype: str | None = None  # DTYPE; None: by device
    weights: str = "auto"  # WEIGHTS (engine.model.kernel_select.WEIGHT_MODES)
    numerics: str = "exact"  # NUMERICS: "exact" or "fast"


@dataclass(frozen=True)
class KVConfig:
    """The KV cache: its blocks, memory, dtype, prefix sharing, session pins and eviction."""

    block_size: int = 16  # tokens per KV block (KV_BLOCK_SIZE)
    # KV memory budget: the bytes this many tokens take in every storing layer; None: from
    # free memory. Sliding-window layers get only what their window uses, full attention the rest.
    max_active_tokens: int | None = None
    # The K/V pools' dtype (KV_CACHE_DTYPE); None: the model's. bfloat16 under float32 weights
    # halves the bytes a token's K/V takes and attention reads (docs/kv-cache.md, "KV cache dtype").
    cache_dtype: torch.dtype | None = None
    enable_prefix_caching: bool = True
    # The most KV one tenant's sessions keep pinned between turns; None: no quota.
    session_quota_tokens: int | None = 16384
    # The `sink` and `h2o` eviction policies' parameters (engine.kv.eviction).
    sink_tokens: int = 4
    h2o_recent_fraction: float = 0.5
    # Check the KV bookkeeping whenever the work runs out (KV_CHECK_INTEGRITY; debugging).
    check_integrity: bool = False


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # A step whose rows are all plain greedy takes its tokens from the LM head's own argmax
    # where the head's kernel has one, so the logits are never written (ModelRunner.forward).
    greedy_head: bool = True
    faults: tuple[FaultRule, ...] = ()  # FAULT_INJECTION's rules (tests only; engine.faults)

    def with_auto_kv_cache_dtype(self, kernel: str, dtype: torch.dtype) -> EngineConfig:
        """This config with no KV cache dtype resolved as KV_CACHE_DTYPE=auto does for the
        linear `kernel` and model `dtype` (engine.model.kv_cache.auto_kv_cache_dtype)."""
        if self.kv.cache_dtype is not None:
            return self
        kv = replace(self.kv, cache_dtype=auto_kv_cache_dtype(kernel, dtype))
        return replace(self, kv=kv)
