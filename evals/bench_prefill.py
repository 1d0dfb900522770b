"""Prefill steps on the embedded model in the default weight mode: a step that prefills
`--prompts` fresh prompts of `--prompt-tokens` tokens each (2,048 tokens by default, the step
budget), three ways taking turns in one process so the machine's drift hits them alike:
- `cpu_ops int8 kernel`: the engine as served; on a CPU with AVX512-VNNI and no AMX, cpu_ops'
  kernel runs every int8 call (engine.model.int8_kernels.PackedInt8Rows), each MLP as one op
  with its gelu and product fused (Int8GatedMLP);
- `fbgemm, cpu_ops row scale`: a second engine with that kernel withheld, so fbgemm runs every
  int8 call and ATen the gelu, as on a CPU without VNNI, its activations scaled by their row
  maximum in one cpu_ops pass (int8_kernels.FUSED_ROW_SCALE);
- `fbgemm, eager row scale`: the same with the eager ops that pass replaces.
Both fbgemm ways quantize the same integers; the cpu_ops kernel rounds a few activations one
level apart (x * 127 / m against x / m * 127), and its gelu's last bits can differ. Each round
times one prefill step per way and the decode steps after it (to `--output-tokens`); the
figures are medians over the rounds after the first. On a CPU where WEIGHTS=auto is not int8
(AMX: bf16-int8head) the int8 ways time int8.

The steps run on a thread of their own, as the server's engine loop does, with the heap set up
as the server sets it (engine.host_memory.keep_step_memory), or with glibc's defaults under
`--default-heap`; each way's minor page faults per prefill step are reported beside its time.

With `--profile`, a torch.profiler table of one more prefill step as served: where its time
goes by operator.

    python -m evals.bench_prefill [--rounds 8] [--prompts 16] [--prompt-tokens 128]
                                  [--default-heap] [--profile]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import threading
import time
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from engine.backends.custom import CustomBackend
from engine.config import EngineConfig, KVConfig
from engine.host_memory import keep_step_memory
from engine.llm_engine import LLMEngine
from engine.model import cpu_ops, int8_kernels
from engine.model.kernel_select import kernel_for
from engine.model.loader import EMBEDDED_MODEL, load_model
from engine.request import Sequence
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from evals.harness import RESULTS, token_prompt, write_results

WAYS = ("fbgemm, eager row scale", "fbgemm, cpu_ops row scale", "cpu_ops int8 kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--default-heap", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    heap = "glibc defaults" if args.default_heap or not keep_step_memory() else "the server's"
    thread = threading.Thread(target=run, args=(args, heap), name="engine-loop")
    thread.start()
    thread.join()


def run(args: argparse.Namespace, heap: str) -> None:
    if not cpu_ops.available():
        raise SystemExit("the fused CPU kernels could not be built here (see the log)")
    if kernel_for("auto", "fast", torch.device("cpu")) != "int8":
        print("note: WEIGHTS=auto is not int8 here; timing int8")
    budget = args.prompts * args.prompt_tokens
    served = default_engine(args.prompts, budget)
    # The same engine with cpu_ops' int8 kernel withheld: the int8 modules build fbgemm's, and
    # each MLP runs as its linears (GateUpMLP) instead of Int8GatedMLP.
    with (
        mock.patch.object(int8_kernels.PackedInt8Rows, "where_supported", return_value=None),
        mock.patch.object(int8_kernels.Int8GatedMLP, "where_supported", return_value=None),
    ):
        library = default_engine(args.prompts, budget)
    engines = {WAYS[0]: library, WAYS[1]: library, WAYS[2]: served}
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=1.0)
    prefill: dict[str, list[float]] = {way: [] for way in WAYS}
    decode: dict[str, list[float]] = {way: [] for way in WAYS}
    faults: dict[str, list[int]] = {way: [] for way in WAYS}
    for round_index in range(args.rounds + 1):  # the first round warms up
        for way in WAYS if round_index % 2 else reversed(WAYS):
            int8_kernels.FUSED_ROW_SCALE = way != WAYS[0]
            engine = engines[way]
            prompts = [
                token_prompt(engine.tokenizer, rng, args.prompt_tokens) for _ in range(args.prompts)
            ]
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            first, rest = timed_steps(engine, prompts, params)
            if round_index:
                prefill[way].append(first)
                decode[way] += rest
                faults[way].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    int8_kernels.FUSED_ROW_SCALE = True
    ms = {way: 1000 * statistics.median(prefill[way]) for way in WAYS}
    decode_ms = {way: 1000 * statistics.median(decode[way]) for way in WAYS}
    step_faults = {way: statistics.median(faults[way]) for way in WAYS}
    tokens = args.prompts * args.prompt_tokens
    lines = [
        f"| way | prefill step ms ({args.prompts} x {args.prompt_tokens} tokens) "
        f"| prompt tokens/s | decode step ms ({args.prompts} rows) | minor page faults |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {way} | {ms[way]:.0f} | {1000 * tokens / ms[way]:.0f} | {decode_ms[way]:.1f} "
            f"| {step_faults[way]:.0f} |"
            for way in WAYS
        ),
    ]
    markdown = "\n".join(lines)
    print(f"{torch.get_num_threads()} threads, {args.rounds} rounds, int8, heap {heap}")
    print(markdown)
    if args.profile:
        print(profile_prefill(served, rng, args, params))
    path = write_results(
        "bench_prefill",
        {"rounds": args.rounds, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
         "kernel": "int8", "heap": heap, "prefill_step_ms": ms, "decode_step_ms": decode_ms,
         "prefill_step_minor_faults": step_faults, "markdown": markdown},
        RESULTS / f"bench_prefill{'_default_heap' if args.default_heap else ''}.json",
    )  # fmt: skip
    print(f"wrote {path}")


def default_engine(max_seqs: int, budget: int) -> LLMEngine:
    """WEIGHTS=int8, NUMERICS=fast (the default mode on CPUs without AMX) with a step budget
    that prefills every prompt at once and no prefix cache (every prompt is computed)."""
    kernel = "int8"
    device = torch.device("cpu")
    loaded = load_model(EMBEDDED_MODEL, torch.float32)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
        kv=KVConfig(enable_prefix_caching=False),
    ).with_auto_kv_cache_dtype(kernel, torch.float32)
    backend = CustomBackend(
        loaded.config, loaded.state_dict, device, torch.float32, loaded.max_model_len, kernel
    )
    return LLMEngine.for_model(loaded, backend, config)


def timed_steps(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[float]]:
    """Seconds of the step that prefills `prompts`, and of each decode step after it."""
    for prompt in prompts:
        engine.add(Sequence(list(prompt), params))
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter() - start
    rest = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        rest.append(time.perf_counter() - start)
    return first, rest


def profile_prefill(
    engine: LLMEngine, rng: random.Random, args: argparse.Namespace, params: SamplingParams
) -> str:
    """torch.profiler's table of one prefill step's operators, by their own time."""
    for _ in range(args.prompts):
        engine.add(Sequence(token_prompt(engine.tokenizer, rng, args.prompt_tokens), params))
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        engine.step()
    while engine.has_work:
        engine.step()
    return str(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
