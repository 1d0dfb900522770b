"""Long-lived CPU tensors (the packed weights, the KV pools) on transparent huge pages.

A decode step streams the weights and the KV cache from memory. On 4 KB pages that stream
crosses a page, and may miss the TLB, every 4 KB; a tensor placed here sits in an anonymous
mapping advised MADV_HUGEPAGE, which the kernel backs with 2 MB pages where it has them (the
system's transparent_hugepage setting must be `madvise` or `always`). Only tensors made once and
kept are placed here: transient ones stay with PyTorch's allocator, which reuses freed memory
without faulting it in again. `python -m evals.bench_step --compare-pages` measures the
difference.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# Cleared by evals that measure the difference; placing nothing leaves PyTorch's allocator.
ENABLED = True

# Below this a mapping spans at most one huge page, not worth making.
MIN_BYTES = 2 << 20

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each tensor's start in an arena: a cache line, as PyTorch's allocator aligns

_ADVICE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def _placed(nbytes: int, device: torch.device) -> bool:
    return ENABLED and _ADVICE is not None and device.type == "cpu" and nbytes >= MIN_BYTES


def _mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes in an anonymous mapping advised as huge pages, not faulted in yet,
    starting on a huge page boundary (the kernel backs only whole aligned 2 MB ranges); the
    tensor keeps the mapping alive."""
    assert _ADVICE is not None  # _placed() checked
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(_ADVICE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where it is large enough. Every page is written here,
    as torch.zeros writes them, so the memory is resident from the start."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not _placed(nbytes, device):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _mapping(nbytes).view(dtype).view(shape).zero_()


def _movable(tensor: torch.Tensor) -> bool:
    """A plain (strided) CPU tensor: oneDNN's opaque weights and quantized tensors stay."""
    return (
        tensor.layout == torch.strided and not tensor.is_quantized and tensor.device.type == "cpu"
    )


def place_together(tensors: Iterable[torch.Tensor]) -> None:
    """Copy the tensors, in the order given, into one mapping on huge pages, and point each
    tensor at its copy in place (its `.data`): whatever holds the tensor object, a module, a
    list of kernel arguments or a kernel's state, reads the copy from then on. One mapping
    for them all, not one each: a layer's projections are under 2 MB apiece, and a mapping of
    that size holds no whole aligned huge page. Nothing moves when they are smaller than
    MIN_BYTES together, or huge pages are off. Each tensor is contiguous after the move."""
    unique = {id(t): t for t in tensors if _movable(t)}
    chosen = list(unique.values())
    offsets, total = [], 0
    for tensor in chosen:
        offsets.append(total)
        total += -(-_nbytes(tensor) // ALIGNMENT) * ALIGNMENT
    if not chosen or not _placed(total, chosen[0].device):
        return
    arena = _mapping(total)
    with torch.no_grad():
        for tensor, offset in zip(chosen, offsets, strict=True):
            copy = arena[offset : offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
            tensor.data = copy.copy_(tensor)


def _held_tensors(
    value: object, seen: set[int], open_objects: bool = True
) -> Iterator[torch.Tensor]:
    """The tensors in a module attribute: the value itself, the items of a list or tuple, and
    the attributes of a plain object the module holds (a packed kernel's state), but not of
    the objects inside that one (a config's own members). Modules are left to
    module.modules(); TorchScript objects (fbgemm's packed weights) hold theirs out of reach."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if id(value) in seen or isinstance(value, (nn.Module, torch.ScriptObject)):
        return
    if isinstance(value, (list, tuple)):
        seen.add(id(value))
        for item in value:
            yield from _held_tensors(item, seen, open_objects)
    elif open_objects and hasattr(value, "__dict__"):
        seen.add(id(value))
        for item in vars(value).values():
            yield from _held_tensors(item, seen, open_objects=False)


def streamed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor the module and its children keep, in module order (layer after layer):
    parameters, buffers, and tensors held as attributes, in lists and tuples or in plain
    objects (the packed kernels' weights and the argument lists bound for them). Embedding
    tables are left out: a step reads a few of their rows, and one may be the loaded
    checkpoint's own tensor, which a copy would double."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for child in module.modules():
        if isinstance(child, nn.Embedding):
            continue
        found += [p for p in child._parameters.values() if p is not None]
        found += [b for b in child._buffers.values() if b is not None]
        for name, value in vars(child).items():
            if not name.startswith("_"):
                found += _held_tensors(value, seen)
    return found


def place_module(module: nn.Module) -> None:
    """Move every tensor the module keeps (streamed_tensors) onto huge pages, together, in the
    order a forward pass reads its layers."""
    place_together(streamed_tensors(module))
