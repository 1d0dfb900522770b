"""Attention over one chunk of a step's plan (engine.model.attention_plan): explicit softmax in
transformers' order of operations, PyTorch's fused scaled_dot_product_attention, or cpu_ops'
paged decode kernel reading K/V in place from the pools."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import cpu_ops
from engine.model.attention_plan import Chunk

# Prefill queries are attended in slices so one slice's score matrix stays under this many
# elements (a long prompt against a long cache would otherwise need gigabytes at once).
MAX_SCORES_PER_SLICE = 1 << 25


def gather_keys_values(
    chunk: Chunk, key_pool: torch.Tensor, value_pool: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's keys and values from the pools, as [num_seqs, num_kv_heads, num_keys, D]."""
    b, k_len, num_kv_heads = chunk.num_seqs, chunk.num_keys, key_pool.shape[1]
    keys = key_pool.index_select(0, chunk.key_slots).view(b, k_len, num_kv_heads, -1)
    values = value_pool.index_select(0, chunk.key_slots).view(b, k_len, num_kv_heads, -1)
    return keys.transpose(1, 2), values.transpose(1, 2)


def attend_chunk_paged(
    chunk: Chunk,
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
) -> torch.Tensor:
    """attend_chunk_fused with a decode chunk read in place from the pools (no gather)."""
    if chunk.q_len != 1:
        return attend_chunk_fused(chunk, query, key_pool, value_pool, scaling, softcap, mass)
    return cpu_ops.paged_decode_attention(
        query, key_pool, value_pool, chunk.key_slots, chunk.mask, scaling
    )


def attend_fresh_causal(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """A fresh prompt's chunk ([T, H, D] queries over its own [T, Hkv, D] keys and values, in
    the cache's dtype): causal attention with no mask to build or read and no gather, and the
    fused kernel skips the blocks above the diagonal. Otherwise as attend_chunk_fused."""
    k, v = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    return one_sequence_sdpa(query, k, v, scaling, mask=None)


def one_sequence_sdpa(
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


def attend_chunk_fused(
    chunk: Chunk,
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
) -> torch.Tensor:
    """attend_chunk through scaled_dot_product_attention (no softcap, no mass). With a cache
    in another dtype than the queries (KV_CACHE_DTYPE), the queries are rounded to the cache's
    dtype and the fused kernel runs in it (it sums in float32), so the gathered keys and
    values are read at their own size; the output comes back in the cache's dtype (the caller
    casts it where it needs another)."""
    num_heads, num_kv_heads = query.shape[1], key_pool.shape[1]
    keys, values = gather_keys_values(chunk, key_pool, value_pool)
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
        return one_sequence_sdpa(query, keys, values, scaling, mask)
    out = query.new_empty(query.shape[0], num_heads, values.shape[-1], dtype=keys.dtype)
    for start, end, first, last in chunk.query_blocks:
        out[start:end] = one_sequence_sdpa(
            query[start:end],
            keys[:, :, first:last],
            values[:, :, first:last],
            scaling,
            mask[:, :, start:end, first:last],
        )
    return out


def attend_chunk(
    chunk: Chunk,
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
    keys, values = gather_keys_values(chunk, key_pool, value_pool)
    keys, values = keys.to(query.dtype), values.to(query.dtype)  # a KV_CACHE_DTYPE cache
    if q_len == 1:
        # Decode: the query heads sharing a KV head become the rows of one matmul.
        q = query.reshape(b, num_kv_heads, groups, head_dim)
        out = softmax_attention(q, keys, values, chunk.mask, scaling, softcap, mass, chunk)
        return out.view(b, num_heads, -1)
    q = query.transpose(0, 1).unsqueeze(0)
    keys, values = repeat_heads(keys, groups), repeat_heads(values, groups)
    rows_per_slice = max(1, MAX_SCORES_PER_SLICE // (num_heads * k_len))
    pieces = [
        softmax_attention(
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


def softmax_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
    mass: torch.Tensor | None,
    chunk: Chunk,
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


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, K, D] -> [B, Hkv * groups, K, D], each KV head repeated for its query heads."""
    if groups == 1:
        return x
    b, h, k, d = x.shape
    return x[:, :, None].expand(b, h, groups, k, d).reshape(b, h * groups, k, d)
