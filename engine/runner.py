"""The model runner: one step's plan in, logits out.

Everything between the scheduler's plan and the model's layers lives here: it owns the
physical paged KV cache, applies the plan's block copies and page mappings, flattens the
scheduled chunks into one ForwardBatch (build_forward_batch, a pure function of the plan),
builds the per-step attention state every layer shares (PagedAttentionStep), moves the inputs
to the device, runs the backend's model, reduces the logits of prompt positions that score
their next token (engine.prompt_logprobs), and reports the attention mass an eviction policy
asked for. It never sees the KV manager: the plan carries what it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from engine.backends.base import InferenceBackend
from engine.kv.block_tables import BlockCopy
from engine.kv.layout import SharedPages, primary_group
from engine.kv.session_eviction import KeyMass
from engine.model import cpu_ops
from engine.model.batch import ForwardBatch, GroupAttention
from engine.model.kv_cache import PagedKVCache, cache_group_specs
from engine.model.paged_attention import PagedAttentionStep
from engine.prompt_logprobs import positions_to_score, reduce_prompt_logprobs
from engine.request import TokenLogprob
from engine.sched.output import ScheduledSeq, SchedulerOutput


@dataclass
class RunnerOutput:
    # [N, vocab] float32, rows in the order of batch.logits_indices; None where token_ids
    # holds the step's tokens instead.
    logits: torch.Tensor | None
    # With forward(greedy=True), where the backend's LM head has its own argmax: each
    # sampling row's first maximum, in the same order (the logits were never written).
    token_ids: list[int] | None = None
    # Per scheduled sequence, the prompt tokens this step scored (batch.score_counts of them;
    # engine.prompt_logprobs); None when no sequence wanted any.
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    # With batch.collect_attention: per sequence, the attention mass each of its keys in the
    # primary ("full") group received in this step, summed over layers and heads, with those
    # keys' slots (padding dropped).
    attention_mass: list[KeyMass] | None = None


class ModelRunner:
    """Runs `backend`'s model over a KV cache of `num_blocks` blocks of `block_size` tokens
    (per cache group, one count for every group, or a shared page pool; the KV manager hands
    out the same ids)."""

    def __init__(
        self,
        backend: InferenceBackend,
        num_blocks: int | Mapping[str, int] | SharedPages,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.backend = backend
        self.device, self.dtype = backend.device, backend.dtype
        self.kv_dtype = kv_dtype or backend.dtype  # the pools' dtype; None: the model's
        self.cache_groups = cache_group_specs(backend.arch, self.kv_dtype)
        self.group_names = [group.name for group in self.cache_groups]
        self.windows = {group.name: group.sliding_window for group in self.cache_groups}
        self.kv_cache = PagedKVCache(
            backend.arch, num_blocks, block_size, self.device, self.kv_dtype
        )
        # Fused attention kernels wherever the numerics need not be transformers' own; decode
        # read in place from the pools where cpu_ops' kernel takes this model and cache.
        self.fused_attention = not backend.exact
        self.paged_decode = (
            self.fused_attention
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and self.kv_dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.available()
        )
        # The sampled rows' logits, kept between steps (see linear_kernels.slice_output).
        self._logits_buffer: torch.Tensor | None = None

    def prepare(self, plan: SchedulerOutput) -> ForwardBatch:
        """Map the pages of the plan's newly allocated multi-page blocks and apply its block
        copies (before any K/V of this step is written), then flatten its chunks into one
        batch."""
        self.kv_cache.assign_pages(plan.page_assignments)
        self.copy_blocks(plan.block_copies)
        return build_forward_batch(plan.scheduled, self.group_names, self.kv_cache.block_size)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: duplicate each (group, src, dst) block, in list order."""
        for copy in copies:
            self.kv_cache.copy_block(copy.group, *copy.pages)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, greedy: bool = False) -> RunnerOutput:
        """Write the batch's new K/V into the cache, attend, return the wanted logits; with
        `greedy` (every sampling row takes the argmax of its logits as they are), the rows'
        argmax instead where the backend's head computes it without the logits."""
        step = PagedAttentionStep(
            batch,
            self.kv_cache,
            self.windows,
            self.device,
            self.kv_dtype,  # the masks' dtype: what the fused attention computes in
            fused=self.fused_attention,
            paged_decode=self.paged_decode,
        )
        num_sampled = len(batch.logits_indices)
        rows = batch.logits_indices
        if batch.score_counts:
            rows = torch.cat([rows, batch.score_rows])
        hidden = self.backend.hidden_states(
            batch.input_ids.to(self.device),
            batch.positions.to(self.device),
            step,
            rows.to(self.device, torch.long),
        )
        token_ids = self.backend.greedy_tokens(hidden[:num_sampled]) if greedy else None
        logits = None
        if token_ids is None:
            logits = self.backend.logits(hidden[:num_sampled], self._logits_out(num_sampled))
        prompt_logprobs = None
        if batch.score_counts:
            scored = reduce_prompt_logprobs(
                self.backend.logits, hidden[num_sampled:], batch.score_targets, batch.score_top
            )
            prompt_logprobs = _split(scored, batch.score_counts)
        masses = step.attention_mass()
        return RunnerOutput(
            logits=logits,
            token_ids=None if token_ids is None else token_ids.tolist(),
            prompt_logprobs=prompt_logprobs,
            attention_mass=None if masses is None else keyed_masses(batch, masses),
        )

    def release_buffers(self) -> None:
        """Give back what forward() keeps between steps (the logits buffer), so that memory is
        held only while requests run: a burst of wide steps does not pin it for good."""
        self._logits_buffer = None

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """A [rows, vocab] float32 view of the logits buffer, grown to the most rows asked for
        since the last release_buffers(); valid until the next forward, which is when the step
        has sampled from it."""
        if self.device.type != "cpu" or rows == 0:
            return None
        if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
            self._logits_buffer = torch.empty((rows, self.backend.vocab_size))
        return self._logits_buffer[:rows]


def keyed_masses(batch: ForwardBatch, masses: list[torch.Tensor]) -> list[KeyMass]:
    """Each sequence's attention mass (PagedAttentionStep.attention_mass) with the slots of
    the primary group's keys it belongs to."""
    group = batch.groups[primary_group(batch.groups)]
    return [
        KeyMass(group.key_slots[row][group.key_valid[row]], mass) for row, mass in enumerate(masses)
    ]


def build_forward_batch(
    scheduled: list[ScheduledSeq], groups: list[str], block_size: int
) -> ForwardBatch:
    """Flatten the scheduled chunks into one batch, addressing the cache `groups` (blocks of
    `block_size` tokens); logits are wanted only for sequences whose chunk reaches their last
    token (those sample this step). Built on the CPU; the runner moves what the model needs
    to its device."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    logits_indices: list[int] = []
    ends: list[int] = []  # per sequence: its tokens after this step
    slot_rows: dict[str, list[int]] = {group: [] for group in groups}
    held_blocks: dict[str, list[list[tuple[int, int]]]] = {group: [] for group in groups}
    collect_attention = False
    score_rows: list[int] = []
    score_targets: list[int] = []
    score_top: list[int] = []
    score_counts: list[int] = []
    for item in scheduled:
        seq, start, count = item.seq, item.start, item.num_new_tokens
        input_ids.extend(seq.token_ids[start : start + count])
        positions.extend(range(start, start + count))
        query_start.append(query_start[-1] + count)
        ends.append(start + count)
        if item.samples:
            logits_indices.append(query_start[-1] - 1)
        scored = positions_to_score(seq, start, count)
        score_rows.extend(query_start[-2] + p - start for p in scored)
        score_targets.extend(seq.prompt_token_ids[p + 1] for p in scored)
        score_top.extend([seq.sampling.prompt_logprobs or 0] * len(scored))
        score_counts.append(len(scored))
        for group in groups:
            slot_rows[group].extend(item.kv.slots[group])
            held_blocks[group].append(item.kv.blocks[group])
        collect_attention = collect_attention or item.kv.wants_attention
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        query_start=query_start,
        groups={
            group: _group_attention(slot_rows[group], held_blocks[group], ends, block_size)
            for group in groups
        },
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        collect_attention=collect_attention,
        score_rows=torch.tensor(score_rows, dtype=torch.long),
        score_targets=torch.tensor(score_targets, dtype=torch.long),
        score_top=score_top,
        score_counts=score_counts if score_rows else [],
    )


def _split(items: list[TokenLogprob], counts: list[int]) -> list[list[TokenLogprob]]:
    """`items` cut into consecutive runs of `counts` items."""
    runs, begin = [], 0
    for count in counts:
        runs.append(items[begin : begin + count])
        begin += count
    return runs


def _group_attention(
    slot_mapping: list[int], held: list[list[tuple[int, int]]], ends: list[int], block_size: int
) -> GroupAttention:
    """Key addressing from each sequence's held blocks ((block id, logical index) pairs): the
    tables are expanded to slots and positions with array ops, so the Python work per step
    grows with blocks, not tokens. A row's keys are its held blocks' slots in logical order;
    the columns past its last token (the unfilled tail of the last block, and padding up to
    the longest row) are invalid. Built in numpy: on arrays this small a numpy op costs a
    fraction of a torch op, and the step runs this for every cache group."""
    width = max((len(blocks) for blocks in held), default=0)
    block_ids = np.zeros((len(held), width), dtype=np.int64)
    logical = np.full((len(held), width), -1, dtype=np.int64)
    for row, blocks in enumerate(held):
        if blocks:
            block_ids[row, : len(blocks)], logical[row, : len(blocks)] = zip(*blocks, strict=True)
    offsets = np.arange(block_size, dtype=np.int64)
    key_slots = (block_ids[:, :, None] * block_size + offsets).reshape(len(held), -1)
    key_positions = (logical[:, :, None] * block_size + offsets).reshape(len(held), -1)
    key_valid = (key_positions >= 0) & (key_positions < np.asarray(ends, dtype=np.int64)[:, None])
    return GroupAttention(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        key_slots=torch.from_numpy(key_slots),
        key_positions=torch.from_numpy(np.where(key_valid, key_positions, -1)),
        key_valid=torch.from_numpy(key_valid),
        block_ids=torch.from_numpy(block_ids),
    )
