"""Server settings from environment variables and an optional `.env` file (env wins)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from dotenv import dotenv_values

from app.origin import normalize_origin
from compat.unknown_fields import UnknownFields
from engine.build import EnginePlan, plan_engine
from engine.config import EngineConfig, KVConfig, ModelConfig
from engine.device import parse_dtype
from engine.faults import FAULT_SPEC_PATTERN, parse_fault_rules
from engine.sched.config import SchedulerConfig
from engine.sched.policy import TokenCost

# A token weight: the VTC cost of one token, never negative (a negative weight would let a
# tenant earn credit by being served).
Weight = Annotated[float, msgspec.Meta(ge=0)]


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    MODEL_NAME: str = "gemma-3-270m"
    BACKEND: Literal["custom", "hf"] = "custom"
    DEVICE: Literal["cuda", "mps", "cpu"] | None = None  # None: auto-detect
    DTYPE: Literal["float32", "bfloat16", "float16"] | None = None  # None: by device
    # Linear-layer kernels (engine.model.kernel_select): bf16 or int8 weights (CPU), or DTYPE
    # weights computed bit-exact to transformers (exact) or through pre-packed oneDNN kernels on
    # CPU (fast). auto: bf16 on a CPU with AMX, int8 on other CPUs, DTYPE weights on a GPU.
    # A mode this machine or DTYPE cannot run is refused at start (engine.build.plan_engine).
    WEIGHTS: Literal["auto", "fp32", "bf16", "bf16-int8head", "int8"] = "auto"
    NUMERICS: Literal["exact", "fast"] = "exact"
    MAX_BATCH_SIZE: int | None = None  # None: from memory and the step budget
    MAX_ACTIVE_KV_TOKENS: int | None = None  # None: sized from memory
    # The KV cache's dtype. auto: bfloat16 under the bf16 / int8 weight kernels, else DTYPE
    # (engine.model.kv_cache.auto_kv_cache_dtype); bfloat16 halves a token's K/V bytes.
    KV_CACHE_DTYPE: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    KV_BLOCK_SIZE: int = 16
    MAX_QUEUE_LEN: int = 256
    MAX_INFLIGHT_PER_TENANT: int | None = None  # accepted, unfinished requests; None: no limit
    MAX_INFLIGHT_PER_SESSION: int | None = None
    MAX_NUM_BATCHED_TOKENS: int = 2048  # per-step token budget (prefill chunks + decodes)
    # No further prompt's chunk joins a step whose prefill chunks hold this many tokens; 0: off.
    PREFILL_GROUP_TOKENS: Annotated[int, msgspec.Meta(ge=0)] = 512
    # priority: the most urgent request first (a request's `priority`, lower first), then FCFS.
    SCHEDULING_POLICY: Literal["fcfs", "vtc", "priority"] = "vtc"
    # VTC's service weights (Sheng et al., OSDI 2024): w_p per prompt token computed, w_q per
    # output token; the per-tenant service ledger (/api/metrics) uses the same weights.
    VTC_INPUT_WEIGHT: Weight = 1.0
    VTC_OUTPUT_WEIGHT: Weight = 2.0
    EVICTION_POLICY: Literal["none", "lru", "sink", "h2o"] = "none"
    SESSION_KV_TOKENS: int = 1024  # a session's KV budget when an eviction policy is on
    # The eviction policies' parameters: `sink` keeps the blocks of the first this many tokens
    # (StreamingLLM's attention sinks); `h2o` keeps this share of its budget as the most recent
    # blocks and fills the rest with the blocks that got the most attention.
    EVICTION_SINK_TOKENS: Annotated[int, msgspec.Meta(ge=1)] = 4
    EVICTION_H2O_RECENT_FRACTION: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    # Sessions (WebSocket sessions, X-Session-Id chats) keep their KV pinned between turns: at
    # most this many tokens per tenant, released after this many idle seconds or when memory
    # is needed; released KV stays reclaimable in the prefix cache.
    SESSION_KV_QUOTA_TOKENS: Annotated[int, msgspec.Meta(ge=0)] = 16384
    SESSION_KV_IDLE_S: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    # Stored responses (/v1/responses, store true): at most this many per tenant and in all,
    # least recently used dropped first, and none kept past this many idle seconds.
    RESPONSES_MAX_STORED_PER_TENANT: Annotated[int, msgspec.Meta(ge=1)] = 256
    RESPONSES_MAX_STORED: Annotated[int, msgspec.Meta(ge=1)] = 10000
    RESPONSES_IDLE_S: Annotated[float, msgspec.Meta(ge=0)] = 3600.0
    # Tenants come from the `user` field without keys, so a client can name one per request:
    # an idle tenant's counters and service are forgotten after TENANT_IDLE_S, or least
    # recently active first beyond MAX_IDLE_TENANTS; per-tenant Prometheus series and TTFT
    # windows are kept for at most METRICS_MAX_TENANTS tenants.
    TENANT_IDLE_S: Annotated[float, msgspec.Meta(ge=0)] = 600.0
    MAX_IDLE_TENANTS: Annotated[int, msgspec.Meta(ge=0)] = 1024
    METRICS_MAX_TENANTS: Annotated[int, msgspec.Meta(ge=1)] = 64
    PREFIX_CACHING: bool = True
    # Structured outputs' JSON (response_format, structured_outputs, forced tool calls), see
    # compat/structured.py: "compact" allows no whitespace outside strings, "flexible" any;
    # "forbid" closes object schemas that list properties to other keys unless they say,
    # "allow" keeps JSON Schema's default. A small model fills whatever room it is given.
    STRUCTURED_OUTPUT_WHITESPACE: Literal["compact", "flexible"] = "compact"
    STRUCTURED_OUTPUT_EXTRA_PROPERTIES: Literal["forbid", "allow"] = "forbid"
    # The most digits after a JSON number's point (a schema's own multipleOf wins), and numbers
    # without bounds kept within +-(2**53 - 1); -1 lifts both.
    STRUCTURED_OUTPUT_FRACTION_DIGITS: Annotated[int, msgspec.Meta(ge=-1)] = 6
    # The most tool calls in one reply forced by tool_choice "required" with parallel calls on.
    MAX_TOOL_CALLS: Annotated[int, msgspec.Meta(ge=1)] = 4
    API_KEYS: str = ""  # comma-separated keys or name:key pairs; empty: no auth
    # With API_KEYS: "keys" also requires a key for /metrics, /api/metrics and the dashboard's
    # data; "none" leaves them open, as vLLM leaves /metrics.
    OPS_AUTH: Literal["none", "keys"] = "none"
    # Browser origins that may open WS /v1/ws besides the server's own ("*": any). Clients that
    # send no Origin (not browsers) are always let through; see app/origin.py.
    WS_ALLOWED_ORIGINS: str = ""
    HOST: str = "127.0.0.1"
    PORT: int = 8000
    LOG_FORMAT: Literal["console", "json"] = "console"
    MAX_BODY_BYTES: int = 1_000_000
    # A request field the OpenAI endpoints do not know: "ignore" drops it and logs a warning
    # naming it (vLLM); "reject" answers 400 naming it (OpenAI).
    UNKNOWN_FIELDS: UnknownFields = "ignore"
    SHUTDOWN_GRACE_S: float = 10.0
    # Tests only, never in production: "<where>:<marker>,..." fails every engine step that
    # schedules a prompt containing <marker>, at "forward" or "step" (engine/faults.py).
    FAULT_INJECTION: Annotated[str, msgspec.Meta(pattern=FAULT_SPEC_PATTERN)] = ""
    # Debugging: check the KV bookkeeping (engine.kv.integrity) each time the engine goes idle.
    KV_CHECK_INTEGRITY: bool = False

    def engine_config(self) -> EngineConfig:
        """The engine's configuration from these settings (the one place they are mapped)."""
        return EngineConfig(
            model=ModelConfig(
                name=self.MODEL_NAME,
                backend=self.BACKEND,
                device=self.DEVICE,
                dtype=self.DTYPE,
                weights=self.WEIGHTS,
                numerics=self.NUMERICS,
            ),
            scheduler=SchedulerConfig(
                policy=self.SCHEDULING_POLICY,
                max_num_seqs=self.MAX_BATCH_SIZE,
                max_num_batched_tokens=self.MAX_NUM_BATCHED_TOKENS,
                prefill_group_tokens=self.PREFILL_GROUP_TOKENS or None,
                max_queue_len=self.MAX_QUEUE_LEN,
                max_inflight_per_tenant=self.MAX_INFLIGHT_PER_TENANT,
                max_inflight_per_session=self.MAX_INFLIGHT_PER_SESSION,
                token_cost=TokenCost(self.VTC_INPUT_WEIGHT, self.VTC_OUTPUT_WEIGHT),
                session_kv_idle_s=self.SESSION_KV_IDLE_S,
                tenant_idle_s=self.TENANT_IDLE_S,
                max_idle_tenants=self.MAX_IDLE_TENANTS,
            ),
            kv=KVConfig(
                block_size=self.KV_BLOCK_SIZE,
                max_active_tokens=self.MAX_ACTIVE_KV_TOKENS,
                cache_dtype=None
                if self.KV_CACHE_DTYPE == "auto"
                else parse_dtype(self.KV_CACHE_DTYPE),
                enable_prefix_caching=self.PREFIX_CACHING,
                session_quota_tokens=self.SESSION_KV_QUOTA_TOKENS,
                sink_tokens=self.EVICTION_SINK_TOKENS,
                h2o_recent_fraction=self.EVICTION_H2O_RECENT_FRACTION,
                check_integrity=self.KV_CHECK_INTEGRITY,
            ),
            faults=parse_fault_rules(self.FAULT_INJECTION),
        )

    def engine_plan(self) -> EnginePlan:
        """The device, dtype, linear kernel and engine config these settings give on this
        machine (engine.build.plan_engine), checked before anything loads: settings that
        cannot serve together here exit as a malformed value does in load_settings, with
        "invalid setting: " and a line naming them, why, and what to use instead."""
        try:
            return plan_engine(self.engine_config())
        except ValueError as exc:
            raise SystemExit(f"invalid setting: {exc}") from None

    @property
    def api_keys(self) -> dict[str, str]:
        """key -> tenant name. "name:key" names the tenant; a bare key is named by its place in
        the list ("key-2"), never by itself: tenant names appear in logs, metrics and the
        dashboard."""
        keys: dict[str, str] = {}
        items = filter(None, (part.strip() for part in self.API_KEYS.split(",")))
        for position, item in enumerate(items, start=1):
            name, sep, key = item.partition(":")
            if sep:
                keys[key] = name
            else:
                keys[item] = f"key-{position}"
        return keys

    @property
    def ops_keys(self) -> dict[str, str]:
        """The keys /metrics, /api/metrics and the dashboard's data need; empty: open."""
        return self.api_keys if self.OPS_AUTH == "keys" else {}

    @property
    def ws_allowed_origins(self) -> frozenset[str]:
        """WS_ALLOWED_ORIGINS, each normalised as origins are compared."""
        parts = self.WS_ALLOWED_ORIGINS.split(",")
        return frozenset(normalize_origin(part) for part in parts if part.strip())


def load_settings(env_file: str | Path = ".env", **overrides: object) -> Settings:
    """Settings from `.env` (if present), then the process environment, then `overrides`."""
    names = set(Settings.__struct_fields__)
    raw: dict[str, object] = {}
    if Path(env_file).is_file():
        raw.update({k: v for k, v in dotenv_values(env_file).items() if k in names and v != ""})
    raw.update({k: v for k, v in os.environ.items() if k in names and v != ""})
    raw.update(overrides)
    try:
        # strict=False lets msgspec turn "32" into 32 and "true" into True.
        return msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid setting: {exc}") from exc
