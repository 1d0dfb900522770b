"""What the CPU at hand offers the linear kernels: oneDNN's bfloat16 GEMM, AMX tiles, and
VNNI's int8 dot products."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import torch


def has_bf16() -> bool:
    """Whether oneDNN has a bfloat16 GEMM for this CPU (BFloat16Linear's kernel)."""
    return (
        bool(torch.backends.mkldnn.is_available()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@cache
def has_vnni() -> bool:
    """Whether this CPU multiplies int8 with VNNI (vpdpbusd, int32 sums). Without it the int8
    GEMMs of fbgemm and oneDNN, and cpu_ops' AVX2 kernel, sum pairs of u8 x s8 products in int16
    (vpmaddubsw), which saturates once activations and weights are both large."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False  # unknown: assume the saturating instructions
    return bool(re.search(r"\b(avx512_vnni|avx_vnni|amx_int8)\b", flags))


def int8_weight_max() -> int:
    """The largest int8 weight magnitude the int8 kernels quantize to: 127 with VNNI; 63 without,
    so that a u8 activation times a weight, summed in pairs, stays within int16 (255 * 63 * 2 <
    32767). `python -m evals.quality` measured 7-bit weights against saturating 8-bit ones and
    7-bit activations on such a CPU (docs/kernels.md, "Weight modes")."""
    return 127 if has_vnni() else 63


def has_amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bfloat16 GEMM uses."""
    return bool(torch.cpu._is_amx_tile_supported()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
