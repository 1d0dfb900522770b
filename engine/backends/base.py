"""The contract between the engine and whatever runs the model.

The engine owns scheduling and block bookkeeping; a backend owns the weights and the physical
KV storage, and turns one ForwardBatch into next-token logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.model.batch import ForwardBatch

if TYPE_CHECKING:
    from engine.kv.manager import BlockCopy


@dataclass(frozen=True)
class CacheGroupSpec:
    """Layers that share one block table: all full-attention layers, or all sliding ones."""

    name: str  # "full" or "sliding"
    layer_ids: tuple[int, ...]  # layers that store K/V in this group (KV-shared layers excluded)
    sliding_window: int | None  # None for full attention
    bytes_per_token: int  # K and V of one token across this group's layers, at the cache dtype


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows in the order of batch.logits_indices
    # With batch.collect_attention: per sequence, the attention mass each of its keys in the
    # "full" group received in this step, summed over layers and heads ([K_i] float32, in the
    # order of that group's key_slots row, padding dropped).
    attention_mass: list[torch.Tensor] | None = None


class InferenceBackend(Protocol):
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int

    def cache_groups(self) -> list[CacheGroupSpec]:
        """The KV cache groups this model needs (empty groups are omitted)."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Preallocate num_blocks blocks of block_size tokens for every group."""
        ...

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: duplicate each (group, src, dst) block before the next forward."""
        ...

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Write the batch's new K/V into the cache, attend, return the wanted logits."""
        ...
