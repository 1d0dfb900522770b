"""The KV cache's logical layout, shared by the block bookkeeping (engine.kv) and the physical
pools (engine.model.kv_cache): which layers share a block table (CacheGroupSpec), and, when the
groups share one pool of pages (SharedPages), where each storing layer's K/V sits in a page
(LanePlace). engine.kv.sizing decides how many blocks or pages a memory budget makes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def primary_group(names: Iterable[str]) -> str:
    """The group every prefix-cache node and h2o score is keyed by: "full" when the model has
    full-attention layers, else the first group."""
    names = list(names)
    return "full" if "full" in names else names[0]


@dataclass(frozen=True)
class CacheGroupSpec:
    """Layers that share one block table: all full-attention layers, or all sliding ones."""

    name: str  # "full" or "sliding"
    layer_ids: tuple[int, ...]  # layers that store K/V in this group (KV-shared layers excluded)
    sliding_window: int | None  # None for full attention
    bytes_per_token: int  # K and V of one token across this group's layers, at the cache dtype
    # (num_kv_heads, head_dim) when every layer of the group has it; None when they differ.
    layer_shape: tuple[int, int] | None = None


@dataclass(frozen=True)
class LanePlace:
    """Where one storing layer's K/V sits in its group's blocks under SharedPages: on the
    block's page `page`, in lane `lane`, part `part` of the lane's `parts` (a layer `parts`
    times narrower than the lane shares it with parts - 1 others)."""

    page: int = 0
    lane: int = 0
    part: int = 0
    parts: int = 1

    @property
    def moves_slots(self) -> bool:
        """Whether the layer's slots differ from those of the block's first page."""
        return self.page != 0 or self.parts != 1


@dataclass(frozen=True)
class SharedPages:
    """Every cache group's blocks carved from one pool of `num_pages` pages. A page is
    `block_size` token slots of `lanes` lanes, each `lane_width` K (and as many V) elements
    per token: the widest storing layer's num_kv_heads * head_dim. A group whose layers are k
    times narrower puts k of them in a lane; its i-th layer takes lane slot i // k (part i % k),
    which is lane slot % lanes of the block's page slot // lanes."""

    num_pages: int
    lanes: int
    lane_width: int

    def layers_per_lane(self, width: int) -> int:
        if width <= 0 or self.lane_width % width:
            raise ValueError(f"a layer {width} wide does not divide lanes {self.lane_width} wide")
        return self.lane_width // width

    def pages_for(self, num_layers: int, width: int) -> int:
        """Pages a block of `num_layers` layers `width` wide takes."""
        lane_slots = -(-num_layers // self.layers_per_lane(width))
        return -(-lane_slots // self.lanes)

    def pages_per_block(self, group: CacheGroupSpec) -> int:
        return self.pages_for(len(group.layer_ids), layer_width(group))

    def place(self, i: int, width: int) -> LanePlace:
        """Where the i-th storing layer of a group of layers `width` wide sits."""
        parts = self.layers_per_lane(width)
        lane_slot, part = divmod(i, parts)
        page, lane = divmod(lane_slot, self.lanes)
        return LanePlace(page, lane, part, parts)


def layer_width(group: CacheGroupSpec) -> int:
    """K elements per token of one of the group's layers (num_kv_heads * head_dim)."""
    if group.layer_shape is None:
        raise ValueError(f"the {group.name} group's layers differ in shape")
    heads, head_dim = group.layer_shape
    return heads * head_dim
