"""The per-step attention plan of one cache group (engine.model.paged_attention): the batch's
sequences in chunks (all decodes together, each prefill alone), with their gather indices,
positions and additive masks made once per step and shared by every layer of the group."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from engine.kv.layout import LanePlace
from engine.model.batch import ForwardBatch, GroupAttention, slots_of_blocks
from engine.model.kv_cache import PagedKVCache


@dataclass
class Chunk:
    """Sequences attended in one batched call."""

    rows: slice | torch.Tensor  # their query rows in the flattened batch
    seqs: slice | torch.Tensor  # their indices in the batch
    num_seqs: int
    q_len: int  # 1 for the decode chunk; the chunk length for a prefill chunk
    num_keys: int  # key columns used (the group's key rows are cut to this width)
    key_slots: torch.Tensor  # [num_seqs * num_keys] slots to gather
    mask: torch.Tensor  # [num_seqs, 1, q_len, num_keys] additive: 0 or the dtype's minimum
    # A prefill chunk whose keys are its own queries' positions, 0 to q_len - 1, all visible
    # causally (no earlier keys, no window cutting in): its keys are this step's fresh ones.
    causal_fresh: bool = False
    # A sequence's prefill chunk longer than its sliding window, in blocks of query rows, each
    # with the key columns its rows can see: (first row, row end, first column, column end).
    # Each block attends over its columns only, not the whole chunk's (window_blocks).
    query_blocks: tuple[tuple[int, int, int, int], ...] = ()


class GroupPlan:
    """One cache group's addressing for one step, in the form attention consumes."""

    def __init__(
        self,
        group: GroupAttention,
        batch: ForwardBatch,
        window: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        slot_mapping = group.slot_mapping
        stored = slot_mapping >= 0
        if bool(stored.all()):
            self.write_rows: torch.Tensor | None = None
            self.write_slots = slot_mapping.to(device)
        else:
            rows = stored.nonzero().squeeze(1)
            self.write_rows = rows.to(device)
            self.write_slots = slot_mapping[rows].to(device)

        self.block_ids = group.block_ids
        self.device = device
        key_valid = group.key_valid
        self.key_valid = key_valid
        self.key_positions = group.key_positions
        num_cols = key_valid.shape[1]
        # Columns each sequence uses: up to its last valid key; later columns are padding.
        columns = torch.arange(1, num_cols + 1, device=key_valid.device)
        widths = (
            (key_valid.long() * columns).amax(dim=1).tolist() if num_cols else [0] * batch.num_seqs
        )
        self.num_cols = num_cols
        self.chunks = list(self._chunks(group, batch, widths, window, device, dtype))

    def relocated(self, cache: PagedKVCache, group: str) -> dict[tuple[int, int], GroupPlan]:
        """This plan for the layers kept elsewhere in the blocks, by (page, part) of their
        LanePlace: slots moved for every place at once, the key slots rebuilt from the block
        tables (block_size times smaller) rather than moved slot by slot."""
        if self.block_ids is None:
            raise ValueError("shared pages need key slots laid out by blocks (block_ids)")
        bs = cache.block_size
        blocks = cache.relocate_blocks(group, self.block_ids.to(self.device))
        key_slots = slots_of_blocks(blocks, bs)  # [pages, parts, B, K]
        writes = cache.relocate_blocks(group, self.write_slots // bs) * bs + self.write_slots % bs
        num_pages, parts = blocks.shape[:2]
        plans = {}
        for page, part in itertools.product(range(num_pages), range(parts)):
            if not LanePlace(page=page, part=part, parts=parts).moves_slots:
                continue  # where the block tables point: this plan
            plan = copy.copy(self)
            plan.write_slots = writes[page, part]
            plan.chunks = [
                replace(
                    chunk, key_slots=key_slots[page, part][chunk.seqs, : chunk.num_keys].reshape(-1)
                )
                for chunk in self.chunks
            ]
            plans[page, part] = plan
        return plans

    @staticmethod
    def _chunks(
        group: GroupAttention,
        batch: ForwardBatch,
        widths: list[int],
        window: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Iterator[Chunk]:
        starts, lens, positions = batch.query_start, batch.query_lens, batch.positions
        decode = [i for i, n in enumerate(lens) if n == 1]
        if len(decode) == batch.num_seqs:  # a pure decode step: rows and sequences coincide
            everyone = slice(0, batch.num_seqs)
            yield make_chunk(
                group,
                everyone,
                everyone,
                positions[everyone],
                1,
                max(widths),
                window,
                device,
                dtype,
            )
        elif decode:
            seqs = torch.tensor(decode, device=positions.device)
            decode_rows = torch.tensor([starts[i] for i in decode], device=positions.device)
            width = max(widths[i] for i in decode)
            yield make_chunk(
                group, seqs, decode_rows, positions[decode_rows], 1, width, window, device, dtype
            )
        for i, n in enumerate(lens):
            if n > 1:
                rows = slice(starts[i], starts[i + 1])
                yield make_chunk(
                    group,
                    slice(i, i + 1),
                    rows,
                    positions[rows],
                    n,
                    widths[i],
                    window,
                    device,
                    dtype,
                )


def make_chunk(
    group: GroupAttention,
    seqs: slice | torch.Tensor,
    rows: slice | torch.Tensor,
    query_positions: torch.Tensor,
    q_len: int,
    width: int,
    window: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Chunk:
    """A chunk over sequences `seqs` (their query rows `rows`, positions [len(seqs) * q_len])."""
    key_slots = group.key_slots[seqs, :width]
    key_positions = group.key_positions[seqs, :width]
    query_positions = query_positions.view(key_slots.shape[0], q_len)
    visible = group.key_valid[seqs, :width][:, None, :] & (
        key_positions[:, None, :] <= query_positions[:, :, None]
    )
    if window is not None:
        visible &= (query_positions[:, :, None] - key_positions[:, None, :]) < window
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    causal_fresh = (
        q_len > 1
        and width == q_len
        and (window is None or window >= q_len)
        and bool(torch.equal(key_positions[0], query_positions[0]))
        and bool(torch.equal(query_positions[0], torch.arange(q_len, device=visible.device)))
        and bool(group.key_valid[seqs, :width].all())
    )
    blocks: tuple[tuple[int, int, int, int], ...] = ()
    if window is not None and q_len > 1 and key_slots.shape[0] == 1 and not causal_fresh:
        blocks = window_blocks(visible[0], max(1, window // WINDOW_BLOCKS))
    return Chunk(
        rows=rows if isinstance(rows, slice) else rows.to(device),
        seqs=seqs if isinstance(seqs, slice) else seqs.to(device),
        num_seqs=key_slots.shape[0],
        q_len=q_len,
        num_keys=width,
        key_slots=key_slots.reshape(-1).to(device),
        mask=mask[:, None].to(device),
        causal_fresh=causal_fresh,
        query_blocks=blocks,
    )


# Query blocks per sliding window in a long prefill chunk: each block of window / 4 rows sees
# at most 1.25 windows of keys, against the chunk's whole width for one masked call
# (`python -m evals.bench_peers`' long-prompt point; a fused kernel computes masked-out keys).
WINDOW_BLOCKS = 4


def window_blocks(visible: torch.Tensor, block_rows: int) -> tuple[tuple[int, int, int, int], ...]:
    """`visible` ([q_len, width] bool) in blocks of `block_rows` query rows, each with the span
    of key columns any of its rows sees; none where that would not save a quarter of the
    work."""
    q_len, width = visible.shape
    blocks = []
    for start in range(0, q_len, block_rows):
        end = min(q_len, start + block_rows)
        columns = visible[start:end].any(dim=0).nonzero()
        if columns.numel() == 0:  # rows that see nothing: the whole-width call handles them
            return ()
        blocks.append((start, end, int(columns[0]), int(columns[-1]) + 1))
    work = sum((end - start) * (last - first) for start, end, first, last in blocks)
    return tuple(blocks) if work <= 0.75 * q_len * width else ()
