"""What one forward step receives: the flattened tokens of every scheduled sequence and,
per KV-cache group, where their keys and values live in the paged cache.

A step may mix prefill chunks and single-token decodes of many sequences. Tokens are laid
out sequence after sequence: sequence i owns rows query_start[i]:query_start[i+1].

Keys are described by slot (block * block_size + offset) *and* position, so a sequence's
cache need not be contiguous: sliding-window layers drop blocks that fell out of the
window and per-session eviction drops blocks from the middle; the masks are built from
positions, never from slot order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch


def slots_of_blocks(block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., n] block ids -> [..., n * block_size]: every slot of those blocks, in order."""
    offsets = torch.arange(block_size, device=block_ids.device)
    return (block_ids[..., None] * block_size + offsets).flatten(-2)


@dataclass
class GroupAttention:
    """Paged-cache addressing for one cache group (all layers that share block tables).

    slot_mapping: [T] where each new token's K/V is written (-1: do not store).
    key_slots:    [B, K] slots each sequence attends to, padded (padding points at slot 0).
    key_positions:[B, K] position of each key; padding holds -1.
    key_valid:    [B, K] False on padding.
    block_ids:    [B, K / block_size] the block each run of block_size key slots lies in
                  (padding: block 0), when key_slots are laid out by blocks (the model runner's
                  batches always are); needed for layers on a block's other pages (SharedPages).
    The new tokens of this step are already included in key_slots (they are written
    before attention reads the cache).
    """

    slot_mapping: torch.Tensor
    key_slots: torch.Tensor
    key_positions: torch.Tensor
    key_valid: torch.Tensor
    block_ids: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute position of each token in its sequence
    query_start: list[int]  # B+1 offsets into the T rows
    groups: dict[str, GroupAttention]  # cache group name -> addressing ("full", "sliding")
    logits_indices: torch.Tensor  # [N] rows whose next-token logits are wanted
    # Set when an eviction policy needs the attention mass each key received (h2o).
    collect_attention: bool = False
    # Prompt logprobs (engine.prompt_logprobs): [S] rows whose logits score the prompt token
    # `score_targets` names, the top alternatives each wants, and per sequence how many of
    # the S rows are its own (in sequence order).
    score_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    score_targets: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    score_top: list[int] = field(default_factory=list)
    score_counts: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_start) - 1

    @property
    def query_lens(self) -> list[int]:
        return [b - a for a, b in pairwise(self.query_start)]
