"""Long-lived tensors placed on huge pages keep their values, shapes and dtypes; small or opaque
tensors stay where they are."""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from engine.model import huge_pages

needs_madvise = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this system"
)


@needs_madvise
def test_a_large_tensor_is_copied_with_its_values_and_a_small_one_is_kept() -> None:
    large = torch.randn(1024, 1024).bfloat16()  # 2 MB
    placed = huge_pages.place(large)
    assert placed is not large and placed.data_ptr() != large.data_ptr()
    assert placed.dtype == torch.bfloat16 and placed.shape == large.shape
    assert torch.equal(placed, large)
    small = torch.randn(16, 16)
    assert huge_pages.place(small) is small
    zeros = huge_pages.zeros((3, 1 << 20), torch.float32, torch.device("cpu"))
    assert zeros.shape == (3, 1 << 20) and not zeros.any()


def test_opaque_tensors_and_a_disabled_module_stay_put(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(2048, 640)  # float32: oneDNN reorders it on any x86 CPU, bf16 not
    opaque = torch.ops.mkldnn._reorder_linear_weight(weight)  # oneDNN's packed layout
    assert huge_pages.place(opaque) is opaque
    monkeypatch.setattr(huge_pages, "ENABLED", False)
    assert huge_pages.place(weight) is weight


@needs_madvise
def test_place_module_moves_parameters_attributes_and_lists_once() -> None:
    shared = nn.Linear(1024, 1024)  # a 4 MB float32 weight, held twice
    model = nn.Sequential(shared, nn.Sequential(shared), nn.Embedding(1024, 1024))
    model.tiles = torch.randn(1024, 1024)  # a packed kernel's plain attribute
    model.slices = [torch.randn(1024, 1024), torch.randn(1024, 1024)]
    before = {
        "weight": shared.weight.detach().clone(),
        "tiles": model.tiles.clone(),
        "slices": [s.clone() for s in model.slices],
        "embedding": model[2].weight.data_ptr(),
    }
    pointers = (shared.weight.data_ptr(), model.tiles.data_ptr(), model.slices[0].data_ptr())
    huge_pages.place_module(model)
    assert torch.equal(shared.weight, before["weight"]) and model[1][0] is shared
    assert torch.equal(model.tiles, before["tiles"])
    assert all(torch.equal(a, b) for a, b in zip(model.slices, before["slices"], strict=True))
    after = (shared.weight.data_ptr(), model.tiles.data_ptr(), model.slices[0].data_ptr())
    assert all(a != b for a, b in zip(after, pointers, strict=True))
    assert model[2].weight.data_ptr() == before["embedding"]  # embeddings are not streamed
