"""Turn the scheduler's decision for one step into the backend's ForwardBatch."""

from __future__ import annotations

import torch

from engine.kv.manager import KVCacheManager
from engine.model.batch import ForwardBatch, GroupAttention
from engine.sched.output import ScheduledSeq


def build_forward_batch(scheduled: list[ScheduledSeq], kv: KVCacheManager) -> ForwardBatch:
    """Flatten the scheduled chunks into one batch; logits are wanted only for sequences whose
    chunk reaches their last token (those sample this step). Built on the CPU; the backend moves
    what it needs to its device."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    logits_indices: list[int] = []
    slot_rows: dict[str, list[int]] = {group: [] for group in kv.pools}
    key_rows: dict[str, list[tuple[list[int], list[int]]]] = {group: [] for group in kv.pools}
    collect_attention = False
    for item in scheduled:
        seq, start, count = item.seq, item.start, item.num_new_tokens
        input_ids.extend(seq.token_ids[start : start + count])
        positions.extend(range(start, start + count))
        query_start.append(query_start[-1] + count)
        if item.samples:
            logits_indices.append(query_start[-1] - 1)
        for group, slots in kv.slots_for_new_tokens(seq, count).items():
            slot_rows[group].extend(slots)
        for group, keys in kv.key_slots_and_positions(seq, count).items():
            key_rows[group].append(keys)
        collect_attention = collect_attention or kv.wants_attention(seq)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        query_start=query_start,
        groups={group: _group_attention(slot_rows[group], key_rows[group]) for group in kv.pools},
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        collect_attention=collect_attention,
    )


def _group_attention(
    slot_mapping: list[int], keys: list[tuple[list[int], list[int]]]
) -> GroupAttention:
    width = max((len(slots) for slots, _ in keys), default=0)
    key_slots = torch.zeros(len(keys), width, dtype=torch.long)
    key_positions = torch.full((len(keys), width), -1, dtype=torch.long)
    for row, (slots, row_positions) in enumerate(keys):
        key_slots[row, : len(slots)] = torch.tensor(slots, dtype=torch.long)
        key_positions[row, : len(slots)] = torch.tensor(row_positions, dtype=torch.long)
    return GroupAttention(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        key_slots=key_slots,
        key_positions=key_positions,
        key_valid=key_positions >= 0,
    )
