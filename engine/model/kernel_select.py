"""Which kernel runs the model's linear layers, by weight mode, numerics and device, and the
swap that puts it in place.

Ways to run `x @ W.T`, chosen by timing the kernels PyTorch offers on the CPU at hand
(`python -m evals.bench_forward` compares them inside the engine):
- `exact`: `F.linear` on the model's dtype, bit for bit what transformers computes.
- `packed`: the same float32 weights, reordered once into oneDNN's blocked layout so each call
  skips the repacking `F.linear` does (CPU only). Same maths, another summation order: logits
  differ from `exact` in the last bits.
- `bf16`: the weights rounded to bfloat16 once, through oneDNN (CPU only): AMX tiles where the
  CPU has them. Activations are rounded to bfloat16 per call; everything between the linear
  layers stays float32, except inside each MLP (BFloat16GatedMLP), whose gelu and product are
  fused into its GEMMs in bfloat16. Approximate: `evals/quality.py` measures what it costs.
- `int8`: dynamic quantization (CPU only). Weights are int8 with one scale per output channel;
  each call quantizes the activations to int8 with one scale per row, multiplies in integers,
  and rescales to float32. cpu_ops' own kernel runs every call on CPUs without AMX (its
  AVX512-VNNI form, or its AVX2 form where the CPU has no VNNI), and up to AMX_INT8_MAX_ROWS
  rows on AMX tiles, past which oneDNN runs; fbgemm runs it on CPUs with AVX-VNNI alone (each
  measured the fastest there). Approximate: `evals/quality.py` measures what it costs.
- `bf16-int8head`: `bf16` for the decoder layers, `int8` for the LM head (`body_and_head`).

`quantize_model` swaps a model's `nn.Linear` modules for the chosen kernel in place. On CUDA and
MPS only `exact` exists: the other kernels are CPU libraries.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.cpu_features import has_amx, has_bf16
from engine.model.int8_kernels import DynamicInt8Linear, Int8GatedMLP, OneDNNInt8Linear
from engine.model.linear_kernels import BFloat16GatedMLP, BFloat16Linear, PackedLinear, row_buckets

WEIGHT_MODES = ("auto", "fp32", "bf16", "bf16-int8head", "int8")
# WEIGHTS modes that only CPU libraries run, and which.
CPU_ONLY_LIBRARIES = {"bf16": "oneDNN", "bf16-int8head": "oneDNN", "int8": "oneDNN or fbgemm"}
# Modes whose LM head runs another kernel than the body: (body, head).
_SPLIT_KERNELS = {"bf16-int8head": ("bf16", "int8")}
NUMERICS_MODES = ("exact", "fast")


def kernel_for(weights: str, numerics: str, device: torch.device) -> str:
    """`exact`, `packed`, `bf16`, `bf16-int8head` or `int8` for the WEIGHTS / NUMERICS settings
    on `device`.

    WEIGHTS=auto on CPU is bf16-int8head where the CPU has AMX tiles (an int8 LM head is much
    faster there for little perplexity, int8 layers gain less and cost more), int8 without
    AMX, and the DTYPE weights elsewhere. `python -m evals.bench_kernels`, `evals.quality` and
    `evals.bench_forward` measure the trade (docs/kernels.md, "The default").
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"unknown WEIGHTS {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
    if numerics not in NUMERICS_MODES:
        raise ValueError(
            f"unknown NUMERICS {numerics!r}: expected one of {', '.join(NUMERICS_MODES)}"
        )
    if weights == "auto":
        weights = ("bf16-int8head" if has_amx() else "int8") if device.type == "cpu" else "fp32"
    if weights in CPU_ONLY_LIBRARIES:  # approximate whatever NUMERICS says
        if device.type != "cpu":
            raise ValueError(
                f"WEIGHTS={weights} uses {CPU_ONLY_LIBRARIES[weights]}, a CPU kernel; "
                f"not available on {device}"
            )
        if weights.startswith("bf16") and not has_bf16():
            raise ValueError(
                f"WEIGHTS={weights} needs oneDNN's bfloat16 GEMM, which this CPU lacks "
                "(it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT); use WEIGHTS=int8 or fp32"
            )
        return weights
    if numerics == "fast" and device.type == "cpu" and torch.backends.mkldnn.is_available():
        return "packed"
    return "exact"


def body_and_head(kernel: str) -> tuple[str, str]:
    """The kernels of the decoder layers and of the LM head for `kernel`.

    `bf16-int8head` runs the layers in bfloat16 and the LM head, 62% of Gemma 3 270M's weights,
    in int8: the head is the largest matrix and decode reads all of it every step, so its bytes
    are what a step waits on; its perplexity lies between bf16's and int8's (evals/quality.py).
    """
    return _SPLIT_KERNELS.get(kernel, (kernel, kernel))


def int8_linear_class() -> type[nn.Module]:
    """The int8 module for this CPU: oneDNN's where it has AMX tiles (measured there, see
    OneDNNInt8Linear), fbgemm's elsewhere; both run cpu_ops' kernel where it serves the rows,
    every call without AMX (docs/kernels.md, "The default")."""
    return OneDNNInt8Linear if has_amx() else DynamicInt8Linear


_KERNELS: dict[str, type[nn.Module]] = {
    "packed": PackedLinear,
    "bf16": BFloat16Linear,
}


def make_linear(kernel: str, weight: torch.Tensor) -> nn.Module:
    """A module computing `x @ weight.T` with `kernel` (not `exact`: that is plain nn.Linear)."""
    if kernel == "int8":
        return int8_linear_class()(weight)
    return _KERNELS[kernel](weight)


def make_fused_mlp(
    kernel: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> nn.Module | None:
    """Gemma's whole MLP as one `kernel` module where that kernel has one (bf16:
    BFloat16GatedMLP; int8 where cpu_ops' int8 kernel runs every call: Int8GatedMLP), else
    None: its linears then run one by one."""
    if kernel == "bf16":
        return BFloat16GatedMLP(gate, up, down)
    if kernel == "int8":
        return Int8GatedMLP.where_supported(gate, up, down)
    return None


def quantize_model(model: nn.Module, kernel: str, head: nn.Module | None = None) -> None:
    """Replace every bias-free `nn.Linear` under `model` with `kernel`'s module, in place; the
    LM head `head`, where given, with the head's kernel of a split kernel (body_and_head)."""
    if kernel == "exact":
        return
    body_kernel, head_kernel = body_and_head(kernel)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(f"{name}: linear layers with a bias are not supported")
                chosen = head_kernel if child is head else body_kernel
                setattr(parent, name, make_linear(chosen, child.weight))


_ONEDNN_KERNELS = (PackedLinear, BFloat16Linear, BFloat16GatedMLP, OneDNNInt8Linear)


def run_head(head: nn.Module, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """head(hidden), written into `out` by the kernels that can (slice_output)."""
    if isinstance(head, (BFloat16Linear, OneDNNInt8Linear, DynamicInt8Linear)):
        return head(hidden, out=out)
    return head(hidden)


def head_argmax(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The first maximum of each row of head(hidden) (int64 [rows]), computed without writing
    the logits out, where the head's kernel can (the int8 head on cpu_ops' kernel, float32 in
    and out: bfloat16 logits could round two of them to a tie); else None.
    A greedy step needs only that index, and at 64 rows the logits it skips are 64 MiB
    (`python -m evals.bench_step --temperature 0 [--no-greedy-head]` measures the difference)."""
    if isinstance(head, (OneDNNInt8Linear, DynamicInt8Linear)) and hidden.dtype == torch.float32:
        return head.argmax(hidden)
    return None


@torch.inference_mode()
def warm_up(model: nn.Module, max_rows: int, dtype: torch.dtype) -> int:
    """Call each distinct oneDNN kernel shape under `model` once with every row bucket up to
    `max_rows` rows of `dtype` activations, so that oneDNN has built every primitive a step can
    ask for; returns the number of calls. oneDNN caches primitives by shape, not by weight, so
    one module of each (kernel, in, out) stands for all of them. fbgemm keeps no per-shape
    state, and nothing else here does either."""
    calls = 0
    seen: set[tuple[type, int, int]] = set()
    for module in model.modules():
        if not isinstance(module, _ONEDNN_KERNELS):
            continue
        if isinstance(module, PackedLinear) and module.packed is None:
            continue  # cpu_ops' kernel: nothing to build
        key = (type(module), module.in_features, module.out_features)
        if key in seen:
            continue
        seen.add(key)
        for rows in row_buckets(max_rows):  # oneDNN kernels are CPU-only
            x = torch.zeros(rows, module.in_features, dtype=dtype)
            if isinstance(module, (BFloat16Linear, OneDNNInt8Linear)):
                module.prime(x)  # one call per slice shape: the LM head's slices are equal
            else:
                module(x)
            calls += 1
    return calls
