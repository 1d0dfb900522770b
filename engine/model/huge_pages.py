"""Long-lived CPU tensors (the packed weights, the KV pools) on transparent huge pages.

A decode step streams the weights and the KV cache from memory. On 4 KB pages that stream
crosses a page, and may miss the TLB, every 4 KB; a tensor placed here sits in an anonymous
mapping advised MADV_HUGEPAGE, which the kernel backs with 2 MB pages where it has them (the
system's transparent_hugepage setting must be `madvise` or `always`). Only tensors made once and
kept are placed here: transient ones stay with PyTorch's allocator, which reuses freed memory
without faulting it in again. `python -m evals.bench_step --no-huge-pages` measures the
difference.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import nn

# Cleared by evals that measure the difference; placing nothing leaves PyTorch's allocator.
ENABLED = True

# Below this a tensor spans at most one huge page, not worth its own mapping.
MIN_BYTES = 2 << 20

_ADVICE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def _placed(nbytes: int, device: torch.device) -> bool:
    return ENABLED and _ADVICE is not None and device.type == "cpu" and nbytes >= MIN_BYTES


def _mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes in an anonymous mapping advised as huge pages, not faulted in yet;
    the tensor keeps the mapping alive."""
    assert _ADVICE is not None  # _placed() checked
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(_ADVICE)
    return torch.frombuffer(memory, dtype=torch.uint8)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where it is large enough. Every page is written here,
    as torch.zeros writes them, so the memory is resident from the start."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not _placed(nbytes, device):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _mapping(nbytes).view(dtype).view(shape).zero_()


def place(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a plain (strided) CPU tensor on huge pages where it is large enough; else the
    tensor itself (oneDNN's opaque weights among them)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.layout != torch.strided or tensor.is_quantized or not _placed(nbytes, tensor.device):
        return tensor
    return _mapping(nbytes).view(tensor.dtype).view(tensor.shape).copy_(tensor)


def place_module(module: nn.Module) -> None:
    """Move every large tensor the module and its children keep onto huge pages: parameters,
    buffers, and tensors held as attributes or in lists (the packed kernels' weights). An
    embedding table stays where it is: a step reads a few of its rows, and it may be the
    loaded checkpoint's own tensor, which a copy would double."""
    moved: dict[int, torch.Tensor] = {}  # a tensor (or parameter) shared by two modules moves once

    def moved_copy(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in moved:
            moved[id(tensor)] = place(tensor)
        return moved[id(tensor)]

    for child in module.modules():
        if isinstance(child, nn.Embedding):
            continue
        for parameter in child._parameters.values():
            if parameter is not None and id(parameter) not in moved:
                parameter.data = place(parameter.data)
                moved[id(parameter)] = parameter
        for name, buffer in child._buffers.items():
            if buffer is not None:
                child._buffers[name] = moved_copy(buffer)
        for name, value in list(vars(child).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(child, name, moved_copy(value))
            elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
                value[:] = [moved_copy(v) for v in value]
