"""What KV eviction costs in quality, and what it saves: perplexity and next-token agreement of
each policy (lru, sink, h2o) at KV budgets of 12.5%, 25% and 50% of the context, against the
full cache.

    python -m evals.eviction [--context 2048] [--budgets 0.125,0.25,0.5] [--texts GPL-3,LGPL-2.1]
    python -m evals.eviction --fast     # a 256-token context on one text, about half a minute

The texts are Debian's licence texts (package base-files, /usr/share/common-licenses/), plain
long English read at run time; each one's first `--context` tokens (BOS first) are one segment.

Teacher-forced decoding as in StreamingLLM's and H2O's perplexity figures: the text is read one
token per step, every configuration's sequence stepping together in one batch, and each token's
logits are computed against that sequence's cache as its eviction policy left it after the
previous step (the evicted cache of everything before it), never with the dropped keys. So a
policy is scored on what the server would compute, not on a recomputation over the full text.

It goes through the engine's own path: the KV manager (engine.kv.manager, with the real
policies and their block-granular budgets), the model runner's batch building and attention
recording (engine.runner), the custom backend and the paged attention (engine.model). Weights
are float32 run by the `packed` kernel (WEIGHTS=fp32 NUMERICS=fast: the same weights and maths
as `exact`, summed in another order; engine.model.kernel_select): on this 2-core machine a
batched step of 13 sequences took 0.057 s with it and 1.65 s with `exact`, which would make a
2,048-token run take hours. `--kernel exact` is there for whoever has the time.

The only departure from ModelRunner.forward is for the `h2o+sliding` line: it also reads the
attention mass of the sliding layers (PagedAttentionStep's mass_groups), to measure whether
they would help H2O; the engine's h2o uses H2O_MASS_GROUPS. Without that line (or in a step
where it does not record mass) the step is ModelRunner.forward itself, with attention explicit
in every step (no fused kernel), so that variants differ only in what they evict.

Speed and memory: the last `--timed-steps` positions of every sequence run one sequence per
step (round robin, so noise spreads evenly), giving the decode step time at the end of the text
with each cache; KV memory is the blocks each sequence holds at the end, in every cache group.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from engine.backends import create_backend
from engine.kv.eviction import make_policy
from engine.kv.manager import KVCacheManager
from engine.model.batch import ForwardBatch
from engine.model.loader import LoadedModel, load_model
from engine.model.paged_attention import H2O_MASS_GROUPS, PagedAttentionStep
from engine.request import Sequence
from engine.runner import ModelRunner, keyed_masses
from engine.sampling import SamplingParams
from engine.sched.output import plan_of
from evals.harness import write_results
from evals.plots import line_panels

TEXT_DIR = Path("/usr/share/common-licenses")
POLICIES = ("lru", "sink", "h2o")
SINK_TOKENS = 4  # StreamingLLM's four attention sinks (one block at the engine's block size)
H2O_RECENT_FRACTION = 0.5  # the engine's default: half the budget is the recent window
SLIDING_MASS = ("full", "sliding")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Variant:
    """One configuration: a policy at a KV budget (None: the full cache)."""

    name: str  # "full cache", "lru", "sink", "h2o" or "h2o+sliding"
    policy: str  # the engine's policy name
    fraction: float | None  # budget as a fraction of the context
    budget_tokens: int | None  # Sequence.max_kv_tokens
    mass_groups: tuple[str, ...] = H2O_MASS_GROUPS  # h2o: layers whose mass is counted


@dataclass
class Track:
    """One variant reading one segment: its sequence and what each step gave."""

    variant: Variant
    segment: str
    seq: Sequence
    nll: list[float] = field(default_factory=list)  # per position 0..context-2, of the next token
    argmax: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # timed (single-sequence) steps
    held_blocks: dict[str, int] = field(default_factory=dict)  # per cache group, at the end


class TeacherForcedDriver:
    """Steps sequences through the engine's KV manager and model runner, one token per step,
    returning every stepped sequence's next-token logits."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, kernel: str = "packed"
    ) -> None:
        backend = create_backend("custom", loaded, CPU, torch.float32, kernel)
        self.runner = ModelRunner(backend, num_blocks, block_size)
        # Variants must differ only in what they evict: every step attends explicitly, as the
        # steps that record h2o's mass must (fused kernels sum in another order).
        self.runner.fused_attention = False
        self.kv = KVCacheManager(
            self.runner.cache_groups,
            num_blocks,
            block_size,
            enable_prefix_caching=False,  # each sequence holds its own blocks: clean footprints
            sink_tokens=SINK_TOKENS,
            h2o_recent_fraction=H2O_RECENT_FRACTION,
        )

    def step(self, tracks: SequenceOf[Track]) -> torch.Tensor:
        """Compute the next position of each track's sequence (after allocating its slot), then
        advance, record attention mass for h2o and let the manager evict. Logits [len, vocab]."""
        chunks = [(t.seq, 1) for t in tracks]
        for seq, _ in chunks:
            if not self.kv.allocate(seq, 1):
                raise RuntimeError("the KV cache is too small for the configurations")
        plan = plan_of(self.kv, chunks)
        batch = self.runner.prepare(plan)
        extra = {t.variant.mass_groups for t in tracks if self.kv.wants_attention(t.seq)}
        extra.discard(H2O_MASS_GROUPS)
        if not extra:  # exactly the server's forward
            out = self.runner.forward(batch)
            logits, masses = out.logits, out.attention_mass
        else:
            logits, raw = self._forward_with_mass(batch, tracks)
            masses = None if raw is None else keyed_masses(batch, raw)
        for row, item in enumerate(plan.scheduled):
            if masses is not None and item.kv.wants_attention:
                self.kv.record_attention(item.seq, masses[row])
            item.seq.num_computed_tokens += 1
            self.kv.commit(item.seq)
        return logits

    @torch.inference_mode()
    def _forward_with_mass(
        self, batch: ForwardBatch, tracks: SequenceOf[Track]
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """ModelRunner.forward's three calls, keeping the attention step so each sequence gets
        the mass of the layers its variant counts."""
        runner = self.runner
        groups = tuple(sorted({g for t in tracks for g in t.variant.mass_groups}))
        step = PagedAttentionStep(
            batch, runner.kv_cache, runner.windows, runner.device, runner.kv_dtype, groups
        )
        logits = runner.backend.forward(
            batch.input_ids.to(runner.device),
            batch.positions.to(runner.device),
            step,
            batch.logits_indices.to(runner.device, torch.long),
        )
        if not step.masses:
            return logits, None
        by_groups = {
            t.variant.mass_groups: step.attention_mass(t.variant.mass_groups) for t in tracks
        }
        masses = [by_groups[t.variant.mass_groups] for t in tracks]
        return logits, [mass[row] for row, mass in enumerate(masses) if mass is not None]


def variants(fractions: SequenceOf[float], context: int, h2o_sliding: bool) -> list[Variant]:
    """The full cache, then every policy at every budget (h2o+sliding after h2o if asked)."""
    out = [Variant("full cache", "none", None, None)]
    for fraction in fractions:
        budget = round(fraction * context)
        for policy in POLICIES:
            out.append(Variant(policy, policy, fraction, budget))
        if h2o_sliding:
            out.append(Variant("h2o+sliding", "h2o", fraction, budget, SLIDING_MASS))
    return out


def read_segments(
    loaded: LoadedModel, names: SequenceOf[str], context: int
) -> dict[str, list[int]]:
    """Each text's first `context` tokens (BOS first)."""
    segments = {}
    for name in names:
        path = TEXT_DIR / name
        if not path.exists():
            raise SystemExit(f"{path} is missing: install Debian's base-files package")
        tokens = loaded.tokenizer(path.read_text()).input_ids[:context]
        if len(tokens) < context:
            raise SystemExit(f"{path} has {len(tokens)} tokens, fewer than --context {context}")
        segments[name] = tokens
    return segments


def evaluate(
    loaded: LoadedModel,
    segments: dict[str, list[int]],
    fractions: SequenceOf[float],
    block_size: int = 16,
    timed_steps: int = 16,
    h2o_sliding: bool = True,
    kernel: str = "packed",
    progress: bool = True,
) -> dict:
    """Run every variant over every segment; the per-variant summary (see summarize())."""
    context = len(next(iter(segments.values())))
    if any(len(tokens) != context for tokens in segments.values()):
        raise ValueError("every segment must have the same length")
    if not 0 <= timed_steps < context - 1:
        raise ValueError(f"timed_steps must be in [0, {context - 1})")
    configs = variants(fractions, context, h2o_sliding)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tracks = [
        Track(
            variant,
            name,
            Sequence(
                list(tokens),
                params,
                eviction_policy=variant.policy,
                max_kv_tokens=variant.budget_tokens,
            ),
        )
        for name, tokens in segments.items()
        for variant in configs
    ]
    blocks_per_seq = -(-context // block_size) + 1
    driver = TeacherForcedDriver(loaded, blocks_per_seq * len(tracks), block_size, kernel)

    def record(track: Track, logits: torch.Tensor) -> None:
        position = track.seq.num_computed_tokens - 1  # just computed
        target = track.seq.token_ids[position + 1]
        log_probs = torch.log_softmax(logits.double(), dim=-1)
        track.nll.append(-float(log_probs[target]))
        track.argmax.append(int(logits.argmax()))

    batched = context - 1 - timed_steps
    for _ in tqdm(range(batched), desc="batched steps", unit="step", disable=not progress):
        logits = driver.step(tracks)
        for track, row in zip(tracks, logits, strict=True):
            record(track, row)
    for _ in tqdm(range(timed_steps), desc="timed steps", unit="step", disable=not progress):
        for track in tracks:
            start = time.perf_counter()
            logits = driver.step([track])
            track.step_s.append(time.perf_counter() - start)
            record(track, logits[0])
    for track in tracks:
        track.held_blocks = {g: len(b) for g, b in driver.kv.tables.layout(track.seq).items()}
    return {"kernel": kernel, **summarize(tracks, driver, context, block_size, timed_steps)}


def summarize(
    tracks: list[Track],
    driver: TeacherForcedDriver,
    context: int,
    block_size: int,
    timed_steps: int,
) -> dict:
    """Per variant: perplexity over every scored token and over the second half (where every
    budget up to 50% is evicting), argmax agreement with the full cache on the same segment,
    KV held at the end (blocks per group, bytes) and the median timed decode step."""
    token_bytes = {spec.name: spec.bytes_per_token for spec in driver.runner.cache_groups}
    full = {t.segment: t for t in tracks if t.variant.budget_tokens is None}
    half = context // 2 - 1  # nll[i] scores token i + 1: from token context // 2 on
    rows: list[dict] = []
    for variant in dict.fromkeys(t.variant for t in tracks):
        mine = [t for t in tracks if t.variant == variant]
        nll = [x for t in mine for x in t.nll]
        tail = [x for t in mine for x in t.nll[half:]]
        same = [a == b for t in mine for a, b in zip(t.argmax, full[t.segment].argmax, strict=True)]
        same_tail = [
            a == b
            for t in mine
            for a, b in zip(t.argmax[half:], full[t.segment].argmax[half:], strict=True)
        ]
        held = {g: sum(t.held_blocks[g] for t in mine) / len(mine) for g in token_bytes}
        policy = make_policy(variant.policy, block_size, SINK_TOKENS, H2O_RECENT_FRACTION)
        budget_blocks = (
            None
            if variant.budget_tokens is None
            else max(variant.budget_tokens // block_size, policy.min_blocks)
        )
        steps = [s for t in mine for s in t.step_s]
        rows.append(
            {
                "variant": variant.name,
                "policy": variant.policy,
                "budget_fraction": variant.fraction,
                "budget_tokens": variant.budget_tokens,
                "budget_blocks": budget_blocks,
                "mass_groups": list(variant.mass_groups) if variant.policy == "h2o" else None,
                "perplexity": math.exp(statistics.fmean(nll)),
                "perplexity_second_half": math.exp(statistics.fmean(tail)),
                "agreement": statistics.fmean(same),
                "agreement_second_half": statistics.fmean(same_tail),
                "held_blocks": held,
                "kv_bytes": sum(held[g] * block_size * token_bytes[g] for g in held),
                "decode_step_ms": 1000 * statistics.median(steps) if steps else None,
                "nll": [t.nll for t in mine],
                "argmax": [t.argmax for t in mine],
            }
        )
    reference = rows[0]
    for row in rows:
        row["perplexity_vs_full"] = row["perplexity"] / reference["perplexity"]
        row["perplexity_second_half_vs_full"] = (
            row["perplexity_second_half"] / reference["perplexity_second_half"]
        )
        row["kv_vs_full"] = row["kv_bytes"] / reference["kv_bytes"]
        if row["decode_step_ms"] is not None and reference["decode_step_ms"]:
            row["decode_vs_full"] = row["decode_step_ms"] / reference["decode_step_ms"]
        else:
            row["decode_vs_full"] = None
    return {
        "context": context,
        "block_size": block_size,
        "segments": sorted({t.segment for t in tracks}),
        "scored_tokens_per_segment": context - 1,
        "timed_steps": timed_steps,
        "sink_tokens": SINK_TOKENS,
        "h2o_recent_fraction": H2O_RECENT_FRACTION,
        "rows": rows,
    }


def markdown_table(result: dict) -> str:
    """The summary as a markdown table (no per-token data)."""
    lines = [
        "| budget | policy | perplexity | vs full | 2nd-half ppl | vs full | agreement "
        "| 2nd-half agreement | KV at end (MiB) | vs full | decode step (ms) | vs full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        budget = (
            "100% (full cache)"
            if row["budget_tokens"] is None
            else f"{100 * row['budget_fraction']:g}% ({row['budget_tokens']} tok)"
        )
        step, speed = row["decode_step_ms"], row["decode_vs_full"]
        lines.append(
            f"| {budget} | {row['variant']} | {row['perplexity']:.3f} "
            f"| x{row['perplexity_vs_full']:.3f} | {row['perplexity_second_half']:.3f} "
            f"| x{row['perplexity_second_half_vs_full']:.3f} | {100 * row['agreement']:.1f}% "
            f"| {100 * row['agreement_second_half']:.1f}% | {row['kv_bytes'] / 2**20:.2f} "
            f"| x{row['kv_vs_full']:.3f} | {'-' if step is None else f'{step:.1f}'} "
            f"| {'-' if speed is None else f'x{speed:.2f}'} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Perplexity (whole text, second half) and agreement against the budget, one line per
    policy, the full cache as the reference line."""
    fractions = sorted({r["budget_fraction"] for r in result["rows"] if r["budget_fraction"]})
    x = [100 * f for f in fractions]
    names = list(dict.fromkeys(r["variant"] for r in result["rows"] if r["budget_tokens"]))
    reference = result["rows"][0]

    def series(key: str, scale: float = 1.0) -> dict[str, list[float]]:
        lines = {
            name: [
                scale * r[key]
                for f in fractions
                for r in result["rows"]
                if r["variant"] == name and r["budget_fraction"] == f
            ]
            for name in names
        }
        lines["full cache"] = [scale * reference[key]] * len(x)
        return lines

    line_panels(
        path,
        f"KV eviction on {', '.join(result['segments'])} ({result['context']}-token context, "
        f"teacher-forced, {result['kernel']} kernel)",
        x,
        [
            (series("perplexity"), "perplexity, every token (lower is better)"),
            (series("perplexity_second_half"), "perplexity, second half"),
            (series("agreement", 100), "argmax agreement with full cache (%)"),
        ],
        "KV budget (% of context)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048, help="tokens per segment")
    parser.add_argument("--budgets", default="0.125,0.25,0.5", help="fractions of the context")
    parser.add_argument("--texts", default="GPL-3,LGPL-2.1", help=f"files in {TEXT_DIR}")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--timed-steps", type=int, default=16)
    parser.add_argument(
        "--no-h2o-sliding", action="store_true", help="skip h2o with sliding-layer mass"
    )
    parser.add_argument("--kernel", default="packed", choices=["exact", "packed", "bf16", "int8"])
    parser.add_argument("--fast", action="store_true", help="256-token context, GPL-3 only")
    parser.add_argument("--name", default="eviction", help="results file name under results/")
    args = parser.parse_args()
    if args.fast:
        args.context, args.texts, args.timed_steps = 256, "GPL-3", 4

    loaded = load_model()
    torch.manual_seed(0)
    segments = read_segments(loaded, args.texts.split(","), args.context)
    fractions = [float(f) for f in args.budgets.split(",")]
    start = time.perf_counter()
    result = evaluate(
        loaded,
        segments,
        fractions,
        block_size=args.block_size,
        timed_steps=args.timed_steps,
        h2o_sliding=not args.no_h2o_sliding,
        kernel=args.kernel,
    )
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    result["texts"] = {name: str(TEXT_DIR / name) for name in segments}
    for row in result["rows"]:  # per-token data stays out of the committed JSON
        del row["nll"], row["argmax"]
    table = markdown_table(result)
    print(table)
    path = write_results(args.name, result)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
