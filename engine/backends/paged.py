"""What both backends share: the cache groups of the model, the physical KV pools, and turning a
ForwardBatch into the per-step attention state every layer uses."""

from __future__ import annotations

import torch

from engine.backends.base import CacheGroupSpec
from engine.kv.manager import BlockCopy
from engine.model.architecture import GemmaArchitecture
from engine.model.batch import ForwardBatch
from engine.model.kv_cache import PagedKVCache, cache_group_specs
from engine.model.paged_attention import PagedAttentionStep


class PagedCacheBackend:
    """Base of the `custom` and `hf` backends: owns the paged KV cache of one model."""

    def __init__(
        self,
        arch: GemmaArchitecture,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.vocab_size = int(arch.config.vocab_size)
        self.max_model_len = max_model_len
        self.kv_cache: PagedKVCache | None = None

    def cache_groups(self) -> list[CacheGroupSpec]:
        return cache_group_specs(self.arch, self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = None  # free the old pools before allocating new ones
        self.kv_cache = PagedKVCache(self.arch, num_blocks, block_size, self.device, self.dtype)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before copy_blocks()")
        for copy in copies:
            self.kv_cache.copy_block(copy.group, copy.src, copy.dst)

    def _attention_step(self, batch: ForwardBatch) -> PagedAttentionStep:
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before forward()")
        windows = {group: self.arch.window_of_group(group) for group in batch.groups}
        return PagedAttentionStep(batch, self.kv_cache, windows, self.device, self.dtype)
