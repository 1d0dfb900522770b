"""Which device and dtype the model runs on: DEVICE / DTYPE settings, or auto-detection."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_AUTO = ("", "auto")


def resolve_device(name: str | None = None) -> torch.device:
    """`cuda` / `mps` / `cpu` (optionally with an index, e.g. `cuda:1`); unset or `auto`
    picks CUDA, then MPS, then CPU."""
    if name is None or name.strip().lower() in _AUTO:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name.strip().lower())
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "mps", "cpu"):
        raise ValueError(f"unsupported DEVICE {name!r}: expected cuda, mps or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("DEVICE=cuda but CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("DEVICE=mps but MPS is not available on this machine")
    return device


def parse_dtype(name: str) -> torch.dtype:
    """`float32` / `bfloat16` / `float16` (and the short forms fp32, bf16, fp16, half)."""
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unsupported DTYPE {name!r}: expected float32, bfloat16 or float16"
        ) from None


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The DTYPE setting, or float32 on CPU and bfloat16 on a GPU when unset or `auto`."""
    if name is None or name.strip().lower() in _AUTO:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return parse_dtype(name)
