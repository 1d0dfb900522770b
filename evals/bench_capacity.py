"""How many sequences a fixed KV budget holds at once: paged, lazily allocated blocks (measured
by running the engine) vs a contiguous reservation of the maximum length per sequence
(computed: budget // max_len).

    python -m evals.bench_capacity [--kv-tokens 16384] [--max-len 2048]
"""

from __future__ import annotations

import argparse
import random

import torch

from engine.backends import create_backend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.request import Sequence
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from evals.harness import token_prompt, write_results
from evals.plots import bar_chart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument(
        "--max-len", type=int, default=2048, help="the server's max sequence length"
    )
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()

    loaded = load_model()
    engine = LLMEngine.for_model(
        loaded,
        create_backend("custom", loaded, torch.device("cpu"), torch.float32),
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=2048),
            kv=KVConfig(max_active_tokens=args.kv_tokens, enable_prefix_caching=False),
        ),
    )  # fmt: skip
    rng = random.Random(3)
    for _ in range(args.requests):
        params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(token_prompt(loaded.tokenizer, rng, args.prompt_tokens), params))
    peak_running, peak_usage = 0, 0.0
    while engine.has_work:
        engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
        peak_usage = max(peak_usage, engine.kv.usage)
    contiguous = args.kv_tokens // args.max_len
    result = {
        "kv_tokens": args.kv_tokens,
        "max_len": args.max_len,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "peak_concurrent_paged": peak_running,
        "peak_kv_usage_paged": round(peak_usage, 3),
        "concurrent_contiguous": contiguous,
        "ratio": round(peak_running / max(contiguous, 1), 1),
        "preemptions": engine.scheduler.stats().num_preemptions,
    }
    print(result)
    path = write_results("bench_capacity", result)
    bar_chart(
        path.with_suffix(".png"),
        f"Sequences held at once in {args.kv_tokens} KV tokens",
        {"contiguous max-length": contiguous, "paged, lazy": peak_running},
        "concurrent sequences",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
