"""Fairness on the real model: tenant A keeps four times as many requests queued as tenant B,
both always backlogged, with more demand than the batch holds. Under `fcfs` service follows
arrivals (A gets about four fifths); under `vtc` both tenants get the same weighted service.

    python -m evals.bench_fairness [--steps 120] [--batch 8]
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
from evals.plots import line_chart


def run(policy: str, loaded, backend, args) -> dict:
    engine = LLMEngine.for_model(
        loaded,
        backend,
        EngineConfig(
            scheduler=SchedulerConfig(
                policy=policy, max_num_seqs=args.batch, max_num_batched_tokens=256,
                max_queue_len=1024,
            ),
            kv=KVConfig(max_active_tokens=16384, enable_prefix_caching=False),
        ),
    )  # fmt: skip
    rng = random.Random(4)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)

    def submit(tenant: str) -> None:
        engine.add(
            Sequence(token_prompt(loaded.tokenizer, rng, args.prompt_tokens), params, tenant=tenant)
        )

    def queued(tenant: str) -> int:
        return sum(s.tenant == tenant for s in engine.scheduler.waiting)

    gap, share = [], []
    for _ in range(args.steps):
        # Keep both backlogged, A arriving four times as often as B.
        while queued("A") < 4 * args.batch:
            submit("A")
        while queued("B") < args.batch:
            submit("B")
        engine.step()
        tenants = engine.scheduler.stats().tenants
        service = {name: tenants[name].service if name in tenants else 0.0 for name in ("A", "B")}
        gap.append(service["A"] - service["B"])
        share.append(service["B"] / max(service["A"] + service["B"], 1e-9))
    for seq in list(engine.scheduler.waiting) + list(engine.scheduler.running):
        engine.abort(seq.seq_id)
    return {"service_gap": gap, "b_share": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args()

    loaded = load_model()
    backend = create_backend("custom", loaded, torch.device("cpu"), torch.float32)
    results = {policy: run(policy, loaded, backend, args) for policy in ("fcfs", "vtc")}
    summary = {
        policy: {
            "final_service_gap_A_minus_B": round(r["service_gap"][-1], 1),
            "max_abs_service_gap": round(max(abs(g) for g in r["service_gap"]), 1),
            "final_share_of_B": round(r["b_share"][-1], 3),
        }
        for policy, r in results.items()
    }
    # One request's largest charge: prompt tokens at weight 1 plus output tokens at weight 2.
    summary["largest_request_charge"] = args.prompt_tokens + 2 * args.output_tokens
    print(summary)
    path = write_results("bench_fairness", {**vars(args), "summary": summary, "series": results})
    steps = list(range(1, args.steps + 1))
    line_chart(
        path.with_suffix(".png"),
        "Service gap between tenants (A sends 4x as many requests)",
        steps,
        {policy: r["service_gap"] for policy, r in results.items()},
        "engine step",
        "weighted tokens served, A minus B",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
