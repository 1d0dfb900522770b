"""Settings: VTC's token weights reach the scheduler, and invalid ones stop the server at start."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import structlog
import torch

from app.settings import load_settings
from engine.llm_engine import LLMEngine
from engine.model.kv_cache import auto_kv_cache_dtype
from engine.request import Sequence
from engine.sampling import SamplingParams
from engine.sched import Scheduler
from engine.sched.policy import PriorityPolicy, TokenCost, VtcPolicy
from tests.engine_harness import shared_backend
from tests.sched_driver import make_kv, make_seq, run_step

NO_ENV_FILE = Path("/nonexistent/.env")


def test_vtc_weights_default_to_the_papers_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VTC_INPUT_WEIGHT", raising=False)
    monkeypatch.delenv("VTC_OUTPUT_WEIGHT", raising=False)
    config = load_settings(NO_ENV_FILE).engine_config().scheduler
    assert config.token_cost == TokenCost(prompt_weight=1.0, output_weight=2.0)


def test_vtc_weights_from_the_environment_charge_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.sched import Scheduler

    monkeypatch.setenv("VTC_INPUT_WEIGHT", "0.5")
    monkeypatch.setenv("VTC_OUTPUT_WEIGHT", "3")
    monkeypatch.setenv("SCHEDULING_POLICY", "vtc")
    config = load_settings(NO_ENV_FILE).engine_config().scheduler
    assert config.token_cost == TokenCost(prompt_weight=0.5, output_weight=3.0)

    sched = Scheduler(config, make_kv())
    assert isinstance(sched.policy, VtcPolicy)
    sched.add(make_seq(prompt_len=8, max_tokens=2, tenant="t"))
    run_step(sched)  # the whole prompt and the first token
    run_step(sched)  # the second token
    expected = 8 * 0.5 + 2 * 3.0
    assert sched.ledger.service("t") == expected
    assert sched.policy.counter("t") == expected
    assert sched.stats().tenants["t"].service == expected


@pytest.mark.parametrize("name", ["VTC_INPUT_WEIGHT", "VTC_OUTPUT_WEIGHT"])
def test_a_negative_weight_is_a_startup_error(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "-1")
    with pytest.raises(SystemExit, match=f"invalid setting: .*>= 0.*{name}"):
        load_settings(NO_ENV_FILE)


def test_a_weight_that_is_not_a_number_is_a_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VTC_OUTPUT_WEIGHT", "heavy")
    with pytest.raises(SystemExit, match=r"invalid setting: .*VTC_OUTPUT_WEIGHT"):
        load_settings(NO_ENV_FILE)


def test_a_bare_key_is_named_by_its_place_never_by_itself() -> None:
    settings = load_settings(NO_ENV_FILE, API_KEYS="alice:sk-a, sk-b ,bob:sk-c,sk-d")
    assert settings.api_keys == {"sk-a": "alice", "sk-b": "key-2", "sk-c": "bob", "sk-d": "key-4"}


def test_ops_auth_defaults_to_open_and_needs_keys_to_close() -> None:
    assert load_settings(NO_ENV_FILE, API_KEYS="sk-a").ops_keys == {}
    closed = load_settings(NO_ENV_FILE, API_KEYS="sk-a", OPS_AUTH="keys")
    assert closed.ops_keys == {"sk-a": "key-1"}
    assert load_settings(NO_ENV_FILE, API_KEYS="", OPS_AUTH="keys").ops_keys == {}
    with pytest.raises(SystemExit, match="OPS_AUTH"):
        load_settings(NO_ENV_FILE, OPS_AUTH="basic")


def test_ws_allowed_origins_are_normalised() -> None:
    settings = load_settings(NO_ENV_FILE, WS_ALLOWED_ORIGINS=" HTTPS://App.Example/ ,, *")
    assert settings.ws_allowed_origins == frozenset({"https://app.example", "*"})
    assert load_settings(NO_ENV_FILE).ws_allowed_origins == frozenset()


def test_kv_cache_dtype_sizes_the_pools_in_its_own_bytes(
    monkeypatch: pytest.MonkeyPatch, embedded_model
) -> None:
    """KV_CACHE_DTYPE=bfloat16: the engine's pools hold bfloat16, a token's K/V costs half the
    bytes, and MAX_ACTIVE_KV_TOKENS still counts tokens (the same number of blocks)."""
    assert load_settings(NO_ENV_FILE).engine_config().kv.cache_dtype is None  # auto
    # auto, resolved by the server and the offline API once the kernel is known:
    for kernel in ("bf16", "bf16-int8head", "int8"):
        assert auto_kv_cache_dtype(kernel, torch.float32) == torch.bfloat16
    for kernel in ("exact", "packed"):
        assert auto_kv_cache_dtype(kernel, torch.float32) == torch.float32
    assert auto_kv_cache_dtype("exact", torch.float16) == torch.float16
    monkeypatch.setenv("KV_CACHE_DTYPE", "int4")
    with pytest.raises(SystemExit, match="KV_CACHE_DTYPE"):
        load_settings(NO_ENV_FILE)
    monkeypatch.setenv("KV_CACHE_DTYPE", "bfloat16")
    monkeypatch.setenv("MAX_ACTIVE_KV_TOKENS", "4096")
    config = load_settings(NO_ENV_FILE).engine_config()
    assert config.kv.cache_dtype == torch.bfloat16

    backend = shared_backend(embedded_model, "kv-dtype")
    runners = {
        dtype: LLMEngine.for_model(
            embedded_model, backend, replace(config, kv=replace(config.kv, cache_dtype=dtype))
        ).runner
        for dtype in (torch.float32, torch.bfloat16)
    }
    half, full = runners[torch.bfloat16], runners[torch.float32]
    assert {pool.dtype for pool in half.kv_cache.keys.values()} == {torch.bfloat16}
    assert [pool.shape[0] for pool in half.kv_cache.keys.values()] == [
        pool.shape[0] for pool in full.kv_cache.keys.values()
    ]
    assert [2 * g.bytes_per_token for g in half.cache_groups] == [
        g.bytes_per_token for g in full.cache_groups
    ]


def test_scheduling_policy_priority_admits_the_most_urgent_first() -> None:
    """SCHEDULING_POLICY=priority: with room for one sequence, the later request with the lower
    priority value is admitted before the earlier one."""
    config = load_settings(NO_ENV_FILE, SCHEDULING_POLICY="priority").engine_config().scheduler
    sched = Scheduler(replace(config, max_num_seqs=1), make_kv())
    assert isinstance(sched.policy, PriorityPolicy)
    early = make_seq(prompt_len=8, max_tokens=1, priority=5)
    urgent = make_seq(prompt_len=8, max_tokens=1, priority=1)
    sched.add(early)
    sched.add(urgent)
    assert [item.seq for item in run_step(sched).scheduled] == [urgent]
    assert [item.seq for item in run_step(sched).scheduled] == [early]


def test_eviction_parameters_reach_the_engines_policies(embedded_model) -> None:
    """EVICTION_SINK_TOKENS and EVICTION_H2O_RECENT_FRACTION configure the engine's `sink` and
    `h2o` policies; out of range they stop the server at start."""
    settings = load_settings(
        NO_ENV_FILE, EVICTION_SINK_TOKENS="40", EVICTION_H2O_RECENT_FRACTION="0.25"
    )
    config = settings.engine_config()
    config = replace(config, kv=replace(config.kv, max_active_tokens=4096))
    engine = LLMEngine.for_model(embedded_model, shared_backend(embedded_model, "eviction"), config)
    held = list(range(10))  # logical blocks of 16 tokens
    # 40 tokens are 3 blocks of sinks; a budget of 5 keeps them and the 2 most recent.
    assert engine.kv.eviction.policies["sink"].select_victims(held, 5, {}) == [3, 4, 5, 6, 7]
    # A quarter of 8 is 2 recent blocks (8, 9); the 6 best-scored older blocks fill the rest.
    # Blocks 0, 3 and 6 score 0, the lowest: two must go, and ties keep the earlier block.
    scores = {block: float(block % 3) for block in held}
    assert engine.kv.eviction.policies["h2o"].select_victims(held, 8, scores) == [3, 6]
    for name, value in [("EVICTION_SINK_TOKENS", "0"), ("EVICTION_H2O_RECENT_FRACTION", "0"),
                        ("EVICTION_H2O_RECENT_FRACTION", "1.5")]:  # fmt: skip
        with pytest.raises(SystemExit, match=f"invalid setting: .*{name}"):
            load_settings(NO_ENV_FILE, **{name: value})


def test_kv_check_integrity_reports_a_contradiction_when_the_engine_goes_idle(
    embedded_model,
) -> None:
    """KV_CHECK_INTEGRITY=true checks the KV bookkeeping each time the work runs out: quiet
    while it is sound, an error naming the block once a reference count is off by one."""
    settings = load_settings(NO_ENV_FILE, KV_CHECK_INTEGRITY="true")
    config = settings.engine_config()
    config = replace(config, kv=replace(config.kv, max_active_tokens=4096))
    assert config.kv.check_integrity
    engine = LLMEngine.for_model(
        embedded_model, shared_backend(embedded_model, "integrity"), config
    )
    seq = Sequence(list(range(100, 140)), SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.add(seq).accepted
    while engine.has_work:
        engine.step()
    with structlog.testing.capture_logs() as logs:
        engine.on_idle()
    assert [entry for entry in logs if entry["log_level"] == "error"] == []
    block = next(iter(engine.kv.pools["full"].live.values()))  # a cached block of the prompt
    block.ref_count += 1  # as a missed decref would leave it
    with structlog.testing.capture_logs() as logs:
        engine.on_idle()
    errors = [entry for entry in logs if entry["log_level"] == "error"]
    assert len(errors) == 1 and repr(block) in errors[0]["error"]
