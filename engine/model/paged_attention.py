"""Attention over the block-paged KV cache, for prefill, decode and mixed batches.

One `PagedAttentionStep` is prepared per forward step from the ForwardBatch and shared by every
layer: per cache group it turns the batch's slots and positions into gather indices and additive
masks once, so a layer only writes its new K/V and runs a few batched tensor ops.

Sequences are attended in chunks:
- every single-token (decode) sequence together, keys padded to the longest of them: one
  batched matmul -> softmax -> matmul per layer, with the query heads of a KV head folded
  into the matmul rows (grouped-query attention without copying K/V per query head);
- each multi-token (prefill) sequence on its own, in exactly the order of operations of
  transformers' eager attention (keys repeated per query head), so a single-sequence prefill
  reproduces it bit for bit.

With `fused` (every mode but NUMERICS=exact), a chunk whose attention mass nobody asked for
and whose layer has no logit softcap runs PyTorch's fused scaled_dot_product_attention on the
same gathered K/V and mask instead: no [heads, queries, keys] score matrix is materialized, and
keys are shared across query heads without copies. It sums in another order, so its outputs
differ from the explicit path's in the last bits (tests/test_paged_attention.py bounds it).
With `paged_decode` as well (on a CPU where cpu_ops' kernels are built), such a decode chunk
reads its keys and values in place from the pools (cpu_ops.paged_decode_attention): nothing is
gathered, and the queries stay float32 over a bfloat16 cache.

Masks come from positions, never from slot order: key j is visible to query i when it is
valid, kpos <= qpos, and, on sliding layers, qpos - kpos < window. The softmax is explicit,
which also yields the attention mass each key receives (for H2O eviction).

Which layers H2O's scores come from: by default (H2O_MASS_GROUPS) only the "full" cache
group's layers, 3 of 18 on Gemma 3 270M (every sixth layer), the only layers that see every key
a sequence holds. `mass_groups=("full", "sliding")` also counts the sliding-window layers: each
sliding key's mass goes to the full-group key at the same position (a sliding layer only sees
its last `window` positions). `python -m evals.eviction` measures both on the embedded model
(docs/kv-cache.md, "KV eviction", has the perplexity of each). The engine default stays
full-only: switching it is this constant, and tests/test_paged_attention.py's mass test pins
the full-only sum.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.kv.layout import LanePlace
from engine.model import cpu_ops
from engine.model.batch import ForwardBatch, GroupAttention, slots_of_blocks
from engine.model.kv_cache import PagedKVCache

# The cache groups whose layers' attention mass H2O's scores sum (see the module docstring).
H2O_MASS_GROUPS: tuple[str, ...] = ("full",)


@dataclass
class _Chunk:
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
    # Each block attends over its columns only, not the whole chunk's (_window_blocks).
    query_blocks: tuple[tuple[int, int, int, int], ...] = ()


class _GroupPlan:
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

    def relocated(self, cache: PagedKVCache, group: str) -> dict[tuple[int, int], _GroupPlan]:
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
    ) -> Iterator[_Chunk]:
        starts, lens, positions = batch.query_start, batch.query_lens, batch.positions
        decode = [i for i, n in enumerate(lens) if n == 1]
        if len(decode) == batch.num_seqs:  # a pure decode step: rows and sequences coincide
            everyone = slice(0, batch.num_seqs)
            yield _make_chunk(
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
            yield _make_chunk(
                group, seqs, decode_rows, positions[decode_rows], 1, width, window, device, dtype
            )
        for i, n in enumerate(lens):
            if n > 1:
                rows = slice(starts[i], starts[i + 1])
                yield _make_chunk(
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


def _make_chunk(
    group: GroupAttention,
    seqs: slice | torch.Tensor,
    rows: slice | torch.Tensor,
    query_positions: torch.Tensor,
    q_len: int,
    width: int,
    window: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> _Chunk:
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
        blocks = _window_blocks(visible[0], max(1, window // WINDOW_BLOCKS))
    return _Chunk(
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


def _window_blocks(visible: torch.Tensor, block_rows: int) -> tuple[tuple[int, int, int, int], ...]:
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


class PagedAttentionStep:
    """Per-step attention state shared by all layers: write new K/V, attend over the cache.

    With batch.collect_attention, the attention mass each key receives is summed per cache
    group in `mass_groups` (default H2O_MASS_GROUPS); groups absent from the model are skipped.
    """

    def __init__(
        self,
        batch: ForwardBatch,
        cache: PagedKVCache,
        windows: dict[str, int | None],
        device: torch.device,
        dtype: torch.dtype,
        mass_groups: Collection[str] | None = None,
        fused: bool = False,
        paged_decode: bool = False,
    ) -> None:
        self.cache = cache
        self.fused = fused
        self.paged_decode = paged_decode
        self.num_tokens = int(batch.input_ids.shape[0])
        self.plans = {
            name: _GroupPlan(group, batch, windows.get(name), device, dtype)
            for name, group in batch.groups.items()
        }
        # Plans of layers elsewhere in a block than its first page (shared pages), by (group,
        # page, part), made for all of a group's places on first use.
        self._relocated: dict[tuple[str, int, int], _GroupPlan] = {}
        # Mass is reported per key of the primary group: "full" if the model has it.
        self.primary = "full" if "full" in self.plans else next(iter(self.plans), "full")
        wanted = H2O_MASS_GROUPS if mass_groups is None else tuple(mass_groups)
        self.mass_groups = tuple(name for name in wanted if name in self.plans)
        self.masses: dict[str, torch.Tensor] = {}
        # This step's keys and values by storing layer, rounded as the cache stores them (fused
        # modes only): a fresh prompt's chunk reads them instead of gathering from the pools.
        self._fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._keep_fresh = fused and any(
            chunk.causal_fresh for plan in self.plans.values() for chunk in plan.chunks
        )
        if batch.collect_attention:
            for name in self.mass_groups:
                self.masses[name] = torch.zeros(
                    batch.num_seqs, self.plans[name].num_cols, dtype=torch.float32, device=device
                )

    def _plan_of(self, layer: int) -> _GroupPlan:
        """The addressing `layer` reads: its group's, moved to where in a block it lives."""
        group, place = self.cache.group_of_layer[layer], self.cache.place_of_layer[layer]
        if not place.moves_slots:
            return self.plans[group]
        key = (group, place.page, place.part)
        if key not in self._relocated:  # the group's first layer off its first page
            moved = self.plans[group].relocated(self.cache, group)
            self._relocated.update({(group, *at): plan for at, plan in moved.items()})
        return self._relocated[key]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store this step's keys/values ([T, num_kv_heads, head_dim]) of a storing layer."""
        plan = self._plan_of(layer)
        if self._keep_fresh:  # a fresh prompt's chunk attends to these as they are stored
            dtype = self.cache.keys[layer].dtype
            self._fresh[layer] = (keys.to(dtype), values.to(dtype))
        if plan.write_rows is not None:
            keys = keys.index_select(0, plan.write_rows)
            values = values.index_select(0, plan.write_rows)
        if self.paged_decode:  # cpu_ops is there: one op, the same values
            key_pool, value_pool = self.cache.keys[layer], self.cache.values[layer]
            cpu_ops.store_kv(key_pool, value_pool, plan.write_slots, keys, values)
        else:
            self.cache.write(layer, plan.write_slots, keys, values)

    def attend(
        self,
        kv_layer: int,
        query: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Attention output [T, H, head_dim] of `query` ([T, H, head_dim]) over kv_layer's
        cache, in `out_dtype` (default: the query's). A fused chunk computes in the cache's
        dtype: asking for that dtype, where the next GEMM reads it, saves two casts."""
        out_dtype = out_dtype or query.dtype
        group = self.cache.group_of_layer[kv_layer]
        plan = self._plan_of(kv_layer)
        keys, values = self.cache.keys[kv_layer], self.cache.values[kv_layer]
        mass = self.masses.get(group)
        fused = self.fused and mass is None and softcap is None
        attend = _attend_chunk_fused if fused else _attend_chunk
        if fused and self.paged_decode:
            attend = _attend_chunk_paged
        chunks = plan.chunks
        fresh = self._fresh.get(kv_layer) if fused else None

        def run(chunk: _Chunk, rows: torch.Tensor) -> torch.Tensor:
            if fresh is not None and chunk.causal_fresh:
                return _attend_fresh_causal(
                    rows, fresh[0][chunk.rows], fresh[1][chunk.rows], scaling
                )
            return attend(chunk, rows, keys, values, scaling, softcap, mass)

        if len(chunks) == 1 and chunks[0].num_seqs * chunks[0].q_len == self.num_tokens:
            return run(chunks[0], query).to(out_dtype)
        out = query.new_empty(query.shape[0], query.shape[1], values.shape[2], dtype=out_dtype)
        for chunk in chunks:
            result = run(chunk, query[chunk.rows])
            if isinstance(chunk.rows, slice):
                out[chunk.rows] = result
            else:
                out.index_copy_(0, chunk.rows, result.to(out_dtype))
        return out

    def attention_mass(self, groups: Collection[str] | None = None) -> list[torch.Tensor] | None:
        """Per sequence, the mass each valid primary-group ("full") key received this step,
        summed over the layers of `groups` (default: every group collected, `mass_groups`).

        Another group's keys are a subset of the primary group's (a sequence holds the same
        logical blocks in every group, less those a sliding window dropped), so each of its
        keys' mass is added to the primary key at the same position.
        """
        if not self.masses:
            return None
        names = self.mass_groups if groups is None else tuple(groups)
        missing = [name for name in names if name not in self.masses]
        if missing:
            raise ValueError(f"attention mass of {missing} was not collected ({self.mass_groups})")
        plan = self.plans[self.primary]
        device = next(iter(self.masses.values())).device
        valid = plan.key_valid.to(device)
        total = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        if self.primary in names:
            total += self.masses[self.primary]
        others = [name for name in names if name != self.primary]
        if others:
            positions = plan.key_positions.to(device)
            span = max(1, int(positions.max()) + 1) if positions.numel() else 1
            by_position = torch.zeros(valid.shape[0], span, dtype=torch.float32, device=device)
            for name in others:
                other = self.plans[name]
                keep = other.key_valid.to(device)
                where = other.key_positions.to(device).clamp(min=0)
                by_position.scatter_add_(1, where, self.masses[name] * keep)
            total += by_position.gather(1, positions.clamp(min=0)) * valid
        return [row[keep] for row, keep in zip(total, valid, strict=True)]


# Prefill queries are attended in slices so one slice's score matrix stays under this many
# elements (a long prompt against a long cache would otherwise need gigabytes at once).
MAX_SCORES_PER_SLICE = 1 << 25


def _gather_keys_values(
    chunk: _Chunk, key_pool: torch.Tensor, value_pool: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's keys and values from the pools, as [num_seqs, num_kv_heads, num_keys, D]."""
    b, k_len, num_kv_heads = chunk.num_seqs, chunk.num_keys, key_pool.shape[1]
    keys = key_pool.index_select(0, chunk.key_slots).view(b, k_len, num_kv_heads, -1)
    values = value_pool.index_select(0, chunk.key_slots).view(b, k_len, num_kv_heads, -1)
    return keys.transpose(1, 2), values.transpose(1, 2)


def _attend_chunk_paged(
    chunk: _Chunk,
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
) -> torch.Tensor:
    """_attend_chunk_fused with a decode chunk read in place from the pools (no gather)."""
    if chunk.q_len != 1:
        return _attend_chunk_fused(chunk, query, key_pool, value_pool, scaling, softcap, mass)
    return cpu_ops.paged_decode_attention(
        query, key_pool, value_pool, chunk.key_slots, chunk.mask, scaling
    )


def _attend_fresh_causal(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """A fresh prompt's chunk ([T, H, D] queries over its own [T, Hkv, D] keys and values, in
    the cache's dtype): causal attention with no mask to build or read and no gather, and the
    fused kernel skips the blocks above the diagonal. Otherwise as _attend_chunk_fused."""
    k, v = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    return _one_sequence_sdpa(query, k, v, scaling, mask=None)


def _one_sequence_sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's [T, H, D] queries over its [1, Hkv, K, D] keys and values through
    scaled_dot_product_attention in the keys' dtype (query heads grouped onto KV heads), with
    the additive `mask`, or causal where there is none; returns [T, H, D] in the keys' dtype."""
    q = query.to(keys.dtype).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _attend_chunk_fused(
    chunk: _Chunk,
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
) -> torch.Tensor:
    """_attend_chunk through scaled_dot_product_attention (no softcap, no mass). With a cache
    in another dtype than the queries (KV_CACHE_DTYPE), the queries are rounded to the cache's
    dtype and the fused kernel runs in it (it sums in float32), so the gathered keys and
    values are read at their own size; the output comes back in the cache's dtype (the caller
    casts it where it needs another)."""
    num_heads, num_kv_heads = query.shape[1], key_pool.shape[1]
    keys, values = _gather_keys_values(chunk, key_pool, value_pool)
    mask = chunk.mask
    if keys.dtype != query.dtype:
        query, mask = query.to(keys.dtype), mask.to(keys.dtype)
    b = chunk.num_seqs
    if chunk.q_len == 1:
        # Decode: the query heads sharing a KV head are that head's query rows.
        q = query.reshape(b, num_kv_heads, num_heads // num_kv_heads, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(b, num_heads, -1)
    if not chunk.query_blocks:
        return _one_sequence_sdpa(query, keys, values, scaling, mask)
    out = query.new_empty(query.shape[0], num_heads, values.shape[-1], dtype=keys.dtype)
    for start, end, first, last in chunk.query_blocks:
        out[start:end] = _one_sequence_sdpa(
            query[start:end],
            keys[:, :, first:last],
            values[:, :, first:last],
            scaling,
            mask[:, :, start:end, first:last],
        )
    return out


def _attend_chunk(
    chunk: _Chunk,
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
) -> torch.Tensor:
    """Attention output [rows, H, D] of the chunk's queries ([rows, H, D])."""
    num_heads = query.shape[1]
    _, num_kv_heads, head_dim = key_pool.shape
    groups = num_heads // num_kv_heads
    b, q_len, k_len = chunk.num_seqs, chunk.q_len, chunk.num_keys
    keys, values = _gather_keys_values(chunk, key_pool, value_pool)
    keys, values = keys.to(query.dtype), values.to(query.dtype)  # a KV_CACHE_DTYPE cache
    if q_len == 1:
        # Decode: the query heads sharing a KV head become the rows of one matmul.
        q = query.reshape(b, num_kv_heads, groups, head_dim)
        out = _softmax_attention(q, keys, values, chunk.mask, scaling, softcap, mass, chunk)
        return out.view(b, num_heads, -1)
    q = query.transpose(0, 1).unsqueeze(0)
    keys, values = _repeat_heads(keys, groups), _repeat_heads(values, groups)
    rows_per_slice = max(1, MAX_SCORES_PER_SLICE // (num_heads * k_len))
    pieces = [
        _softmax_attention(
            q[:, :, start : start + rows_per_slice],
            keys,
            values,
            chunk.mask[:, :, start : start + rows_per_slice],
            scaling,
            softcap,
            mass,
            chunk,
        )
        for start in range(0, q_len, rows_per_slice)
    ]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return out[0].transpose(0, 1)


def _softmax_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
    chunk: _Chunk,
) -> torch.Tensor:
    """softmax(q k^T * scaling, softcapped, masked) v in transformers' eager order; adds each
    key's probability mass (summed over heads and queries) to `mass` when given."""
    scores = torch.matmul(q, keys.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32)
    if mass is not None:
        contribution = probs.sum(dim=(1, 2))
        if isinstance(chunk.seqs, slice):
            mass[chunk.seqs, : chunk.num_keys] += contribution
        else:
            mass[:, : chunk.num_keys].index_add_(0, chunk.seqs, contribution)
    return torch.matmul(probs.to(q.dtype), values)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, K, D] -> [B, Hkv * groups, K, D], each KV head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, k, d = x.shape
    return x[:, :, None].expand(b, h, groups, k, d).reshape(b, h * groups, k, d)
