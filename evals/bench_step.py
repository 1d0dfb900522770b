"""Engine steps on the embedded model with the fused CPU kernels (engine/model/cpu_ops.py) and
with the eager ops they replace, in the default weight mode, timed in turns.

Three engines on one loaded model, taking turns: norms, RoPE and residual adds fused
(engine.model.optimize's fuse_ops) and decode attention read in place from the paged pools
(the runner's paged_decode), as served; the same with each decoder layer run through its
modules (optimize's flat_layers=False: only where WEIGHTS=auto runs int8 on cpu_ops' kernel,
which Int8DecoderLayer calls directly; elsewhere the two engines are alike); or eager ops with
gathered K/V and PyTorch's fused attention. A
turn sends N requests of `--prompt-tokens` distinct token ids for `--output-tokens` tokens (EOS
ignored) and times every engine step once every prompt is in: whole decode steps, scheduler and
sampler included, as a server runs them, and where a fused step's time goes by phase
(engine/step_profile.py). Every round runs each (way, N) once in a shuffled order, so the
machine's drift hits both alike; the figure is the median decode step over all rounds.

With `--neighbour-duty D` another process busy-waits D of every 4 ms throughout, as a server's
event loop and a benchmark's client take their share of its cores: a kernel that splits its
work in equal shares up front waits on whichever thread lost its core (csrc/parallel.h).

With `--ops`, after the rounds, the served engine's decode steps run once more per N under
torch.profiler: each op's calls and self CPU time per step (the registered gemma_cpu kernels
that a fused layer stack calls in turn among them), so a step's time splits by kernel. The
profiler adds about a microsecond to every op call it records.

With `--compare-pages` a fourth engine takes its turns too: the served one (fused kernels)
built with huge pages off, its weights and KV pools on the ordinary 4 KB pages of PyTorch's
allocator (engine/model/huge_pages.py). In turns in one process, because this machine's memory
bandwidth moves between runs by more than the pages' difference.

The requests sample at `--temperature` (1 by default). At 0 they are greedy, and each step
takes its tokens from the LM head's own argmax without writing the logits
(EngineConfig.greedy_head); `--no-greedy-head` takes the logits and the sampler's argmax.

    python -m evals.bench_step [--users 1 16 32 64] [--rounds 8] [--output-tokens 24]
                               [--neighbour-duty 0.3] [--compare-pages]
                               [--temperature 0] [--no-greedy-head] [--ops]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import torch

from engine.backends.custom import CustomBackend
from engine.config import EngineConfig, KVConfig
from engine.llm_engine import LLMEngine
from engine.model import cpu_ops, huge_pages
from engine.model.kernel_select import kernel_for
from engine.model.loader import EMBEDDED_MODEL, load_model
from engine.request import Sequence
from engine.sampling import SamplingParams
from engine.sched.config import SchedulerConfig
from engine.step_profile import PHASES, StepProfile
from evals.harness import token_prompt, write_results
from evals.plots import bar_chart

WAYS = ("eager ops", "fused, layer modules", "fused kernels")
SMALL_PAGES = "fused kernels, 4 KB pages"  # --compare-pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--neighbour-duty", type=float, default=0.0)
    parser.add_argument("--compare-pages", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--no-greedy-head", action="store_true")
    parser.add_argument("--ops", action="store_true", help="a per-op profile of decode steps")
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the fused CPU kernels could not be built here (see the log)")
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=max(args.users),
            max_num_batched_tokens=max(args.users) * args.prompt_tokens,
        ),
        kv=KVConfig(enable_prefix_caching=False),
        greedy_head=not args.no_greedy_head,
    )
    ways = (*WAYS, SMALL_PAGES) if args.compare_pages else WAYS
    engines = engines_by_way(config, ways)
    rng = random.Random(0)
    steps: dict[tuple[str, int], list[float]] = {(w, n): [] for w in ways for n in args.users}
    phases: dict[tuple[str, int], list[dict]] = {(w, n): [] for w in ways for n in args.users}
    order = list(steps)
    with neighbour(args.neighbour_duty):
        run_rounds(engines, args, rng, order, steps, phases)
    ms = {key: 1000 * statistics.median(values) for key, values in steps.items()}
    pages = " | fused kernels, 4 KB pages | huge pages saved" if args.compare_pages else ""
    lines = [
        "| N | eager ops, ms per decode step | fused, layer modules | fused kernels (as served) "
        f"| saved | tok/s eager | tok/s fused{pages} |",
        "|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * args.compare_pages,
    ]
    for n in args.users:
        eager, modules, fused = (ms[way, n] for way in WAYS)
        row = (
            f"| {n} | {eager:.2f} | {modules:.2f} | {fused:.2f} | {100 * (1 - fused / eager):.1f}% "
            f"| {1000 * n / eager:.1f} | {1000 * n / fused:.1f} |"
        )
        if args.compare_pages:
            small = ms[SMALL_PAGES, n]
            row += f" {small:.2f} | {100 * (1 - fused / small):.1f}% |"
        lines.append(row)
    lines += [
        "",
        "Where a fused decode step goes (mean ms per phase, engine/step_profile.py):",
        "",
        "| N | " + " | ".join(PHASES) + " | step |",
        "|---:|" + "---:|" * (len(PHASES) + 1),
    ]
    profiles = {n: mean_phases(phases["fused kernels", n]) for n in args.users}
    for n, profile in profiles.items():
        cells = " | ".join(f"{profile[phase]:.2f}" for phase in PHASES)
        lines.append(f"| {n} | {cells} | {sum(profile.values()):.2f} |")
    served = engines["fused kernels"]
    ops = {n: op_profile(served, n, args, rng) for n in args.users} if args.ops else {}
    for n, table in ops.items():
        lines += [
            "",
            f"Ops of a fused decode step at N={n} (torch.profiler, self CPU, per step):",
            "",
            "| op | calls | ms | share |",
            "|---|---:|---:|---:|",
        ]
        total = sum(ms for _, ms in table.values())
        lines += [
            f"| {name} | {calls:.3g} | {ms:.3f} | {100 * ms / total:.1f}% |"
            for name, (calls, ms) in list(table.items())[:OP_ROWS]
        ]
    markdown = "\n".join(lines)
    print(
        f"{torch.get_num_threads()} threads, {args.rounds} rounds, "
        f"neighbour duty {args.neighbour_duty}, "
        f"temperature {args.temperature}, greedy head {not args.no_greedy_head}"
    )
    print(markdown)
    path = write_results(
        "bench_step",
        {"users": args.users, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
         "neighbour_duty": args.neighbour_duty, "compare_pages": args.compare_pages,
         "temperature": args.temperature, "greedy_head": not args.no_greedy_head,
         "output_tokens": args.output_tokens,
         "decode_step_ms": {way: {str(n): ms[way, n] for n in args.users} for way in ways},
         "fused_phase_ms": {str(n): profile for n, profile in profiles.items()},
         "op_calls_and_ms_per_step": {str(n): table for n, table in ops.items()},
         "markdown": markdown},
    )  # fmt: skip
    bar_chart(
        path.with_suffix(".png"),
        "Median decode step, default weight mode",
        {f"{way}, N={n}": ms[way, n] for n in args.users for way in ways},
        "ms per step",
    )
    print(f"wrote {path}")


def engines_by_way(config: EngineConfig, ways: tuple[str, ...]) -> dict[str, LLMEngine]:
    """The default weight mode's engine each way (WAYS, and SMALL_PAGES where asked), on one
    loaded model."""
    device = torch.device("cpu")
    kernel = kernel_for("auto", "fast", device)
    loaded = load_model(EMBEDDED_MODEL, torch.float32)
    config = config.with_auto_kv_cache_dtype(kernel, torch.float32)
    engines = {}
    for way in ways:
        fused = way != "eager ops"
        huge_pages.ENABLED = way != SMALL_PAGES  # the weights and, in for_model, the KV pools
        backend = CustomBackend(
            loaded.config, loaded.state_dict, device, torch.float32, loaded.max_model_len,
            kernel, fuse_ops=fused, flat_layers=way in ("fused kernels", SMALL_PAGES),
        )  # fmt: skip
        engines[way] = LLMEngine.for_model(loaded, backend, config)
        engines[way].runner.paged_decode = fused
    huge_pages.ENABLED = True
    return engines


def run_rounds(
    engines: dict[str, LLMEngine],
    args: argparse.Namespace,
    rng: random.Random,
    order: list[tuple[str, int]],
    steps: dict[tuple[str, int], list[float]],
    phases: dict[tuple[str, int], list[dict]],
) -> None:
    """Every (way, N) once per round, in a shuffled order, adding to `steps` and `phases`."""
    tokenizer = engines[WAYS[0]].tokenizer
    for round_index in range(args.rounds + 1):  # the first round warms up
        rng.shuffle(order)
        for way, users in order:
            prompts = [token_prompt(tokenizer, rng, args.prompt_tokens) for _ in range(users)]
            params = SamplingParams(
                max_tokens=args.output_tokens, ignore_eos=True, temperature=args.temperature
            )
            times, profile = decode_steps(engines[way], prompts, params)
            if round_index:
                steps[way, users] += times
                phases[way, users].append(profile)


# A process that busy-waits `duty` of every 4 ms period and sleeps the rest.
_NEIGHBOUR = """
import sys, time
busy = 0.004 * float(sys.argv[1])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(0.004 - busy)
"""


@contextlib.contextmanager
def neighbour(duty: float) -> Iterator[None]:
    """Another process taking `duty` of one core throughout (none at 0)."""
    if duty <= 0:
        yield
        return
    process = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(min(duty, 1.0))])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def prefill(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    """Add a request per prompt and step until each has its first token: a step prefills one
    prefill group of them (PREFILL_GROUP_TOKENS), so from 5 prompts of 128 tokens on, the first
    steps mix prompts with the decoding of those before them. The steps after are decode steps
    alone."""
    seqs = [Sequence(list(prompt), params) for prompt in prompts]
    for seq in seqs:
        engine.add(seq)
    while any(seq.num_output_tokens == 0 for seq in seqs):
        engine.step()


def decode_steps(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[float], dict[str, float]]:
    """Add a request per prompt, run the steps that prefill them, then time every decode step
    to the end; returns their seconds and the mean ms of each phase over them."""
    prefill(engine, prompts, params)
    engine.profile = StepProfile()
    times = []
    while engine.has_work:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    summary = engine.profile.summary()["phases"]
    return times, {phase: summary[phase]["ms"] for phase in PHASES}


OP_ROWS = 12  # ops listed per N (the JSON keeps them all)


def op_profile(
    engine: LLMEngine, users: int, args: argparse.Namespace, rng: random.Random
) -> dict[str, tuple[float, float]]:
    """op name -> (calls, self CPU ms) per decode step, over the steps of one turn of `users`
    requests after every prompt is in (decode steps alone), under torch.profiler, most time
    first."""
    prompts = [token_prompt(engine.tokenizer, rng, args.prompt_tokens) for _ in range(users)]
    params = SamplingParams(
        max_tokens=args.output_tokens, ignore_eos=True, temperature=args.temperature
    )
    prefill(engine, prompts, params)
    steps = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        while engine.has_work:
            engine.step()
            steps += 1
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {
        e.key: (e.count / steps, e.self_cpu_time_total / 1000 / steps)
        for e in events
        if e.self_cpu_time_total > 0
    }


def mean_phases(profiles: list[dict[str, float]]) -> dict[str, float]:
    return {phase: statistics.mean(p[phase] for p in profiles) for phase in PHASES}


if __name__ == "__main__":
    main()
