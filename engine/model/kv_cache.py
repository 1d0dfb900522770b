"""The physical paged KV cache: one preallocated key pool and one value pool per layer that
stores K/V.

A layer's pool has `num_blocks[group] * block_size` slots; slot = block * block_size + offset,
so the engine's block tables address it directly. Each cache group ("full", "sliding") has its
own slot space and its own number of blocks (engine.kv.sizing): the engine keeps one block
table per group, and every layer of a group is indexed by the same slots. KV-shared layers own
no pool; they read their producer's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.backends.base import CacheGroupSpec
from engine.model.architecture import GemmaArchitecture

GROUP_ORDER = ("full", "sliding")
# Linear kernels whose activations already pass through bfloat16 or int8 (linear_kernels).
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
        specs.append(
            CacheGroupSpec(
                name=group,
                layer_ids=tuple(spec.index for spec in layers),
                sliding_window=arch.window_of_group(group),
                bytes_per_token=bytes_per_token,
            )
        )
    return specs


class PagedKVCache:
    """Key and value pools, `[num_slots, num_kv_heads, head_dim]` per storing layer."""

    def __init__(
        self,
        arch: GemmaArchitecture,
        num_blocks: int | Mapping[str, int],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`num_blocks`: per cache group, or one count for every group."""
        if isinstance(num_blocks, int):
            num_blocks = {spec.group: num_blocks for spec in arch.layers}
        if min(num_blocks.values(), default=0) <= 0 or block_size <= 0:
            raise ValueError(
                f"need a positive number of blocks and block size, got {num_blocks} x {block_size}"
            )
        self.num_blocks = dict(num_blocks)
        self.block_size = block_size
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        for spec in arch.layers:
            if spec.stores_kv:
                shape = (num_blocks[spec.group] * block_size, spec.num_kv_heads, spec.head_dim)
                self.keys[spec.index] = torch.zeros(shape, device=device, dtype=dtype)
                self.values[spec.index] = torch.zeros(shape, device=device, dtype=dtype)
        # Which group's addressing each layer reads: its own, or its KV producer's.
        self.group_of_layer = {
            spec.index: arch.layers[spec.kv_source].group for spec in arch.layers
        }

    def write(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store `keys`/`values` ([N, num_kv_heads, head_dim]) of `layer` at `slots` ([N]),
        rounded to the pools' dtype."""
        key_pool, value_pool = self.keys[layer], self.values[layer]
        key_pool.index_copy_(0, slots, keys.to(key_pool.dtype))
        value_pool.index_copy_(0, slots, values.to(value_pool.dtype))

    def copy_block(self, group: str, src: int, dst: int) -> None:
        """Copy-on-write: duplicate block `src` into `dst` in every layer storing for `group`."""
        bs = self.block_size
        for layer in self.keys:
            if self.group_of_layer[layer] == group:
                self.keys[layer][dst * bs : (dst + 1) * bs] = self.keys[layer][
                    src * bs : (src + 1) * bs
                ]
                self.values[layer][dst * bs : (dst + 1) * bs] = self.values[layer][
                    src * bs : (src + 1) * bs
                ]
