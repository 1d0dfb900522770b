"""One cache group's addressing for a pure decode step, for cpu_ops' paged decode kernel.

A step where every sequence adds one token needs, per storing layer, only where the new K/V
goes (write slots), which slots to read (key slots) and an additive mask: what GroupPlan's
single decode chunk holds. GroupPlan builds those with a few dozen small torch ops per group
and copies its plan for every place in a block (shared pages), Python that a one-user decode
step, bound by reading the weights, waits on. DecodeTables builds the same tensors in numpy
(a numpy op on arrays this small costs a fraction of a torch op), every place at once, from
the batch's GroupAttention. tests/test_decode_tables.py checks them against GroupPlan's;
`python -m evals.bench_step --users 1` shows the step's batch and forward times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.layout import LanePlace
from engine.model.batch import GroupAttention
from engine.model.kv_cache import PagedKVCache


@dataclass
class DecodeTables:
    """Write slots and key slots by place in a block ((page, part) of a LanePlace whose slots
    move; None: where the block tables point), and the mask every place shares:
    [B, 1, 1, width], float32 (what the kernel reads) holding the values of GroupPlan's mask in
    the step's dtype, so that no layer converts it again."""

    write_slots: dict[tuple[int, int] | None, torch.Tensor]
    key_slots: dict[tuple[int, int] | None, torch.Tensor]
    mask: torch.Tensor

    def at(self, place: LanePlace) -> tuple[torch.Tensor, torch.Tensor]:
        """(write slots, key slots) of a layer kept at `place`."""
        where = (place.page, place.part) if place.moves_slots else None
        return self.write_slots[where], self.key_slots[where]


def decode_tables(
    group: GroupAttention,
    name: str,
    positions: torch.Tensor,
    window: int | None,
    cache: PagedKVCache,
    dtype: torch.dtype,
) -> DecodeTables | None:
    """The tables of cache group `name` for a step whose row i is sequence i's one new token
    at positions[i]; None where a row's token is not stored (GroupPlan's write_rows case).

    As GroupPlan: columns are cut to the widest row's last valid key, and key j is visible to
    its row when valid, at or before the query's position and, with a window, within it."""
    writes = group.slot_mapping.numpy()
    if (writes < 0).any():
        return None
    valid = group.key_valid.numpy()
    key_positions = group.key_positions.numpy()
    columns = np.arange(1, valid.shape[1] + 1)
    width = int((valid * columns).max()) if valid.size else 0
    valid, key_positions = valid[:, :width], key_positions[:, :width]
    query = positions.numpy()[:, None]
    visible = valid & (key_positions <= query)
    if window is not None:
        visible &= query - key_positions < window
    # finfo(dtype).min is exact in float32 for the float32 and bfloat16 masks GroupPlan makes.
    mask = np.where(visible, np.float32(0), np.float32(torch.finfo(dtype).min))
    block_size = cache.block_size
    write_slots: dict[tuple[int, int] | None, torch.Tensor] = {None: group.slot_mapping}
    key_slots: dict[tuple[int, int] | None, torch.Tensor] = {
        None: group.key_slots[:, :width].reshape(-1)
    }
    page_map = cache.page_maps.get(name)
    parts = cache.parts_of_group.get(name, 1)
    if (page_map is not None or parts > 1) and group.block_ids is not None:
        # Every place at once, as PagedKVCache.relocate_blocks: [pages, parts, rows, ...].
        def moved(blocks: np.ndarray) -> np.ndarray:
            on_pages = blocks[None] if page_map is None else page_map.numpy()[:, blocks]
            part = np.arange(parts).reshape(1, parts, *[1] * blocks.ndim)
            return on_pages[:, None] * parts + part

        rows = group.block_ids.shape[0]
        moved_keys = moved(group.block_ids.numpy())[..., None] * block_size + np.arange(block_size)
        moved_keys = np.ascontiguousarray(
            moved_keys.reshape(*moved_keys.shape[:2], rows, -1)[..., :width]
        )
        moved_writes = moved(writes // block_size) * block_size + writes % block_size
        for page, part in np.ndindex(*moved_keys.shape[:2]):
            if LanePlace(page=page, part=part, parts=parts).moves_slots:
                key_slots[page, part] = torch.from_numpy(moved_keys[page, part].reshape(-1))
                write_slots[page, part] = torch.from_numpy(moved_writes[page, part])
    return DecodeTables(
        write_slots=write_slots,
        key_slots=key_slots,
        mask=torch.from_numpy(mask)[:, None, None, :],
    )
