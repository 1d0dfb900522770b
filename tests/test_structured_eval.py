"""evals/structured_outputs.py without a server: its schemas are valid JSON Schema, its plan is
the same for every engine, and its scorer counts hand-made replies as it should."""

from __future__ import annotations

import json

import jinja2.sandbox
import pytest
from jsonschema import Draft202012Validator

from evals.harness import RequestTiming
from evals.structured_outputs import (
    GEMMA_CHAT_TEMPLATE,
    SCHEMAS,
    Phase,
    Reply,
    Timed,
    score,
    speed_ratios,
    summarize_phase,
    summarize_validity,
    validity_plan,
)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schemas_are_valid_json_schema_with_prompts(name):
    schema, prompts = SCHEMAS[name]
    Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object" and prompts
    # OpenAI's json_schema name pattern, which our server enforces too.
    assert name.replace("_", "").isalnum() and len(name) <= 64


def test_schema_set_covers_the_kinds_asked_for():
    assert len(SCHEMAS) >= 6
    text = json.dumps([schema for schema, _ in SCHEMAS.values()])
    for keyword in ("enum", "minimum", "maximum", "maxLength", "maxItems", '"number"'):
        assert keyword in text
    optional = SCHEMAS["required_optional"][0]
    assert set(optional["required"]) < set(optional["properties"])


def test_plan_is_deterministic_round_robin_with_distinct_seeds():
    plan = validity_plan(200, 7)
    assert plan == validity_plan(200, 7)
    assert [seed for _, _, seed in plan] == list(range(7, 207))
    counts = {name: sum(p[0] == name for p in plan) for name in SCHEMAS}
    assert max(counts.values()) - min(counts.values()) <= 1
    assert all(prompt in SCHEMAS[name][1] for name, prompt, _ in plan)


def test_score():
    schema = SCHEMAS["int_range"][0]
    good = '{"year": 1999, "month": 12, "day": 3, "rating": 5}'
    assert score(schema, "stop", good) == "valid"
    assert score(schema, "stop", " " + good + "\n") == "valid"
    assert score(schema, "stop", good.replace("1999", "1899")) == "invalid"  # below minimum
    assert score(schema, "stop", good.replace("5}", "5.5}")) == "invalid"  # not an integer
    assert score(schema, "stop", good[:-1]) == "invalid"  # does not parse
    assert score(schema, "stop", good + "{}") == "invalid"  # trailing data
    assert score(schema, "stop", "") == "invalid"
    assert score(schema, "stop", None) == "invalid"
    assert score(schema, "length", good[:10]) == "length"
    assert score(schema, "length", good) == "length"  # counted as length, not valid
    assert score(schema, "abort", good) == "other"
    enums = SCHEMAS["enums"][0]
    assert score(enums, "stop", '{"city": "Paris", "unit": "celsius"}') == "valid"
    assert score(enums, "stop", '{"city": "Rome", "unit": "celsius"}') == "invalid"
    assert score(enums, "stop", '{"city": "Paris", "unit": "celsius", "x": 1}') == "invalid"
    bounded = SCHEMAS["free_text_bounded"][0]
    assert (
        score(bounded, "stop", json.dumps({"title": "t" * 41, "summary": "", "score": 1}))
        == "invalid"
    )


def test_summarize_validity_counts_and_shares():
    replies = [
        Reply("enums", 1, "valid", completion_tokens=10, prompt_tokens=20),
        Reply("enums", 2, "invalid", completion_tokens=30, prompt_tokens=20),
        Reply("enums", 3, "length", completion_tokens=256, prompt_tokens=20),
        Reply("enums", 4, "error", error="HTTP 400"),
        Reply("nested", 5, "valid", completion_tokens=40, prompt_tokens=10),
    ]
    table = summarize_validity(replies)
    enums = table["enums"]
    assert enums["requests"] == 4
    assert (enums["valid"], enums["invalid"], enums["length"], enums["error"]) == (1, 1, 1, 1)
    assert enums["stop_share"] == 0.5 and enums["valid_share"] == 0.25
    assert enums["length_share"] == 0.25
    assert enums["mean_completion_tokens"] == pytest.approx((10 + 30 + 256) / 3)  # errors left out
    assert table["nested"]["valid_share"] == 1.0
    assert table["all"]["requests"] == 5 and table["all"]["valid"] == 2


def _timed(constrained: bool, tokens: int, e2e: float) -> Timed:
    return Timed(constrained, RequestTiming(ttft_s=1.0, e2e_s=e2e, output_tokens=tokens), "stop")


def test_phase_summary_and_ratios():
    free = Phase([_timed(False, 101, 11.0)] * 4, elapsed=10.0)  # TPOT 0.1 s
    cons = Phase([_timed(True, 51, 6.0)] * 4, elapsed=10.0)  # TPOT 0.1 s
    mixed = Phase([_timed(False, 101, 21.0), _timed(True, 51, 6.0)], elapsed=10.0)
    speed = {
        "unconstrained": summarize_phase(free, [False] * 4),
        "constrained": summarize_phase(cons, [True] * 4),
        "mixed": summarize_phase(mixed, [True, False]),
    }
    assert speed["unconstrained"]["overall"]["tok_s"] == 40.4
    assert speed["unconstrained"]["unconstrained"]["tok_s_per_user"] == 10.1
    assert speed["constrained"]["unconstrained"]["requests"] == 0
    ratios = speed_ratios(speed)
    assert ratios["constrained_vs_unconstrained_tok_s"] == round(20.4 / 40.4, 3)
    assert ratios["constrained_vs_unconstrained_tpot_p50"] == 1.0
    assert ratios["mixed_unconstrained_vs_unconstrained_tpot_p50"] == 2.0
    assert ratios["mixed_unconstrained_vs_unconstrained_tok_s_per_user"] == 1.0


def test_vllm_chat_template_renders_gemma_turns_as_ours_does():
    """The template vLLM gets renders what compat.chat_template renders (its docstring's format),
    so both engines see the same prompt tokens."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(GEMMA_CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"},
    ]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nyo"
        "<end_of_turn>\n<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\n"
    )
    one = template.render(messages=messages[1:2], bos_token="<bos>", add_generation_prompt=True)
    assert one == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
