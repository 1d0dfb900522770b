"""Fused CPU kernels for the elementwise work between the GEMMs (csrc/cpu_ops.cpp).

A Gemma RMSNorm is eight eager ops, and a decoder layer runs six norms and two residual adds:
at decode sizes they cost more in dispatch and allocation than in arithmetic, and decode
attention copied every sequence's K/V out of the paged pools first. `evals/bench_step.py`
measures a decode step with and without these kernels (docs/kernels.md, "Fused CPU kernels"). They
are built on first use with the machine's C++ compiler (torch.utils.cpp_extension, ninja) into
the model cache, for this CPU's instruction set, and loaded as `torch.ops.gemma_cpu`. Where no
compiler is found `available()` is false and the model runs the same maths as eager ops; the
callers use them on a CPU device only.

They sum in another order than torch's reductions, so they are used only by the approximate
modes (every mode but NUMERICS=exact), where tests/test_cpu_ops.py bounds them. The exception is
the sampler's race (gumbel_argmax), which sums nothing: engine/sampler.py calls it in every mode.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import structlog
import torch
from filelock import FileLock

from engine.model.loader import cache_root

log = structlog.get_logger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "cpu_ops.cpp", CSRC / "packed_linear.cpp", CSRC / "decoder_layer.cpp"]
HEADERS = [CSRC / "parallel.h", CSRC / "vector_math.h"]
# -fopenmp: at::parallel_for runs its OpenMP loop inline, so it is serial without it; the library
# then needs libgomp.so.1, which resolves to the one torch has already loaded (one thread pool).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-std=c++17"]
LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code is only valid where they are the same."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return match.group(1) if match else platform.processor()


def build_name() -> str:
    """The extension's name, unique per source, flags, torch version and CPU features, so a
    cache shared between machines or upgrades never loads a library built for another."""
    flags = " ".join(CFLAGS + LDFLAGS)
    texts = [path.read_text() for path in SOURCES + HEADERS]
    key = "\n".join([*texts, flags, torch.__version__, _cpu_flags()])
    return "gemma_cpu_ops_" + hashlib.sha256(key.encode()).hexdigest()[:16]


@cache
def available() -> bool:
    """Load the kernels, building them first if this machine has not (about 10 s); False if
    that fails. The build runs under a file lock, so concurrent servers build once and wait."""
    from torch.utils import cpp_extension

    name = build_name()
    directory = cache_root() / "kernels" / name
    library = directory / f"{name}.so"
    try:
        if not library.exists():
            directory.mkdir(parents=True, exist_ok=True)
            with FileLock(directory / "build.lock"):
                if not library.exists():
                    # torch's own build lock, left behind by a build that was killed; ours is
                    # held, so nobody else is building.
                    (directory / "lock").unlink(missing_ok=True)
                    log.info("building the fused CPU kernels", directory=str(directory))
                    # ninja comes with the project (PyPI's ninja) into this interpreter's
                    # environment, which need not be on PATH (`.venv/bin/python -m app ...`).
                    # Only for the build: the server's own PATH stays as it was.
                    path = os.environ.get("PATH", "")
                    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + path
                    try:
                        cpp_extension.load(
                            name=name,
                            sources=[str(path) for path in SOURCES],
                            extra_cflags=CFLAGS,
                            extra_ldflags=LDFLAGS,
                            build_directory=str(directory),
                            is_python_module=False,
                        )
                    finally:
                        os.environ["PATH"] = path
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:
        log.warning("fused CPU kernels unavailable; running eager ops", error=str(exc)[:500])
        return False
    return True


def rms_norm(
    x: torch.Tensor, scale: torch.Tensor | None, eps: float, bf16_out: bool = False
) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * scale over the last dimension of a float32 or bfloat16
    x; float32, or bfloat16 (rounded as PyTorch rounds) with bf16_out."""
    return torch.ops.gemma_cpu.rms_norm(x, scale, eps, bf16_out)


def add_rms_norm_(
    residual: torch.Tensor,
    x: torch.Tensor,
    post_scale: torch.Tensor | None,
    pre_scale: torch.Tensor | None,
    eps: float,
    bf16_out: bool = False,
) -> torch.Tensor:
    """residual (float32) += rms_norm(x, post_scale) in place, x float32 or bfloat16; returns
    rms_norm(residual, pre_scale) (bfloat16 with bf16_out), or an empty tensor when pre_scale is
    None."""
    return torch.ops.gemma_cpu.add_rms_norm_(residual, x, post_scale, pre_scale, eps, bf16_out)


def norm_rope(
    x: torch.Tensor,
    offset: int,
    heads: int,
    head_dim: int,
    scale: torch.Tensor | None,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """[T, heads, head_dim] float32: the heads of projection x ([T, W], float32 or bfloat16)
    from column `offset` on, each RMS-normalized by `scale` and rotated by the RoPE tables (cos
    and sign-folded sin, [T, 1, head_dim], as TextModel.rotary makes them)."""
    return torch.ops.gemma_cpu.norm_rope(x, offset, heads, head_dim, scale, cos, signed_sin, eps)


def paged_decode_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query per sequence ([B, H, D] float32) over its keys, read in place from
    the paged pools ([slots, Hkv, D], float32 or bfloat16) at `slots` ([B, K]), under the
    additive `mask` ([B, K]; masked keys are skipped). Returns [B, H, D] float32."""
    return torch.ops.gemma_cpu.paged_decode_attention(
        query, key_pool, value_pool, slots, mask, scale
    )


def store_kv(
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """pool[slots[n]] = rows[n] for the keys and values ([N, Hkv, D], float32 or bfloat16) of one
    layer, rounded to the pools' dtype as a cast rounds: what index_copy_ of the cast rows
    stores, in one op."""
    torch.ops.gemma_cpu.store_kv(key_pool, value_pool, slots, keys, values)


def packed_linear_supported(dtype: torch.dtype) -> bool:
    """Whether the kernels were built with packed_linear for `dtype` weights on this CPU
    (float32 needs AVX-512, bfloat16 AVX512-BF16, int8 AVX512-VNNI, or AVX2 where the CPU
    has no VNNI at all and the weights are 7-bit, cpu_features.int8_weight_max)."""
    return available() and bool(torch.ops.gemma_cpu.packed_linear_supported(dtype))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [O, I] (float32, bfloat16 or int8) in packed_linear's layout: tiles of 64
    outputs, input by input (bfloat16: by pairs of inputs, int8: by fours), zero-padded."""
    return torch.ops.gemma_cpu.pack_linear_weight(weight)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bf16_out: bool = False
) -> torch.Tensor:
    """x [rows, I] (float32 or bfloat16) @ W.T for W packed by pack_linear_weight: float32
    [rows, out_features], or bfloat16 with bf16_out. bfloat16 weights multiply x rounded to
    bfloat16; sums are float32."""
    return torch.ops.gemma_cpu.packed_linear(x, packed, out_features, bf16_out)


def packed_int8_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    compensation: torch.Tensor,
    out_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [rows, I] @ W.T for int8 weights packed by pack_linear_weight, each row of x quantized
    to int8 at its own scale (its largest magnitude to 127), as OneDNNInt8Linear quantizes:
    float32 [rows, out_features] = the exact int32 sums (less `compensation`, 128 * W's row sums,
    for the uint8 offset the kernel's instruction takes) * scales (per output) * the row's
    largest magnitude, written into `out` where given. The sums are exact, so a row's outputs
    are the same alone or in any batch; more than a few rows run on AMX tiles where
    packed_amx says so."""
    return torch.ops.gemma_cpu.packed_int8_linear(
        x, packed, scales, compensation, out_features, out
    )


def packed_int8_linear_argmax(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    compensation: torch.Tensor,
    out_features: int,
) -> torch.Tensor:
    """The first maximum of each row of packed_int8_linear(x, ...) as row_argmax finds it (a
    NaN counts as the largest): int64 [rows], each output computed as packed_int8_linear
    computes it but never written out."""
    return torch.ops.gemma_cpu.packed_int8_linear_argmax(
        x, packed, scales, compensation, out_features
    )


def packed_int8_gated(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    compensation: torch.Tensor,
    hidden: int,
) -> torch.Tensor:
    """gelu_tanh(gate(x)) * up(x), float32 [rows, hidden], over int8 weights packed with gate's
    and up's rows in alternating runs of 64 (scales and compensation in that order too): each
    pre-activation as packed_int8_linear computes it, activated and multiplied in cache."""
    return torch.ops.gemma_cpu.packed_int8_gated(x, packed, scales, compensation, hidden)


def packed_amx(dtype: torch.dtype, inputs: int) -> bool:
    """Whether packed_int8_linear (int8), packed_linear and packed_gated_mlp (bfloat16) run
    many rows on AMX tiles for weights of `inputs` inputs: built with AMX, the kernel allowed to
    use it, and `inputs` a multiple of 64 (int8) or 32 (bfloat16)."""
    return available() and bool(torch.ops.gemma_cpu.packed_amx(dtype, inputs))


def packed_gated_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, hidden: int, out_features: int
) -> torch.Tensor:
    """Gemma's MLP down(gelu_tanh(gate(x)) * up(x)) over bfloat16 packed weights, rounded to
    bfloat16 where oneDNN's GEMMs round (the activation, the product, the output); gate_up is
    gate's and up's weights in alternating runs of 64 rows, packed. Returns [rows,
    out_features] bfloat16."""
    return torch.ops.gemma_cpu.packed_gated_mlp(x, gate_up, down, hidden, out_features)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row of `logits` ([R, W] float32), as torch.max(logits,
    dim=1).indices gives it (a NaN counts as the largest): int64 [R], in one pass over each
    row with the rows shared out between threads."""
    return torch.ops.gemma_cpu.row_argmax(logits)


def gumbel_argmax(
    logits: torch.Tensor,
    inverse_temperature: torch.Tensor,
    keys: torch.Tensor,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row of `logits` ([R, W] float32; -inf marks a token that may not be chosen): the
    token v with the largest (logit_v - the row's largest) * inverse_temperature[row] +
    G(keys[row], v), G Gumbel noise from a hash of the row's key ([R] int64) and the token id,
    which is the column, or ids[row, column] (int64 [R, W]) where ids are given; ties go to the
    smaller id (csrc/cpu_ops.cpp says which hash; engine/random_draw.py's race_torch is the same
    race in torch ops). int64 [R]; the smallest id for a row whose logits are all -inf."""
    return torch.ops.gemma_cpu.gumbel_argmax(logits, inverse_temperature, keys, ids)


def scatter_columns(
    part: torch.Tensor, row_scale: torch.Tensor | None, out: torch.Tensor, column: int
) -> None:
    """out[r, column + j] = part[r, j], times row_scale[r] where given, for every row of `out`
    (float32 [R, W]; `part` float32 or bfloat16 with at least R rows): one slice of a sliced
    GEMM written into its columns while still in cache, rounded as torch.mul rounds."""
    torch.ops.gemma_cpu.scatter_columns(part, row_scale, out, column)


def scale_rows_by_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / m, m) for float32 [R, K] x, m = max(max |x[r]|, 1e-12) per row ([R, 1]): an int8
    kernel's activations scaled into [-1, 1], the values x.abs().amax(-1, keepdim=True)
    .clamp(min=1e-12) and the division give, in one pass over each row."""
    scaled, row_max = torch.ops.gemma_cpu.scale_rows_by_max(x)
    return scaled, row_max
