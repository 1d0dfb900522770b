"""What shared pages cost a decode step: the same backend and sequences over a pool per cache
group (engine.kv.sizing.blocks_per_group) and over one page pool the groups share
(engine.kv.sizing.shared_pages), timed in turns.

Shared pages keep a sliding-window block's layers on several pages, so each step moves the
slots of the layers off a block's first page (engine.model.paged_attention: once per page and
lane part of a group, from the block tables). This measures what that costs, past the window
where it matters: N sequences of `--context` distinct tokens are prefilled once in each layout
(two runners over one backend), then every round runs `--steps` decode steps of each layout in
a shuffled order, so the machine's drift hits both alike; the figure is the median step
(batch build, forward and greedy pick) over all rounds.

- `--model embedded`: Gemma 3 270M in the server's default mode (`WEIGHTS=auto`, fast
  numerics, its KV dtype); its 15 sliding layers sit on 5 pages of 3 lanes.
- `--model gemma4`: random weights in the layer shapes of transformers' default
  Gemma4TextConfig (5 full-attention layers of 4 KV heads x 512 and 25 sliding ones of
  4 x 256 over 512 tokens) with a small hidden size, MLP and vocabulary, float32 with the
  packed kernels. Its pages are one lane, two sliding layers to a lane: a full block on 5
  pages, a sliding one on 13, so 29 places a step moves slots to. With small linear layers,
  the KV layout's share of a step is larger than in a real Gemma 4.

    python -m evals.bench_kv_layout [--model embedded|gemma4] [--users 1 16 32] [--rounds 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from tqdm import tqdm
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from engine.backends.base import InferenceBackend
from engine.backends.custom import CustomBackend
from engine.config import EngineConfig, KVConfig
from engine.kv.layout import SharedPages
from engine.kv.manager import KVCacheManager
from engine.kv.sizing import blocks_per_group, shared_pages
from engine.model.kv_cache import cache_group_specs
from engine.offline import LLM
from engine.request import Sequence
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.sched.output import plan_of
from evals.harness import write_results
from evals.plots import bar_chart

LAYOUTS = ("pool per group", "shared pages")
BLOCK_SIZE = 16
CHUNK = 512


def gemma4_backend(max_len: int) -> InferenceBackend:
    S, F = "sliding_attention", "full_attention"
    config = Gemma4TextConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, global_head_dim=512,
        num_kv_shared_layers=0, hidden_size_per_layer_input=0, sliding_window=512,
        max_position_embeddings=max_len, layer_types=([S] * 5 + [F]) * 5,
    )  # fmt: skip
    torch.manual_seed(0)
    weights = Gemma4ForCausalLM(config).state_dict()  # transformers' random initialization
    return CustomBackend(config, weights, torch.device("cpu"), torch.float32, max_len, "packed")


class Layout:
    """One layout's runner and KV manager over the shared backend, with its N sequences."""

    def __init__(
        self,
        backend: InferenceBackend,
        kv_dtype: torch.dtype,
        sizes: dict[str, int] | SharedPages,
        prompts: list[list[int]],
    ) -> None:
        self.runner = ModelRunner(backend, sizes, BLOCK_SIZE, kv_dtype)
        self.kv = KVCacheManager(
            self.runner.cache_groups, sizes, BLOCK_SIZE, enable_prefix_caching=False
        )
        self.seqs = [Sequence(list(p), SamplingParams(max_tokens=10**6)) for p in prompts]
        for seq in self.seqs:
            self.kv.match_prefix(seq)
            while seq.num_computed_tokens < seq.num_prompt_tokens:
                count = min(CHUNK, seq.num_prompt_tokens - seq.num_computed_tokens)
                self._forward([(seq, count)])

    def _forward(self, chunks: list[tuple[Sequence, int]]) -> None:
        for seq, count in chunks:
            assert self.kv.allocate(seq, count), "the budget is too small"
        out = self.runner.forward(self.runner.prepare(plan_of(self.kv, chunks)))
        tokens = out.logits.argmax(dim=-1).tolist()
        for (seq, count), token in zip(chunks, tokens, strict=True):
            seq.num_computed_tokens += count
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(token)
            self.kv.commit(seq)

    def decode_step(self) -> float:
        started = time.perf_counter()
        self._forward([(seq, 1) for seq in self.seqs])
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["embedded", "gemma4"], default="embedded")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--context", type=int, default=700, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per turn")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    max_len = args.context + args.steps * (args.rounds + 1) + 16
    if args.model == "embedded":
        llm = LLM(
            weights="auto", numerics="fast", config=EngineConfig(kv=KVConfig(max_active_tokens=64))
        )
        backend, kv_dtype = llm.engine.backend, llm.engine.runner.kv_dtype
        vocab = 262_000
    else:
        backend, kv_dtype, vocab = gemma4_backend(max_len), torch.float32, 8000
    groups = cache_group_specs(backend.arch, kv_dtype)
    rng = random.Random(0)
    steps: dict[tuple[str, int], list[float]] = {}
    for users in tqdm(args.users, desc="users"):
        prompts = [[rng.randrange(1000, vocab) for _ in range(args.context)] for _ in range(users)]
        # Room for every sequence at its longest in every layer, and a prefill chunk.
        budget = (users * max_len + CHUNK) * sum(g.bytes_per_token for g in groups)
        layouts = {
            LAYOUTS[0]: blocks_per_group(groups, budget, BLOCK_SIZE, users, CHUNK),
            LAYOUTS[1]: shared_pages(groups, budget, BLOCK_SIZE, users, CHUNK),
        }
        running = {
            name: Layout(backend, kv_dtype, sizes, prompts) for name, sizes in layouts.items()
        }
        order = list(running)
        for round_index in range(args.rounds + 1):  # the first round warms up
            rng.shuffle(order)
            for name in order:
                times = [running[name].decode_step() for _ in range(args.steps)]
                if round_index:
                    steps.setdefault((name, users), []).extend(times)
        del running
    rows = []
    for users in args.users:
        own, shared = (statistics.median(steps[name, users]) * 1000 for name in LAYOUTS)
        rows.append(
            {"users": users, "pool per group ms": round(own, 2),
             "shared pages ms": round(shared, 2), "change": round(shared / own - 1, 4)}
        )  # fmt: skip
    lines = [
        "| N | pool per group, ms per decode step | shared pages | change |",
        "|---:|---:|---:|---:|",
        *(
            f"| {r['users']} | {r['pool per group ms']:.2f} | {r['shared pages ms']:.2f} "
            f"| {100 * r['change']:+.1f}% |"
            for r in rows
        ),
    ]
    table = "\n".join(lines)
    print(table)
    name = "bench_kv_layout" + ("" if args.model == "embedded" else f"_{args.model}")
    path = write_results(
        name,
        {"model": args.model, "context": args.context, "steps": args.steps,
         "rounds": args.rounds, "kv_dtype": str(kv_dtype), "rows": rows, "markdown": table},
    )  # fmt: skip
    bar_chart(
        path.with_suffix(".png"),
        f"Decode step past the window, {args.context}-token contexts ({args.model})",
        {f"{layout}, N={r['users']}": r[f"{layout} ms"] for r in rows for layout in LAYOUTS},
        "ms per decode step (median)",
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
