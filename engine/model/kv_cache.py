"""The physical paged KV cache: preallocated key and value pools that the storing layers write.

A pool has `pages * block_size` slots; slot = page * block_size + offset. Two layouts
(engine.kv.layout):
- a pool per layer, with each cache group ("full", "sliding") its own number of blocks of one
  page: the engine's block tables address it directly, every layer of a group by the same slots;
- SharedPages: `lanes` tensors of one shared page space, each page `block_size` tokens of the
  widest layer's K (or V). Every storing layer views one lane (engine.kv.layout.LanePlace): a
  layer k times narrower views it as k times as many pages of its own shape, taking part `part` of
  each, so a layer's pool stays `[num_slots, num_kv_heads, head_dim]` and slot-contiguous.
  Several layers (of one group or of several) share a lane on different pages or parts.
  Block tables name a block by its first page; `page_maps` gives a multi-page block's others.
KV-shared layers own no pool; they read their producer's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.kv.block_pool import Block
from engine.kv.layout import CacheGroupSpec, LanePlace, SharedPages
from engine.model import huge_pages
from engine.model.architecture import GemmaArchitecture, LayerSpec

GROUP_ORDER = ("full", "sliding")
# Linear kernels whose activations already pass through bfloat16 or int8 (kernel_select).
_APPROXIMATE_KERNELS = ("bf16", "bf16-int8head", "int8")


def auto_kv_cache_dtype(kernel: str, dtype: torch.dtype) -> torch.dtype:
    """KV_CACHE_DTYPE=auto: bfloat16 under the approximate CPU kernels, where a bfloat16 cache
    served 7-8% more tokens at 16 and 32 users for 0.2% more perplexity than a float32 one
    (evals/bench_peers.py, evals/quality.py); the model's dtype under `exact` and `packed`,
    which keep float32 numerics."""
    return torch.bfloat16 if kernel in _APPROXIMATE_KERNELS else dtype


def cache_group_specs(arch: GemmaArchitecture, dtype: torch.dtype) -> list[CacheGroupSpec]:
    """The groups this model needs, with the bytes one token costs in each (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    specs = []
    for group in GROUP_ORDER:
        layers = [spec for spec in arch.layers if spec.group == group and spec.stores_kv]
        if not layers:
            continue
        bytes_per_token = sum(
            2 * spec.num_kv_heads * spec.head_dim * element_size for spec in layers
        )
        shapes = {(spec.num_kv_heads, spec.head_dim) for spec in layers}
        specs.append(
            CacheGroupSpec(
                name=group,
                layer_ids=tuple(spec.index for spec in layers),
                sliding_window=arch.window_of_group(group),
                bytes_per_token=bytes_per_token,
                layer_shape=shapes.pop() if len(shapes) == 1 else None,
            )
        )
    return specs


class PagedKVCache:
    """Key and value pools, `[num_slots, num_kv_heads, head_dim]`, per storing layer or lane."""

    def __init__(
        self,
        arch: GemmaArchitecture,
        num_blocks: int | Mapping[str, int] | SharedPages,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`num_blocks`: per cache group, one count for every group, or a shared page pool."""
        if block_size <= 0:
            raise ValueError(f"need a positive block size, got {block_size}")
        self.block_size = block_size
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        # Where in a block each storing layer's K/V sits (its first page unless pages are shared).
        self.place: dict[int, LanePlace] = {}
        # Group -> [pages per block, num_pages]: a multi-page block's pages by its first page.
        self.page_maps: dict[str, torch.Tensor] = {}
        # Group -> how many of its layers share a lane (its layers are that much narrower).
        self.parts_of_group: dict[str, int] = {}
        storing = [spec for spec in arch.layers if spec.stores_kv]
        if isinstance(num_blocks, SharedPages):
            self._allocate_lanes(storing, num_blocks, device, dtype)
        else:
            if isinstance(num_blocks, int):
                num_blocks = {spec.group: num_blocks for spec in storing}
            if min(num_blocks.values(), default=0) <= 0:
                raise ValueError(f"need a positive number of blocks, got {num_blocks}")
            for spec in storing:
                shape = (num_blocks[spec.group] * block_size, spec.num_kv_heads, spec.head_dim)
                self.keys[spec.index] = huge_pages.zeros(shape, dtype, device)
                self.values[spec.index] = huge_pages.zeros(shape, dtype, device)
                self.place[spec.index] = LanePlace()
        # Which group's addressing each layer reads, and where in its blocks: its own, or its
        # KV producer's.
        self.group_of_layer = {
            spec.index: arch.layers[spec.kv_source].group for spec in arch.layers
        }
        self.place_of_layer = {spec.index: self.place[spec.kv_source] for spec in arch.layers}

    def _allocate_lanes(
        self,
        storing: list[LayerSpec],
        layout: SharedPages,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        lane_elements = layout.num_pages * self.block_size * layout.lane_width
        key_lanes = [huge_pages.zeros((lane_elements,), dtype, device) for _ in range(layout.lanes)]
        value_lanes = [
            huge_pages.zeros((lane_elements,), dtype, device) for _ in range(layout.lanes)
        ]
        for group in {spec.group for spec in storing}:
            layers = [spec for spec in storing if spec.group == group]
            widths = {spec.num_kv_heads * spec.head_dim for spec in layers}
            if len(widths) != 1:
                raise ValueError(f"shared pages need one width per group, got {widths} ({group})")
            width = widths.pop()
            self.parts_of_group[group] = layout.layers_per_lane(width)
            for i, spec in enumerate(layers):
                place = layout.place(i, width)
                shape = (-1, spec.num_kv_heads, spec.head_dim)
                self.keys[spec.index] = key_lanes[place.lane].view(shape)
                self.values[spec.index] = value_lanes[place.lane].view(shape)
                self.place[spec.index] = place
            pages_per_block = layout.pages_for(len(layers), width)
            if pages_per_block > 1:
                self.page_maps[group] = torch.zeros(
                    pages_per_block, layout.num_pages, dtype=torch.long, device=device
                )

    def assign_pages(self, blocks: list[Block]) -> None:
        """Record where newly allocated multi-page blocks live, in allocation order (a block
        id reused within the list takes its last pages)."""
        for group, page_map in self.page_maps.items():
            latest = {block.block_id: block.pages for block in blocks if block.group == group}
            if latest:
                ids = torch.tensor(list(latest), device=page_map.device)
                pages = torch.tensor(list(latest.values()), device=page_map.device)
                page_map[:, ids] = pages.t()

    def relocate_blocks(self, group: str, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks (named by their first page) -> `[pages per block, parts, *blocks.shape]`:
        the same blocks in the pool of a layer on each page of the blocks and part of the
        lane (LanePlace.page, LanePlace.part), every place of the group at once."""
        page_map = self.page_maps.get(group)
        pages = blocks[None] if page_map is None else page_map[:, blocks]
        parts = self.parts_of_group.get(group, 1)
        if parts == 1:
            return pages[:, None]
        part = torch.arange(parts, device=blocks.device).view(1, parts, *[1] * blocks.dim())
        return pages[:, None] * parts + part

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store `keys`/`values` ([N, num_kv_heads, head_dim]) of `layer` at `slots` ([N]),
        rounded to the pools' dtype."""
        key_pool, value_pool = self.keys[layer], self.values[layer]
        key_pool.index_copy_(0, slots, keys.to(key_pool.dtype))
        value_pool.index_copy_(0, slots, values.to(value_pool.dtype))

    def copy_block(
        self, group: str, src_pages: tuple[int, ...], dst_pages: tuple[int, ...]
    ) -> None:
        """Copy-on-write: duplicate a block on `src_pages` into `dst_pages` in every layer
        storing for `group`."""
        bs = self.block_size
        for layer in self.keys:
            if self.group_of_layer[layer] == group:
                place = self.place[layer]
                src = (src_pages[place.page] * place.parts + place.part) * bs
                dst = (dst_pages[place.page] * place.parts + place.part) * bs
                self.keys[layer][dst : dst + bs] = self.keys[layer][src : src + bs]
                self.values[layer][dst : dst + bs] = self.values[layer][src : src + bs]
