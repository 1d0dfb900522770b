"""The sampler's penalties on a batch of logits: repetition (CTRL paper, Keskar et al. 2019),
and frequency and presence (OpenAI's semantics)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.sampling import GREEDY_TEMPERATURE

# The largest logit a penalty may leave: dividing it by any sampled temperature stays finite
# (an infinite logit would make the softmax NaN).
LOGIT_LIMIT = torch.finfo(torch.float32).max * GREEDY_TEMPERATURE


def _index(values: Iterable[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def _token_positions(
    rows: Sequence[tuple[int, Sequence[int]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of every in-vocabulary token of every row."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, tokens in rows:
        kept = [t for t in tokens if 0 <= t < vocab]
        row_ids.extend([i] * len(kept))
        token_ids.extend(kept)
    return _index(row_ids, device), _index(token_ids, device)


def apply_repetition_penalty(
    out: torch.Tensor, rows: Sequence[tuple[int, Sequence[int], float]]
) -> None:
    """In place, per (row, tokens seen in prompt and output, penalty): each seen token's
    positive logit divided by the penalty, a negative one multiplied by it (CTRL)."""
    r, t = _token_positions([(i, seen) for i, seen, _ in rows], out.shape[1], out.device)
    penalty = torch.zeros(out.shape[0], dtype=out.dtype, device=out.device)
    penalty[_index([i for i, _, _ in rows], out.device)] = torch.tensor(
        [value for _, _, value in rows], dtype=out.dtype, device=out.device
    )
    seen = out[r, t]
    # A token repeated in the history appears several times in (r, t); every copy is
    # computed from the original logit, so the repeated writes agree.
    penalized = torch.where(seen > 0, seen / penalty[r], seen * penalty[r])
    out[r, t] = penalized.clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)  # a penalty near 0 overflows


def apply_frequency_presence(
    out: torch.Tensor, rows: Sequence[tuple[int, Sequence[int], float, float]]
) -> None:
    """In place, per (row, output tokens, frequency penalty, presence penalty): each token's
    logit less frequency * its count and presence once (OpenAI's semantics)."""
    vocab = out.shape[1]
    r, t = _token_positions([(i, output) for i, output, _, _ in rows], vocab, out.device)
    if r.numel() == 0:
        return
    frequency = torch.zeros(out.shape[0], dtype=out.dtype, device=out.device)
    presence = torch.zeros_like(frequency)
    index = _index([i for i, _, _, _ in rows], out.device)
    frequency[index] = torch.tensor(
        [value for _, _, value, _ in rows], dtype=out.dtype, device=out.device
    )
    presence[index] = torch.tensor(
        [value for _, _, _, value in rows], dtype=out.dtype, device=out.device
    )
    out.index_put_((r, t), -frequency[r], accumulate=True)  # once per occurrence
    distinct = torch.unique(r * vocab + t)
    ur, ut = distinct // vocab, distinct % vocab
    out.index_put_((ur, ut), -presence[ur], accumulate=True)  # once per distinct token
