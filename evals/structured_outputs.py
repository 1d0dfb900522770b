"""Structured outputs (`response_format` json_schema) beside vLLM CPU: validity and speed.

    make peers      # once: vLLM CPU into .venv-vllm
    python -m evals.structured_outputs [--engines ours vllm] [--requests 200] [--seconds 60]
    python -m evals.structured_outputs --url http://127.0.0.1:8000 --name "some server"

Each engine is started alone on a free port (as bench_peers does: ours is `python -m app serve`
with `--ours-env` settings; vLLM CPU serves the checkpoint our loader converted, in the dtype
harness.vllm_cpu_dtype picks for this CPU, cores bound, tcmalloc and Intel OpenMP preloaded,
with Gemma's chat template); `--url` drives any OpenAI-compatible server already running.

Validity: `--requests` chat requests, temperature 1, `--max-tokens` 256, request i with seed
`--seed` + i, spread round-robin over SCHEMAS (enums, nested objects, arrays of objects,
integer ranges, required + optional fields, free strings and numbers, and bounded variants:
maxLength, maxItems, numeric bounds), each with `response_format: {"type": "json_schema",
"json_schema": {"name", "schema", "strict": true}}`. Every reply that ends with "stop" must parse
and validate against its schema (jsonschema); one that does not is a failure, as is an HTTP error.
Every engine gets the same schemas, prompts and seeds.

Speed: `--users` 16 closed-loop streaming users for `--seconds` each in four phases: every
request unconstrained, every request constrained by `--speed-schema`, half the users
constrained and half not, and a control of that mix without a grammar (the constrained half
sending unconstrained requests as long as the constrained replies were, ignore_eos): short
replies mean more prefills in every step, and the control holds that churn equal, so the
mixed phase's unconstrained half against the control's is what its neighbours' grammars cost.
Output tok/s is all completion tokens over the wall time (requests re-issued as each finishes;
those in flight at the deadline count in full), overall and per class; TPOT p50/p95 per class
is the cleaner per-token cost (a constrained reply ends when its JSON does, so it spends a
larger share of its time in prefill).

Writes evals/results/structured_outputs.{json,png} (or `--out` and its .png) and prints Markdown
tables naming the CPU and each engine's mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from jsonschema import Draft202012Validator

from evals.harness import (
    RESULTS,
    RequestTiming,
    cpu_flags,
    cpu_name,
    dtype_label,
    pct,
    running_server_process,
    vllm_cpu_dtype,
    write_results,
)

MODEL = "gemma-3-270m"
END_OF_TURN_ID = 106  # Gemma's <end_of_turn>: ours stops a chat reply on it, vLLM is told to

_NAME = {"type": "string"}
_SHORT = {"type": "string", "maxLength": 32}

# name -> (schema, prompts): short user messages asking for what the schema describes.
SCHEMAS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "enums": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        [
            "Call get_weather for Tokyo in celsius.",
            "I want the temperature in London, in fahrenheit please.",
            "Which city and unit should the weather tool use for Paris?",
            "Weather in Lima, metric units.",
        ],
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "name": _NAME,
                "age": {"type": "integer"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": _NAME,
                        "city": _NAME,
                        "country": {
                            "type": "object",
                            "properties": {"code": _NAME, "name": _NAME},
                            "required": ["code", "name"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
        [
            "Make up a person with a name, an age and a full postal address.",
            "Describe a customer record: name, age, street, city and country.",
            "Give me a fictional user profile with an address in Japan.",
        ],
    ),
    "nested_bounded": (
        {
            "type": "object",
            "properties": {
                "name": _SHORT,
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": _SHORT,
                        "city": _SHORT,
                        "country": {
                            "type": "object",
                            "properties": {
                                "code": {"type": "string", "minLength": 2, "maxLength": 2},
                                "name": _SHORT,
                            },
                            "required": ["code", "name"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        },
        [
            "Make up a person with a name, an age and a full postal address.",
            "Describe a customer record: name, age, street, city and country.",
            "Give me a fictional user profile with an address in Japan.",
        ],
    ),
    "array_of_objects": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": _NAME, "quantity": {"type": "integer"}},
                        "required": ["name", "quantity"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        [
            "List the groceries for a pancake breakfast with quantities.",
            "What should I pack for a weekend hike? Items and how many of each.",
            "A shopping list for a birthday party, with counts.",
        ],
    ),
    "array_of_objects_bounded": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 24},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["name", "quantity"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        [
            "List the groceries for a pancake breakfast with quantities.",
            "What should I pack for a weekend hike? Items and how many of each.",
            "A shopping list for a birthday party, with counts.",
        ],
    ),
    "int_range": (
        {
            "type": "object",
            "properties": {
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["year", "month", "day", "rating"],
            "additionalProperties": False,
        },
        [
            "When did you last see a film, and how many stars out of 5 would you give it?",
            "Pick a date in the 1990s and rate it from 1 to 5.",
            "Give a date for the next team meeting and its importance from 1 to 5.",
        ],
    ),
    "required_optional": (
        {
            "type": "object",
            "properties": {
                "title": _NAME,
                "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                "due_date": _NAME,
                "tags": {"type": "array", "items": _NAME},
                "estimate_hours": {"type": "number"},
            },
            "required": ["title", "priority"],
            "additionalProperties": False,
        },
        [
            "Create a task to renew my passport.",
            "Add a to-do: fix the leaking kitchen tap, it's urgent.",
            "Log a task for writing the quarterly report, due at the end of March.",
        ],
    ),
    "free_text": (
        {
            "type": "object",
            "properties": {"title": _NAME, "summary": _NAME, "score": {"type": "number"}},
            "required": ["title", "summary", "score"],
            "additionalProperties": False,
        },
        [
            "Review a book you like: a title, a short summary and a score.",
            "Summarise the plot of a famous film and score it.",
            "Write a headline and a summary for today's weather, with a score.",
        ],
    ),
    "free_text_bounded": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "summary": {"type": "string", "maxLength": 120},
                "score": {"type": "number", "minimum": 0, "maximum": 10},
            },
            "required": ["title", "summary", "score"],
            "additionalProperties": False,
        },
        [
            "Review a book you like: a title, a short summary and a score out of 10.",
            "Summarise the plot of a famous film and score it out of 10.",
            "Write a headline and a summary for today's weather, with a score out of 10.",
        ],
    ),
}

OUTCOMES = ("valid", "invalid", "length", "other", "error")


def response_format(name: str) -> dict[str, Any]:
    schema, _ = SCHEMAS[name]
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": True},
    }


def validity_plan(requests: int, seed: int) -> list[tuple[str, str, int]]:
    """(schema name, prompt, seed) for each validity request: round-robin over the schemas,
    each cycling through its prompts; the same plan for every engine."""
    names = list(SCHEMAS)
    plan = []
    for i in range(requests):
        name = names[i % len(names)]
        prompts = SCHEMAS[name][1]
        plan.append((name, prompts[(i // len(names)) % len(prompts)], seed + i))
    return plan


def score(schema: dict[str, Any], finish_reason: str | None, content: str | None) -> str:
    """One reply's outcome: "valid" (ended with stop, parses, validates), "invalid" (ended with
    stop but does not parse or validate: a failure), "length", or "other" finish reasons."""
    if finish_reason == "length":
        return "length"
    if finish_reason != "stop":
        return "other"
    try:
        value = json.loads(content or "")
    except ValueError:
        return "invalid"
    return "valid" if Draft202012Validator(schema).is_valid(value) else "invalid"


@dataclass
class Reply:
    schema: str
    seed: int
    outcome: str
    completion_tokens: int = 0
    prompt_tokens: int = 0
    content: str | None = None
    error: str | None = None


def summarize_validity(replies: list[Reply]) -> dict[str, dict[str, Any]]:
    """Per schema (and "all"): counts and shares of each outcome, mean tokens."""
    groups: dict[str, list[Reply]] = {}
    for reply in replies:
        groups.setdefault(reply.schema, []).append(reply)
    groups["all"] = list(replies)
    table = {}
    for name, group in groups.items():
        n = len(group)
        counts = {o: sum(r.outcome == o for r in group) for o in OUTCOMES}
        answered = [r for r in group if r.outcome != "error"]
        table[name] = {
            "requests": n,
            **counts,
            "stop_share": (counts["valid"] + counts["invalid"]) / n if n else 0.0,
            "valid_share": counts["valid"] / n if n else 0.0,
            "length_share": counts["length"] / n if n else 0.0,
            "mean_completion_tokens": (
                sum(r.completion_tokens for r in answered) / len(answered) if answered else None
            ),
            "mean_prompt_tokens": (
                sum(r.prompt_tokens for r in answered) / len(answered) if answered else None
            ),
        }
    return table


def request_body(
    model: str, prompt: str, schema: str | None, max_tokens: int, seed: int, extra: dict
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "temperature": 1.0, "max_tokens": max_tokens, "seed": seed, **extra,
    }  # fmt: skip
    if schema is not None:
        body["response_format"] = response_format(schema)
    return body


def _error_text(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:300]}"
    return repr(exc)[:300]


async def run_validity(
    base: str, model: str, plan: list[tuple[str, str, int]], max_tokens: int, users: int,
    extra: dict,
) -> list[Reply]:  # fmt: skip
    """Every planned request once (non-streaming), `users` at a time; replies in plan order."""
    replies: list[Reply | None] = [None] * len(plan)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(plan)):
        queue.put_nowait(i)
    async with httpx.AsyncClient(timeout=600) as client:

        async def user() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                name, prompt, seed = plan[i]
                body = request_body(model, prompt, name, max_tokens, seed, extra)
                try:
                    response = await client.post(base + "/v1/chat/completions", json=body)
                    response.raise_for_status()
                    data = response.json()
                except (httpx.HTTPError, ValueError) as exc:
                    replies[i] = Reply(name, seed, "error", error=_error_text(exc))
                    continue
                choice = data["choices"][0]
                content = choice["message"].get("content")
                usage = data.get("usage") or {}
                replies[i] = Reply(
                    name, seed, score(SCHEMAS[name][0], choice.get("finish_reason"), content),
                    completion_tokens=usage.get("completion_tokens", 0),
                    prompt_tokens=usage.get("prompt_tokens", 0), content=content,
                )  # fmt: skip

        await asyncio.gather(*(user() for _ in range(users)))
    return [r for r in replies if r is not None]


@dataclass
class Timed:
    constrained: bool
    timing: RequestTiming
    finish_reason: str | None


@dataclass
class Phase:
    timed: list[Timed] = field(default_factory=list)
    elapsed: float = 0.0
    errors: list[str] = field(default_factory=list)


async def stream_chat(client: httpx.AsyncClient, base: str, body: dict) -> Timed:
    """One streamed chat request, timed at the client (first content token, end)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    usage: dict = {}
    chunks = 0
    finish = None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code >= 400:
            await response.aread()
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    timing = RequestTiming(
        ttft_s=(first or end) - start, e2e_s=end - start,
        output_tokens=usage.get("completion_tokens", chunks),
    )  # fmt: skip
    return Timed("response_format" in body, timing, finish)


async def run_phase(
    base: str, model: str, constrained_users: list[bool], seconds: float, schema: str,
    max_tokens: int, seed: int, extra: dict, stand_in_tokens: int | None = None,
) -> Phase:  # fmt: skip
    """Closed loop: user u sends its next request as soon as its last one finished, constrained
    by `schema` when constrained_users[u]; users stop starting requests after `seconds`, and the
    elapsed time runs to the last completion (as harness.closed_loop). With `stand_in_tokens`,
    the constrained users send unconstrained requests of exactly that many tokens instead
    (ignore_eos), counted in the constrained class: the same churn without a grammar."""
    prompts = SCHEMAS[schema][1]
    phase = Phase()
    limits = httpx.Limits(max_connections=len(constrained_users) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + seconds

        async def user(u: int, constrained: bool) -> None:
            k = 0
            while time.perf_counter() < deadline:
                prompt = prompts[(u + k) % len(prompts)]
                stand_in = constrained and stand_in_tokens is not None
                body = request_body(
                    model, prompt, schema if constrained and not stand_in else None,
                    stand_in_tokens if stand_in else max_tokens, seed + 1000 * u + k, extra,
                )  # fmt: skip
                if stand_in:
                    body["ignore_eos"] = True
                k += 1
                try:
                    timed = await stream_chat(client, base, body)
                    phase.timed.append(replace(timed, constrained=constrained))
                except httpx.HTTPError as exc:
                    phase.errors.append(_error_text(exc))
                    return

        await asyncio.gather(*(user(u, c) for u, c in enumerate(constrained_users)))
        phase.elapsed = time.perf_counter() - start
    return phase


def summarize_phase(phase: Phase, users: list[bool]) -> dict[str, Any]:
    def cls(timed: list[Timed], n_users: int) -> dict[str, Any]:
        tokens = sum(t.timing.output_tokens for t in timed)
        tpot = [t.timing.tpot_s for t in timed if t.timing.tpot_s is not None]
        return {
            "users": n_users,
            "requests": len(timed),
            "output_tokens": tokens,
            "tok_s": round(tokens / phase.elapsed, 2) if phase.elapsed else None,
            "tok_s_per_user": round(tokens / phase.elapsed / n_users, 3) if n_users else None,
            "mean_output_tokens": round(tokens / len(timed), 1) if timed else None,
            "tpot_p50_s": round(pct(tpot, 50), 4),
            "tpot_p95_s": round(pct(tpot, 95), 4),
            "ttft_p50_s": round(pct([t.timing.ttft_s for t in timed], 50), 4),
            "finish_stop": sum(t.finish_reason == "stop" for t in timed),
            "finish_length": sum(t.finish_reason == "length" for t in timed),
        }

    return {
        "elapsed_s": round(phase.elapsed, 3),
        "errors": phase.errors[:5],
        "error_count": len(phase.errors),
        "overall": cls(phase.timed, len(users)),
        "unconstrained": cls([t for t in phase.timed if not t.constrained], users.count(False)),
        "constrained": cls([t for t in phase.timed if t.constrained], users.count(True)),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or a != a or b != b:  # None, zero or NaN
        return None
    return round(a / b, 3)


def speed_ratios(speed: dict[str, Any]) -> dict[str, float | None]:
    free, cons, mixed = (speed.get(k) for k in ("unconstrained", "constrained", "mixed"))
    if not free:
        return {}
    ratios: dict[str, float | None] = {}
    if cons:
        ratios["constrained_vs_unconstrained_tok_s"] = _ratio(
            cons["overall"]["tok_s"], free["overall"]["tok_s"]
        )
        ratios["constrained_vs_unconstrained_tpot_p50"] = _ratio(
            cons["constrained"]["tpot_p50_s"], free["unconstrained"]["tpot_p50_s"]
        )
    if mixed:
        ratios["mixed_overall_vs_unconstrained_tok_s"] = _ratio(
            mixed["overall"]["tok_s"], free["overall"]["tok_s"]
        )
        ratios["mixed_unconstrained_vs_unconstrained_tok_s_per_user"] = _ratio(
            mixed["unconstrained"]["tok_s_per_user"], free["unconstrained"]["tok_s_per_user"]
        )
        ratios["mixed_unconstrained_vs_unconstrained_tpot_p50"] = _ratio(
            mixed["unconstrained"]["tpot_p50_s"], free["unconstrained"]["tpot_p50_s"]
        )
        ratios["mixed_constrained_vs_unconstrained_tpot_p50"] = _ratio(
            mixed["constrained"]["tpot_p50_s"], free["unconstrained"]["tpot_p50_s"]
        )
    control = speed.get("control")
    if mixed and control:
        # What the unconstrained half pays for its neighbours' grammars, churn held equal.
        ratios["mixed_unconstrained_vs_control_tok_s_per_user"] = _ratio(
            mixed["unconstrained"]["tok_s_per_user"], control["unconstrained"]["tok_s_per_user"]
        )
        ratios["mixed_unconstrained_vs_control_tpot_p50"] = _ratio(
            mixed["unconstrained"]["tpot_p50_s"], control["unconstrained"]["tpot_p50_s"]
        )
    return ratios


# Gemma's chat template (as compat.chat_template renders it) for vLLM: the converted checkpoint,
# like the embedded GGUF, has none, and vLLM's chat endpoint refuses to guess one.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass
class Engine:
    name: str
    mode: str
    launch: Callable[[Path], AbstractContextManager[str]] | None  # None: not installed
    extra_body: dict = field(default_factory=dict)


@contextmanager
def _ours(log: Path, settings: dict[str, str]) -> Iterator[str]:
    with running_server_process(log, **settings) as (base, _):
        yield base


@contextmanager
def _vllm(log: Path, whitespace: str) -> Iterator[str]:
    from evals.bench_peers import vllm_server

    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp, "gemma.jinja")
        template.write_text(GEMMA_CHAT_TEMPLATE)
        # vLLM's xgrammar backend reads disable_any_whitespace from the server's config only (a
        # request's structured_outputs.disable_any_whitespace is ignored), and the config refuses
        # it with backend "auto": compact JSON means backend xgrammar.
        config: dict[str, Any] = {"backend": "auto"}
        if whitespace == "compact":
            config = {"backend": "xgrammar", "disable_any_whitespace": True}
        args = ("--chat-template", str(template), "--structured-outputs-config", json.dumps(config))
        with vllm_server(log, args) as base:
            yield base


@contextmanager
def _external(log: Path, base: str) -> Iterator[str]:
    yield base.rstrip("/")


def engines(args) -> list[Engine]:
    from evals.bench_peers import VLLM_VENV

    found = []
    if args.url:
        extra = json.loads(args.extra_body) if args.extra_body else {}
        found.append(Engine(args.name, "external", partial(_external, base=args.url), extra))
    for key in args.engines:
        if key == "ours":
            settings = {"MAX_BATCH_SIZE": str(args.users)}
            settings.update(kv.split("=", 1) for kv in args.ours_env)
            mode = " ".join(f"{k}={v}" for k, v in settings.items())
            found.append(Engine("gemma-serve", mode, partial(_ours, settings=settings)))
        elif key == "vllm":
            dtype, why = vllm_cpu_dtype()
            mode = (
                f"{dtype} ({why}), structured outputs "
                + (
                    "backend xgrammar, compact JSON (disable_any_whitespace)"
                    if args.vllm_whitespace == "compact"
                    else "backend auto, any JSON whitespace"
                )
                + ", stop_token_ids [<end_of_turn>]"
            )
            installed = (VLLM_VENV / "bin" / "vllm").exists()
            found.append(
                Engine(
                    f"vLLM CPU {dtype_label(dtype)}",
                    mode,
                    partial(_vllm, whitespace=args.vllm_whitespace) if installed else None,
                    # Ours ends a chat reply at <end_of_turn> by itself; vLLM, without a
                    # generation config naming it, only at <eos>.
                    {"stop_token_ids": [END_OF_TURN_ID]},
                )
            )
    return found


def _server_version(base: str) -> str | None:
    try:
        response = httpx.get(base + "/version", timeout=5)
        return response.json().get("version") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _served_model(base: str) -> str:
    try:
        return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return MODEL


def measure(engine: Engine, args, log: Path) -> dict[str, Any]:
    assert engine.launch is not None
    result: dict[str, Any] = {"mode": engine.mode, "extra_body": engine.extra_body}
    with engine.launch(log) as base:
        model = _served_model(base)
        result["server_version"] = _server_version(base)
        result["model"] = model
        extra = engine.extra_body
        if not args.skip_validity:
            plan = validity_plan(args.requests, args.seed)
            started = time.perf_counter()
            replies = asyncio.run(
                run_validity(base, model, plan, args.max_tokens, args.validity_users, extra)
            )
            table = summarize_validity(replies)
            result["validity"] = table
            result["validity_s"] = round(time.perf_counter() - started, 1)
            result["failures"] = [
                {"schema": r.schema, "seed": r.seed, "outcome": r.outcome,
                 "content": (r.content or "")[:500], "error": r.error}
                for r in replies if r.outcome in ("invalid", "error", "other")
            ][:20]  # fmt: skip
            result["samples"] = {
                r.schema: (r.content or "")[:300] for r in reversed(replies) if r.outcome == "valid"
            }
            a = table["all"]
            print(
                f"  validity: {a['valid']}/{a['requests']} valid, {a['invalid']} invalid, "
                f"{a['length']} length, {a['error']} errors ({result['validity_s']} s)",
                flush=True,
            )
        if not args.skip_speed:
            result["speed"] = run_speed(base, model, args, extra)
            result["speed_ratios"] = speed_ratios(result["speed"])
    return result


def run_speed(base: str, model: str, args, extra: dict) -> dict[str, Any]:
    users = args.users
    schema = args.speed_schema
    warm = [
        request_body(model, SCHEMAS[schema][1][0], s, 16, args.seed, extra) for s in (None, schema)
    ]
    refused = None
    with httpx.Client(timeout=600) as client:
        for body in warm:  # compiles the schema's grammar before anything is timed
            response = client.post(base + "/v1/chat/completions", json=body)
            if response.status_code >= 400:
                refused = f"HTTP {response.status_code}: {response.text[:300]}"
    phases = {
        "unconstrained": [False] * users,
        "constrained": [True] * users,
        "mixed": [u % 2 == 0 for u in range(users)],
        # The mixed phase's churn without a grammar: its constrained half replaced by
        # unconstrained requests as long as the constrained phase's replies were.
        "control": [u % 2 == 0 for u in range(users)],
    }
    speed: dict[str, Any] = {"schema": schema, "users": users, "seconds": args.seconds}
    for i, (name, constrained) in enumerate(phases.items()):
        stand_in = None
        if name == "control":
            mean = (speed.get("constrained") or {}).get("constrained", {}).get("mean_output_tokens")
            if not mean:
                continue
            stand_in = round(mean)
            speed["control_tokens"] = stand_in
        if refused and any(constrained):
            speed[name] = {"skipped": f"constrained requests refused: {refused}"}
            print(f"  speed {name}: skipped ({refused[:120]})", flush=True)
            continue
        phase = asyncio.run(
            run_phase(
                base, model, constrained, args.seconds, schema, args.speed_max_tokens,
                args.seed + 100_000 * (i + 1), extra, stand_in,
            )
        )  # fmt: skip
        speed[name] = summarize_phase(phase, constrained)
        s = speed[name]
        print(
            f"  speed {name}: {s['overall']['tok_s']} tok/s, {s['overall']['requests']} requests, "
            f"{s['error_count']} errors",
            flush=True,
        )
    return speed


def _f(value: Any, spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    if value is None or value != value:
        return "-"
    return f"{value * scale:{spec}}{unit}"


def markdown(results: dict[str, dict], header: str) -> str:
    out = [header, ""]
    validity = {n: r["validity"] for n, r in results.items() if "validity" in r}
    if validity:
        out += [
            "| schema | engine | requests | stop | valid | invalid | length | errors "
            "| mean completion tokens |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for schema in [*SCHEMAS, "all"]:
            for name, table in validity.items():
                row = table.get(schema)
                if not row:
                    continue
                out.append(
                    f"| {schema} | {name} | {row['requests']} | {_f(row['stop_share'], '.0%')} "
                    f"| {_f(row['valid_share'], '.0%')} | {row['invalid']} "
                    f"| {_f(row['length_share'], '.0%')} | {row['error']} "
                    f"| {_f(row['mean_completion_tokens'], '.1f')} |"
                )
        out.append("")
    speeds = {n: r["speed"] for n, r in results.items() if "speed" in r}
    if speeds:
        out += [
            "| engine | phase | tok/s | tok/s unconstrained | tok/s constrained "
            "| TPOT p50/p95 unconstrained | TPOT p50/p95 constrained | requests | errors |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, speed in speeds.items():
            for phase in ("unconstrained", "constrained", "mixed", "control"):
                s = speed.get(phase)
                if not s:
                    continue
                if "skipped" in s:
                    out.append(f"| {name} | {phase} | skipped | | | | | | |")
                    continue
                free, cons = s["unconstrained"], s["constrained"]

                def tpot(c: dict) -> str:
                    if not c["requests"]:
                        return "-"
                    p50, p95 = c["tpot_p50_s"], c["tpot_p95_s"]
                    return f"{_f(p50, '.0f', 1000)}/{_f(p95, '.0f', 1000)} ms"

                out.append(
                    f"| {name} | {phase} | {_f(s['overall']['tok_s'], '.1f')} "
                    f"| {_f(free['tok_s'] if free['requests'] else None, '.1f')} "
                    f"| {_f(cons['tok_s'] if cons['requests'] else None, '.1f')} "
                    f"| {tpot(free)} | {tpot(cons)} | {s['overall']['requests']} "
                    f"| {s['error_count']} |"
                )
        out += [
            "",
            "| engine | constrained / unconstrained tok/s | TPOT p50 constrained / "
            "unconstrained | mixed / unconstrained tok/s | mixed-unconstrained / unconstrained "
            "tok/s per user | mixed-unconstrained / unconstrained TPOT p50 | mixed-unconstrained "
            "/ control-unconstrained tok/s per user | mixed-unconstrained / "
            "control-unconstrained TPOT p50 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in results.items():
            q = r.get("speed_ratios") or {}
            if not q:
                continue
            out.append(
                f"| {name} | {_f(q.get('constrained_vs_unconstrained_tok_s'))} "
                f"| {_f(q.get('constrained_vs_unconstrained_tpot_p50'))} "
                f"| {_f(q.get('mixed_overall_vs_unconstrained_tok_s'))} "
                f"| {_f(q.get('mixed_unconstrained_vs_unconstrained_tok_s_per_user'))} "
                f"| {_f(q.get('mixed_unconstrained_vs_unconstrained_tpot_p50'))} "
                f"| {_f(q.get('mixed_unconstrained_vs_control_tok_s_per_user'))} "
                f"| {_f(q.get('mixed_unconstrained_vs_control_tpot_p50'))} |"
            )
    return "\n".join(out)


def plot(path: Path, results: dict[str, dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.5))
    width = 0.8 / max(len(names), 1)

    def grouped(ax, groups: list[str], values: Callable[[str, str], float | None], label: str):
        for j, name in enumerate(names):
            ys = [values(name, g) for g in groups]
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, [y if y is not None else 0 for y in ys], width, label=name)
        ax.set_xticks(range(len(groups)), groups, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)

    def valid(name: str, schema: str) -> float | None:
        row = results[name].get("validity", {}).get(schema)
        return 100 * row["valid_share"] if row else None

    def tok_s(name: str, phase: str) -> float | None:
        s = results[name].get("speed", {}).get(phase) or {}
        return s["overall"]["tok_s"] if "overall" in s else None

    classes = [
        ("unconstrained", "unconstrained"), ("constrained", "constrained"),
        ("mixed", "unconstrained"), ("mixed", "constrained"),
    ]  # fmt: skip

    def tpot(name: str, key: str) -> float | None:
        phase, cls = key.split(": ")
        s = results[name].get("speed", {}).get(phase) or {}
        c = s.get(cls)
        return 1000 * c["tpot_p50_s"] if c and c["requests"] else None

    grouped(axes[0], [*SCHEMAS, "all"], valid, "valid replies (%)")
    grouped(axes[1], ["unconstrained", "constrained", "mixed"], tok_s, "output tokens/s")
    grouped(axes[2], [f"{p}: {c}" for p, c in classes], tpot, "TPOT p50 (ms)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines", nargs="*", choices=["ours", "vllm"],
        help="engines to start, one at a time (default: both, or none with --url)",
    )  # fmt: skip
    parser.add_argument("--url", help="drive this running OpenAI-compatible server too")
    parser.add_argument("--name", default="server", help="the --url server's name in the tables")
    parser.add_argument("--extra-body", help="JSON merged into every request to the --url server")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--validity-users", type=int, default=16, help="validity concurrency")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0, help="per speed phase")
    parser.add_argument("--speed-schema", default="nested_bounded", choices=list(SCHEMAS))
    parser.add_argument("--speed-max-tokens", type=int, default=256)
    parser.add_argument(
        "--vllm-whitespace", choices=["compact", "any"], default="compact",
        help="vLLM's JSON whitespace (disable_any_whitespace); ours is compact by default",
    )  # fmt: skip
    parser.add_argument(
        "--ours-env", nargs="*", default=[], metavar="KEY=VALUE", help="settings for ours"
    )
    parser.add_argument("--skip-validity", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "structured_outputs.json")
    args = parser.parse_args()
    if args.engines is None:
        args.engines = [] if args.url else ["ours", "vllm"]

    flags = sorted(cpu_flags() & {"avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx2"})
    cpu = f"{cpu_name()}, {os.cpu_count()} cores ({', '.join(flags) or 'no AVX-512/AMX'})"
    results: dict[str, dict] = {}
    skipped, failed = [], {}
    for engine in engines(args):
        if engine.launch is None:
            skipped.append(engine.name)
            print(f"{engine.name}: not installed (make peers), skipped")
            continue
        print(f"{engine.name} [{engine.mode}]:", flush=True)
        slug = engine.name.lower().replace(" ", "_").replace(".", "")
        try:
            results[engine.name] = measure(
                engine, args, args.out.with_name(f"{args.out.stem}.{slug}.log")
            )
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"  {engine.name}: failed: {exc!r}", flush=True)
            failed[engine.name] = repr(exc)
    modes = "; ".join(
        f"{name} {r.get('server_version') or ''}: {r['mode']}".replace("  ", " ")
        for name, r in results.items()
    )
    header = (
        f"CPU: {cpu}. Engines: {modes}. Validity: {args.requests} requests, temperature 1, "
        f"max_tokens {args.max_tokens}, seeds {args.seed}+i. Speed: {args.users} closed-loop "
        f"users, {args.seconds:g} s per phase, constrained by `{args.speed_schema}`, "
        f"max_tokens {args.speed_max_tokens}."
    )
    table = markdown(results, header)
    print(table)
    dtype, why = vllm_cpu_dtype()
    payload = {
        "cpu": cpu, "vllm_dtype": {"dtype": dtype, "why": why},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "schemas": {name: schema for name, (schema, _) in SCHEMAS.items()},
        "skipped": skipped, "failed": failed, "results": results, "markdown": table,
    }  # fmt: skip
    path = write_results("structured_outputs", payload, args.out)
    if results:
        plot(path.with_suffix(".png"), results, f"Structured outputs on {cpu}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
