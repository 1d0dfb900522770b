"""Long-lived tensors placed on huge pages keep their values, shapes, dtypes and identities, all
in one mapping advised MADV_HUGEPAGE; opaque tensors, embedding tables and too little data stay
where they are."""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.model import huge_pages

needs_madvise = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not Path("/proc/self/smaps").exists(),
    reason="no MADV_HUGEPAGE or /proc/self/smaps on this system",
)


@dataclass(frozen=True)
class Mapping:
    """One mapping of a process, as /proc/PID/smaps lists it (sizes in kB)."""

    start: int
    end: int
    flags: frozenset[str]  # VmFlags; `hg`: advised MADV_HUGEPAGE
    rss_kb: int
    huge_kb: int  # AnonHugePages

    @property
    def span(self) -> tuple[int, int]:
        """Which mapping it is, whatever its sizes read at the time."""
        return self.start, self.end


def mappings(pid: int | str = "self") -> list[Mapping]:
    """Every mapping of the process, from /proc/PID/smaps."""
    found, fields = [], {}
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            fields = {"start": int(span.group(1), 16), "end": int(span.group(2), 16)}
        elif line.startswith(("Rss:", "AnonHugePages:")):
            name = "rss_kb" if line.startswith("Rss:") else "huge_kb"
            fields[name] = int(line.split()[1])
        elif line.startswith("VmFlags:"):
            found.append(Mapping(flags=frozenset(line.split()[1:]), **fields))
    return found


def mapping_of(tensor: torch.Tensor) -> Mapping:
    """The mapping of this process that holds the tensor's data."""
    address = tensor.data_ptr()
    for m in mappings():
        if m.start <= address < m.end:
            return m
    raise AssertionError(f"no mapping holds {address:#x}")


class PackedState:
    """Stands for a packed kernel's state: a plain object with tensors and a nested object."""

    def __init__(self) -> None:
        self.tiles = torch.randn(1024, 512)  # 2 MB
        self.scales = torch.randn(1024)
        self.config = PlainConfig()


class PlainConfig:
    def __init__(self) -> None:
        self.table = torch.randn(64)  # inside an object inside an object: not opened


@needs_madvise
def test_place_together_moves_every_tensor_into_one_huge_page_mapping() -> None:
    tensors = [torch.randn(1024, 1024).bfloat16(), torch.arange(10), torch.randn(3, 5).t()]
    before = [t.clone() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    held = list(tensors)
    huge_pages.place_together([*tensors, tensors[1]])  # a tensor given twice moves once
    for tensor, old, pointer, same in zip(tensors, before, pointers, held, strict=True):
        assert tensor is same and tensor.data_ptr() != pointer
        assert tensor.dtype == old.dtype and tensor.shape == old.shape and torch.equal(tensor, old)
        assert tensor.data_ptr() % huge_pages.ALIGNMENT == 0
    spans = {mapping_of(t).span for t in tensors}
    assert len(spans) == 1
    first = mapping_of(tensors[0])
    assert "hg" in first.flags
    assert tensors[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # the first on a huge page boundary
    assert first.end - first.start >= 2 << 20


@needs_madvise
def test_too_little_data_opaque_tensors_and_a_disabled_module_stay_put(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = [torch.randn(16, 16), torch.randn(100)]
    pointers = [t.data_ptr() for t in small]
    huge_pages.place_together(small)  # 1.4 KB in all: below MIN_BYTES
    assert [t.data_ptr() for t in small] == pointers
    weight = torch.randn(2048, 640)  # float32: oneDNN reorders it on any x86 CPU, bf16 not
    opaque = torch.ops.mkldnn._reorder_linear_weight(weight)  # oneDNN's packed layout
    huge_pages.place_together([opaque, weight])
    assert opaque.layout == torch._mkldnn  # type: ignore[attr-defined]
    assert "hg" in mapping_of(weight).flags
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    other = torch.randn(2048, 640)
    pointer = other.data_ptr()
    huge_pages.place_together([other])
    assert other.data_ptr() == pointer


@needs_madvise
def test_place_module_moves_what_modules_lists_and_kernel_states_hold() -> None:
    shared = nn.Linear(1024, 1024)  # a 4 MB float32 weight, held twice
    model = nn.Sequential(shared, nn.Sequential(shared), nn.Embedding(1024, 1024))
    model.state = PackedState()  # type: ignore[assignment]
    model.slices = [torch.randn(256, 256), torch.randn(256, 256)]  # type: ignore[assignment]
    model.args = ([model.state.tiles], [torch.randn(8)])  # type: ignore[assignment]
    moved = [shared.weight, shared.bias, model.state.tiles, model.state.scales, *model.slices]
    moved.append(model.args[1][0])
    before = [t.detach().clone() for t in moved]
    kept = {"embedding": model[2].weight.data_ptr(), "table": model.state.config.table.data_ptr()}
    huge_pages.place_module(model)
    assert model[1][0] is shared and model.args[0][0] is model.state.tiles
    for tensor, old in zip(moved, before, strict=True):
        assert torch.equal(tensor, old)
    assert {mapping_of(t).span for t in moved} == {mapping_of(moved[0]).span}
    assert "hg" in mapping_of(moved[0]).flags
    assert model[2].weight.data_ptr() == kept["embedding"]  # embeddings are not streamed
    assert model.state.config.table.data_ptr() == kept["table"]
