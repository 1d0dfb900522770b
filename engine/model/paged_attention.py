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

import functools
from collections.abc import Collection

import torch

from engine.model import cpu_ops
from engine.model.attention_chunks import (
    attend_chunk,
    attend_chunk_fused,
    attend_chunk_paged,
    attend_fresh_causal,
)
from engine.model.attention_plan import Chunk, GroupPlan
from engine.model.batch import ForwardBatch
from engine.model.decode_tables import DecodeTables, decode_tables
from engine.model.kv_cache import PagedKVCache

# The cache groups whose layers' attention mass H2O's scores sum (see the module docstring).
H2O_MASS_GROUPS: tuple[str, ...] = ("full",)


class PagedAttentionStep:
    """Per-step attention state shared by all layers: write new K/V, attend over the cache.

    With batch.collect_attention, the attention mass each key receives is summed per cache
    group in `mass_groups` (default H2O_MASS_GROUPS); groups absent from the model are skipped.
    A pure decode step read in place builds DecodeTables instead of GroupPlans (made only if a
    layer calls write() or attend()).
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
        self._batch, self._windows, self._device, self._dtype = batch, windows, device, dtype
        # Plans of layers elsewhere in a block than its first page (shared pages), by (group,
        # page, part), made for all of a group's places on first use.
        self._relocated: dict[tuple[str, int, int], GroupPlan] = {}
        # Mass is reported per key of the primary group: "full" if the model has it.
        self.primary = "full" if "full" in batch.groups else next(iter(batch.groups), "full")
        wanted = H2O_MASS_GROUPS if mass_groups is None else tuple(mass_groups)
        self.mass_groups = tuple(name for name in wanted if name in batch.groups)
        self.masses: dict[str, torch.Tensor] = {}
        # A pure decode step read in place (decode_addressing's case): its tables, built in
        # one pass per group; the GroupPlans are then made only if write() or attend() run.
        self._decode: dict[str, DecodeTables] | None = None
        pure_decode = all(n == 1 for n in batch.query_lens)
        if fused and paged_decode and pure_decode and not batch.collect_attention:
            self._decode = self._decode_tables()
        # This step's keys and values by storing layer, rounded as the cache stores them (fused
        # modes only): a fresh prompt's chunk reads them instead of gathering from the pools.
        self._fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._keep_fresh = (
            fused
            and self._decode is None
            and any(chunk.causal_fresh for plan in self.plans.values() for chunk in plan.chunks)
        )
        if batch.collect_attention:
            for name in self.mass_groups:
                self.masses[name] = torch.zeros(
                    batch.num_seqs, self.plans[name].num_cols, dtype=torch.float32, device=device
                )

    @functools.cached_property
    def plans(self) -> dict[str, GroupPlan]:
        """Each cache group's GroupPlan (made on first use)."""
        batch = self._batch
        return {
            name: GroupPlan(group, batch, self._windows.get(name), self._device, self._dtype)
            for name, group in batch.groups.items()
        }

    def _decode_tables(self) -> dict[str, DecodeTables] | None:
        """Every group's DecodeTables, or None where a group has a row it does not store."""
        tables = {}
        for name, group in self._batch.groups.items():
            table = decode_tables(
                group, name, self._batch.positions, self._windows.get(name), self.cache, self._dtype
            )
            if table is None:
                return None
            tables[name] = table
        return tables

    def _plan_of(self, layer: int) -> GroupPlan:
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

    def decode_addressing(
        self, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where this step's attention for storing layer `layer` is one paged decode chunk over
        every row, with no attention mass to collect: (key pool, value pool, write slots, key
        slots, mask), what write() and attend() pass to cpu_ops.store_kv and
        cpu_ops.paged_decode_attention then, for a caller that runs those two itself; else
        None (write() and attend() handle every other case)."""
        if self._decode is None:
            return None
        table = self._decode[self.cache.group_of_layer[layer]]
        write_slots, key_slots = table.at(self.cache.place_of_layer[layer])
        return self.cache.keys[layer], self.cache.values[layer], write_slots, key_slots, table.mask

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
        attend = attend_chunk_fused if fused else attend_chunk
        if fused and self.paged_decode:
            attend = attend_chunk_paged
        chunks = plan.chunks
        fresh = self._fresh.get(kv_layer) if fused else None

        def run(chunk: Chunk, rows: torch.Tensor) -> torch.Tensor:
            if fresh is not None and chunk.causal_fresh:
                return attend_fresh_causal(
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
