"""Single-stream speed of the forward pass: our `custom` backend in each linear-kernel mode
(float32 exact, float32 packed, bf16, bf16-int8head, int8) vs the `hf` backend (both inside
our engine) vs transformers' own `generate`, on the embedded model, same prompts, one run.

Prefill tokens/s: prompt tokens / time of the step that computes the whole prompt.
Decode tokens/s: tokens / time of the following one-token steps.

    python -m evals.bench_forward [--prompt-tokens 256] [--decode-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random

import torch

from engine.backends import create_backend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from evals.harness import (
    engine_step_seconds,
    hf_reference_model,
    time_generate,
    token_prompt,
    write_results,
)
from evals.plots import bar_chart


def engine_speed(
    kind: str, loaded, prompts: list[list[int]], decode_tokens: int, kernel: str = "exact"
) -> dict:
    backend = create_backend(kind, loaded, torch.device("cpu"), torch.float32, kernel)
    longest = max(len(p) for p in prompts)
    engine = LLMEngine.for_model(
        loaded,
        backend,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=longest),
            kv=KVConfig(
                enable_prefix_caching=False, max_active_tokens=longest + decode_tokens + 64
            ),
        ),
    )  # fmt: skip

    def run(prompt: list[int]) -> list[float]:
        """Seconds of each engine step: the first computes the prompt, the rest decode."""
        params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
        return engine_step_seconds(engine, [prompt], params)

    run(prompts[0])  # warm-up
    prefill_s = decode_s = 0.0
    prefill_tokens = decode_steps = 0
    for prompt in prompts:
        step_times = run(prompt)
        prefill_s += step_times[0]
        prefill_tokens += len(prompt)
        decode_s += sum(step_times[1:])
        decode_steps += len(step_times) - 1
    return {
        "prefill_tok_s": round(prefill_tokens / prefill_s, 1),
        "decode_tok_s": round(decode_steps / decode_s, 2),
        "decode_ms_per_token": round(1000 * decode_s / decode_steps, 2),
    }


def generate_speed(loaded, prompts: list[list[int]], decode_tokens: int) -> dict:
    model = hf_reference_model(loaded)
    time_generate(model, prompts[0], 4)  # warm-up
    prefill_s = decode_s = 0.0
    for prompt in prompts:
        first = time_generate(model, prompt, 1)
        full = time_generate(model, prompt, decode_tokens + 1)
        prefill_s += first
        decode_s += full - first
    tokens = sum(len(p) for p in prompts)
    steps = decode_tokens * len(prompts)
    return {
        "prefill_tok_s": round(tokens / prefill_s, 1),
        "decode_tok_s": round(steps / decode_s, 2),
        "decode_ms_per_token": round(1000 * decode_s / steps, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    loaded = load_model()
    rng = random.Random(0)
    prompts = [token_prompt(loaded.tokenizer, rng, args.prompt_tokens) for _ in range(args.repeats)]
    decode = args.decode_tokens
    results = {
        "custom fp32 exact": engine_speed("custom", loaded, prompts, decode),
        "custom fp32 fast (packed)": engine_speed("custom", loaded, prompts, decode, "packed"),
        "custom bf16": engine_speed("custom", loaded, prompts, decode, "bf16"),
        "custom bf16-int8head": engine_speed("custom", loaded, prompts, decode, "bf16-int8head"),
        "custom int8": engine_speed("custom", loaded, prompts, decode, "int8"),
        "hf (transformers model, engine)": engine_speed("hf", loaded, prompts, decode),
        "transformers generate": generate_speed(loaded, prompts, args.decode_tokens),
    }
    for name, row in results.items():
        print(
            f"{name:34s} prefill {row['prefill_tok_s']:8.1f} tok/s   decode "
            f"{row['decode_tok_s']:6.2f} tok/s ({row['decode_ms_per_token']} ms/token)"
        )
    path = write_results(
        "bench_forward",
        {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
         "repeats": args.repeats, "results": results},
    )  # fmt: skip
    bar_chart(
        path.with_suffix(".png"),
        "Single-stream speed, Gemma 3 270M",
        {name: row["decode_tok_s"] for name, row in results.items()},
        "decode tokens/s",
        {name: row["prefill_tok_s"] for name, row in results.items()},
        "prefill tokens/s",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
