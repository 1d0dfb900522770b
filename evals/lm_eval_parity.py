"""lm-evaluation-harness scored through this server against lm-eval's own `hf` model.

    python -m evals.lm_eval_parity [--limit N] [--modes default exact]

A multiple-choice task over evals/data/mc_questions.jsonl (a local dataset: no hub access) is
run by lm-eval twice on the same weights, the embedded checkpoint directory:
  - `hf`: transformers' model in float32, as lm-eval loads it, one request at a time;
  - `local-completions` against this server in each mode: lm-eval scores every choice with
    `echo: true, logprobs: 1, max_tokens: 1` on /v1/completions and sums the returned prompt
    tokens' logprobs (`default`: the server's defaults; `exact`: WEIGHTS=fp32,
    NUMERICS=exact).
It reports each run's accuracy and how far the server's per-choice loglikelihoods are from
transformers' (max and mean absolute difference, and choices whose ranking flipped), and writes
evals/results/lm_eval_parity.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.harness import RESULTS, cpu_name, running_server, write_results
from evals.plots import bar_chart

DATASET = Path(__file__).resolve().parent / "data" / "mc_questions.jsonl"
TASK = "gemma_serve_mc"
MODES: dict[str, dict[str, str]] = {
    "default": {},
    "exact": {"WEIGHTS": "fp32", "NUMERICS": "exact"},
}


def task_config(dataset: Path = DATASET) -> dict[str, Any]:
    """The lm-eval task: question -> "Answer:" and one of four choices, scored by accuracy."""
    return {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(dataset)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }


@dataclass
class Scored:
    """One lm-eval run: accuracy and every (document, choice) loglikelihood."""

    accuracy: float
    logliks: dict[tuple[int, int], float]


def run_lm_eval(model: str, model_args: dict[str, Any], limit: int | None) -> Scored:
    """Run the task with lm-eval's `model` (e.g. "hf", "local-completions")."""
    import lm_eval

    logging.getLogger("lm-eval").setLevel(logging.WARNING)
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task_config()],
        limit=limit,
        log_samples=True,
        batch_size=1,
    )
    assert results is not None  # only None on non-zero ranks of a distributed run
    logliks = {}
    for sample in results["samples"][TASK]:
        for choice, response in enumerate(sample["resps"]):
            loglik, _is_greedy = response[0]
            logliks[(int(sample["doc_id"]), choice)] = float(loglik)
    return Scored(float(results["results"][TASK]["acc,none"]), logliks)


def hf_args(checkpoint: Path) -> dict[str, Any]:
    return {"pretrained": str(checkpoint), "dtype": "float32", "device": "cpu"}


def server_args(base_url: str, model_id: str, checkpoint: Path) -> dict[str, Any]:
    """local-completions against `base_url`, tokenizing with the checkpoint's own tokenizer and
    starting each request with BOS, as lm-eval's hf model does for Gemma."""
    return {
        "model": model_id,
        "base_url": base_url + "/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(checkpoint),
        "add_bos_token": True,
        "num_concurrent": 1,
        "max_retries": 1,
        "tokenized_requests": True,
    }


def compare(ours: Scored, reference: Scored) -> dict[str, Any]:
    """How far our loglikelihoods are from the reference's, and where the best choice moved."""
    assert ours.logliks.keys() == reference.logliks.keys()
    diffs = [abs(ours.logliks[key] - reference.logliks[key]) for key in reference.logliks]
    docs = sorted({doc for doc, _ in reference.logliks})

    def best(scored: Scored, doc: int) -> int:
        choices = {c: v for (d, c), v in scored.logliks.items() if d == doc}
        return max(choices, key=choices.__getitem__)

    return {
        "accuracy": ours.accuracy,
        "max_abs_loglik_diff": max(diffs),
        "mean_abs_loglik_diff": sum(diffs) / len(diffs),
        "choices": len(diffs),
        "documents_whose_pick_differs": sum(best(ours, d) != best(reference, d) for d in docs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="documents (default: all)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_eval_parity.json")
    args = parser.parse_args()

    from engine.model.loader import EMBEDDED_MODEL, embedded_checkpoint_dir

    checkpoint = embedded_checkpoint_dir()
    reference = run_lm_eval("hf", hf_args(checkpoint), args.limit)
    report: dict[str, Any] = {
        "task": TASK,
        "cpu": cpu_name(),
        "documents": len({doc for doc, _ in reference.logliks}),
        "reference": {"model": "lm-eval hf, float32", "accuracy": reference.accuracy},
        "modes": {},
    }
    for mode in args.modes:
        log = args.out.with_name(f"lm_eval_parity_{mode}.log")
        with running_server(log, **MODES[mode]) as base:
            ours = run_lm_eval(
                "local-completions", server_args(base, EMBEDDED_MODEL, checkpoint), args.limit
            )
        report["modes"][mode] = {"settings": MODES[mode], **compare(ours, reference)}
        print(mode, json.dumps(report["modes"][mode]))
    path = write_results("lm_eval_parity", report, args.out)
    bar_chart(
        path.with_suffix(".png"),
        f"lm-eval {TASK}: accuracy and loglikelihood gap to lm-eval's hf model",
        {"hf (reference)": 100 * reference.accuracy}
        | {f"server {m}": 100 * r["accuracy"] for m, r in report["modes"].items()},
        "accuracy (%)",
        {f"server {m}": r["max_abs_loglik_diff"] for m, r in report["modes"].items()},
        "max |loglik - hf loglik| (nats)",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
