"""Build the serving stack from settings: model, backend, engine, metrics, services."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from app.generation import GenerationService
from app.response_store import ResponseStore
from app.responses_service import ResponsesService
from app.settings import Settings
from compat.structured import JsonStyle
from engine.async_engine import AsyncEngine
from engine.build import build_engine
from engine.host_memory import freeze_startup_objects
from engine.metrics import ServingMetrics

log = structlog.get_logger(__name__)


@dataclass
class ServerState:
    settings: Settings
    engine: AsyncEngine
    service: GenerationService
    metrics: ServingMetrics
    model_id: str
    created: int
    responses: ResponsesService  # /v1/responses and its stored responses


def build_server_state(settings: Settings, created: int) -> ServerState:
    """Load the model and start the engine loop; returns once the engine takes work."""
    plan = settings.engine_plan()  # exits before loading on settings that cannot serve here
    log.info(
        "loading model",
        model=settings.MODEL_NAME,
        device=str(plan.device),
        dtype=str(plan.dtype),
        linear_kernel=plan.kernel,
        kv_cache_dtype=str(plan.config.kv.cache_dtype),
    )
    async_engine = AsyncEngine(
        # Runs on the engine thread: loading, backend and KV allocation included (see AsyncEngine).
        lambda: build_engine(plan.config, plan=plan),
        metrics_max_tenants=settings.METRICS_MAX_TENANTS,
    )
    async_engine.start()
    info = async_engine.info
    # Structured outputs need the tokenizer's grammar data (seconds to build): on a worker
    # thread now rather than in the first such request.
    async_engine.grammars.warm_up()
    service = GenerationService(
        async_engine,
        info.model_id,
        eviction_policy=settings.EVICTION_POLICY,
        session_kv_tokens=settings.SESSION_KV_TOKENS,
        json_style=JsonStyle(
            settings.STRUCTURED_OUTPUT_WHITESPACE,
            closed_objects=settings.STRUCTURED_OUTPUT_EXTRA_PROPERTIES == "forbid",
            fraction_digits=None
            if settings.STRUCTURED_OUTPUT_FRACTION_DIGITS < 0
            else settings.STRUCTURED_OUTPUT_FRACTION_DIGITS,
        ),
        max_tool_calls=settings.MAX_TOOL_CALLS,
    )
    log.info(
        "engine ready",
        model=info.model_id,
        backend=settings.BACKEND,
        kv_blocks=info.kv_blocks,
        block_size=settings.KV_BLOCK_SIZE,
        max_batch_size=info.max_num_seqs,
        policy=settings.SCHEDULING_POLICY,
    )
    store = ResponseStore(
        settings.RESPONSES_MAX_STORED_PER_TENANT,
        settings.RESPONSES_MAX_STORED,
        settings.RESPONSES_IDLE_S,
        release_pin=async_engine.end_session,  # a chain's latest response gone: its KV pin too
    )
    frozen = freeze_startup_objects()  # the loaded model's objects, out of every GC walk
    log.debug("startup objects frozen", objects=frozen)
    return ServerState(
        settings, async_engine, service, async_engine.metrics, info.model_id, created,
        ResponsesService(service, store),
    )  # fmt: skip
