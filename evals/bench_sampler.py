"""The sampler's Gumbel-max race (engine/sampler.py) on the embedded model's own logits.

The logits: the embedded model teacher-forced over the questions and answers of
evals/data/mc_questions.jsonl and over a string of random common words, rows taken at positions
spread over each text (262,144 tokens each); the table gives their median entropy. For each
temperature and row count, timed in turns (each round calls every way once per case, in a
shuffled order; the figure is each one's median over the rounds):

- kernel: cpu_ops.gumbel_argmax, the race the sampler runs on the CPU;
- torch race: race_torch, the same race in torch ops, which runs where the kernel does not;
- sample(): a whole Sampler.sample call on seeded rows without top-k, top-p or min-p, which
  is the kernel plus the per-row keys.

Greedy rows (temperature 0) take the first maximum instead, timed the same way per row count:
cpu_ops.row_argmax, what the sampler runs on the CPU, against torch.max(dim).indices.

And what the kernel's exact pruning skips, replayed here in torch ops on the same rows
(csrc/cpu_ops.cpp describes the bounds): the share of tokens in blocks skipped without even a
hash, and how many tokens per row got the logarithms of their noise.

    python -m evals.bench_sampler [--rows 16 64] [--temperatures 0.7 1.0 1.5] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from engine.model import cpu_ops
from engine.model.loader import load_model
from engine.random_draw import WORD, mix32, race_torch
from engine.sampler import Sampler, SamplingRow, _keys
from engine.sampling import SamplingParams
from evals.harness import ROOT, hf_reference_model, make_prompt, write_results

WAYS = ("kernel", "torch race", "sample()")
GREEDY_WAYS = ("row_argmax", "torch max")
# csrc/cpu_ops.cpp's kRaceBlock, kRaceSlack and kGumbelMax.
BLOCK = 64
LN2 = 0.693147180559945
SLACK = 1e-3
GUMBEL_MAX = 33 * LN2 + SLACK


@torch.inference_mode()
def model_logits(rows: int) -> torch.Tensor:
    """[rows, vocab] float32: the embedded model's next-token logits at positions spread over two
    texts, half the rows each: the multiple-choice questions with their answers (mostly
    predictable) and a string of random common words (hard to predict)."""
    loaded = load_model()
    model = hf_reference_model(loaded)
    lines = (ROOT / "evals" / "data" / "mc_questions.jsonl").read_text().splitlines()
    questions = "\n".join(
        f"Question: {q['question']}\nAnswer: {q['choices'][q['answer']]}"
        for q in map(json.loads, lines)
    )
    words = make_prompt(random.Random(0), 400)
    parts = []
    for text, count in ((questions, rows - rows // 2), (words, rows // 2)):
        ids = loaded.tokenizer(text, return_tensors="pt").input_ids
        positions = torch.linspace(1, ids.shape[1] - 1, count).long()
        parts.append(model(ids, logits_to_keep=positions).logits[0].float())
    # Interleaved, so that the first rows (the smaller row counts) hold both kinds.
    return torch.stack([part[i] for i in range(rows) for part in parts if i < len(part)])


def race_keys(count: int) -> torch.Tensor:
    rows = [SamplingRow(SamplingParams(seed=s), [], [], 0) for s in range(count)]
    return torch.tensor(_keys(rows), dtype=torch.long)


def replay(logits: torch.Tensor, inverse_temperature: float, key: int) -> tuple[float, int]:
    """The kernel's pruning on one row: (share of tokens in skipped blocks, tokens whose noise
    got its logarithms). The running best before each token is the prefix maximum of every
    score: a token the kernel did not score cannot have raised it."""
    vocab = logits.shape[0]
    assert vocab % BLOCK == 0
    inv = torch.tensor(inverse_temperature, dtype=torch.float32)
    top = logits.max()
    first = int((logits == top).nonzero()[0])
    s = (logits - top) * inv
    keys = torch.tensor([key])
    low, high = keys & WORD, keys >> 32
    a = mix32(low ^ mix32(high))
    b = mix32(high ^ mix32(low ^ 0x9E3779B9))
    bits = mix32(mix32((torch.arange(vocab) + a) & WORD) ^ b)
    complement = (WORD - bits).float()
    noise = -torch.log(-torch.log1p(-(complement.double() + 0.5) * 2.0**-32))
    exponent = torch.where(complement == 0, -127, torch.frexp(complement).exponent - 1)
    bound = s + ((32 - exponent).float() * LN2 + SLACK)
    scores = s.double() + noise
    start = noise[first]
    running = torch.cat([start[None], torch.maximum(scores.cummax(0).values[:-1], start)])
    bar = running.float()
    block_bar = bar.view(-1, BLOCK)[:, 0]
    block_max = logits.view(-1, BLOCK).max(dim=1).values
    scanned = (block_max - top) * inv + GUMBEL_MAX >= block_bar
    reached = bound.view(-1, BLOCK).max(dim=1).values >= block_bar
    logs = (scanned & reached)[:, None] & (bound.view(-1, BLOCK) >= bar.view(-1, BLOCK))
    return 1 - float(scanned.float().mean()), int(logs.sum())


def median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.5])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the fused CPU kernels could not be built here (see the log)")
    logits = model_logits(max(args.rows))
    vocab = logits.shape[1]
    keys = race_keys(logits.shape[0])
    sampler = Sampler()

    def call(way: str, rows: int, temperature: float) -> Callable[[], object]:
        x = logits[:rows]
        inverse = torch.full((rows,), 1 / temperature)
        if way == "kernel":
            return lambda: cpu_ops.gumbel_argmax(x, inverse, keys[:rows])
        if way == "torch race":
            return lambda: race_torch(x, inverse, keys[:rows])
        params = SamplingParams(temperature=temperature, seed=0)
        sampling_rows = [SamplingRow(params, [], [], step) for step in range(rows)]
        return lambda: sampler.sample(x, sampling_rows)

    def greedy(way: str, rows: int) -> Callable[[], object]:
        x = logits[:rows]
        if way == "row_argmax":
            return lambda: cpu_ops.row_argmax(x)
        return lambda: x.max(dim=-1).indices

    cases = [(w, n, t) for w in WAYS for n in args.rows for t in args.temperatures]
    cases += [(w, n, 0.0) for w in GREEDY_WAYS for n in args.rows]
    times: dict[tuple[str, int, float], list[float]] = {case: [] for case in cases}
    rng = random.Random(0)
    for round_index in range(args.rounds + 1):  # the first round warms up
        rng.shuffle(cases)
        for case in cases:
            way, rows, temperature = case
            fn = greedy(way, rows) if way in GREEDY_WAYS else call(way, rows, temperature)
            started = time.perf_counter()
            fn()
            if round_index:
                times[case].append(time.perf_counter() - started)

    replays = {
        t: [replay(logits[r], 1 / t, int(keys[r])) for r in range(logits.shape[0])]
        for t in args.temperatures
    }
    entropies = {
        t: [float(-(p * p.clamp_min(1e-30).log()).sum()) for p in torch.softmax(logits / t, -1)]
        for t in args.temperatures
    }

    results = []
    for rows in args.rows:
        for t in args.temperatures:
            skipped = statistics.mean(skip for skip, _ in replays[t][:rows])
            logs = statistics.mean(count for _, count in replays[t][:rows])
            results.append(
                {"rows": rows, "vocab": vocab, "temperature": t,
                 "median entropy nats": round(statistics.median(entropies[t][:rows]), 2),
                 **{f"{way} ms": round(median_ms(times[way, rows, t]), 2) for way in WAYS},
                 "tokens in skipped blocks": round(skipped, 4),
                 "tokens with logarithms per row": round(logs, 1),
                 "tokens needing no noise": round(1 - logs / vocab, 6)}
            )  # fmt: skip
    lines = [
        "| rows x vocab | T | entropy | kernel, ms | torch race, ms | sample(), ms "
        "| tokens in skipped blocks | logarithms per row | tokens needing no noise |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['rows']} x {vocab:,} | {r['temperature']} | {r['median entropy nats']} "
            f"| {r['kernel ms']:.2f} | {r['torch race ms']:.1f} | {r['sample() ms']:.2f} "
            f"| {100 * r['tokens in skipped blocks']:.1f}% "
            f"| {r['tokens with logarithms per row']:.1f} "
            f"| {100 * r['tokens needing no noise']:.4f}% |"
            for r in results
        ),
    ]
    greedy_ms = {
        str(rows): {way: round(median_ms(times[way, rows, 0.0]), 2) for way in GREEDY_WAYS}
        for rows in args.rows
    }
    lines += [
        "",
        "| greedy, rows x vocab | row_argmax, ms | torch max(dim), ms |",
        "|---|---:|---:|",
        *(
            f"| {rows} x {vocab:,} | {ms['row_argmax']:.2f} | {ms['torch max']:.2f} |"
            for rows, ms in greedy_ms.items()
        ),
    ]
    table = "\n".join(lines)
    print(table)
    path = write_results(
        "bench_sampler",
        {"threads": torch.get_num_threads(), "rounds": args.rounds, "rows": results,
         "greedy_ms": greedy_ms, "markdown": table},
    )  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()
