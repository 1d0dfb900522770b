"""Steps 1-4 of sampling (engine.sampler's module docstring) on a batch of logits: logit bias,
the repetition penalty (CTRL paper, Keskar et al. 2019), frequency and presence penalties
(OpenAI's semantics), and the min_tokens ban on stop tokens."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

import torch

from engine.sampling import GREEDY_TEMPERATURE, SamplingParams

# The largest logit a penalty may leave: dividing it by any sampled temperature stays finite
# (an infinite logit would make the softmax NaN).
LOGIT_LIMIT = torch.finfo(torch.float32).max * GREEDY_TEMPERATURE


class LogitsRow(Protocol):
    """What steps 1-4 read of a row (engine.sampler.SamplingRow has it)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    step: int  # tokens already generated


def index_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """`values` as a long tensor, to index rows or tokens with."""
    return torch.tensor(list(values), dtype=torch.long, device=device)


def adjust_logits(
    logits: torch.Tensor, rows: Sequence[LogitsRow], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """Steps 1-4 on a copy of `logits` ([rows, vocab]); `logits` itself when no row needs them."""
    vocab = logits.shape[1]
    bias: list[tuple[int, int, float]] = []
    banned: list[tuple[int, int]] = []
    repetition: list[tuple[int, list[int], float]] = []
    frequency_presence: list[tuple[int, Sequence[int], float, float]] = []
    for i, row in enumerate(rows):
        p = row.params
        # Ids outside the vocabulary are ignored rather than failing the whole batch.
        bias.extend((i, t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab)
        if row.step < p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(eos_token_ids)
            banned.extend((i, t) for t in stop_ids if 0 <= t < vocab)
        if p.repetition_penalty != 1.0:
            seen = [*row.prompt_token_ids, *row.output_token_ids]
            repetition.append((i, seen, p.repetition_penalty))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            frequency_presence.append(
                (i, row.output_token_ids, p.frequency_penalty, p.presence_penalty)
            )
    if not (bias or banned or repetition or frequency_presence):
        return logits

    out = logits.clone()
    device = logits.device
    if bias:
        b_rows, b_cols, b_vals = zip(*bias, strict=True)
        out.index_put_(
            (index_tensor(b_rows, device), index_tensor(b_cols, device)),
            torch.tensor(b_vals, dtype=out.dtype, device=device),
            accumulate=True,
        )
    if repetition:
        apply_repetition_penalty(out, repetition)
    if frequency_presence:
        apply_frequency_presence(out, frequency_presence)
    if banned:
        ban_rows, ban_cols = zip(*banned, strict=True)
        out[index_tensor(ban_rows, device), index_tensor(ban_cols, device)] = float("-inf")
    return out


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
    return index_tensor(row_ids, device), index_tensor(token_ids, device)


def apply_repetition_penalty(
    out: torch.Tensor, rows: Sequence[tuple[int, Sequence[int], float]]
) -> None:
    """In place, per (row, tokens seen in prompt and output, penalty): each seen token's
    positive logit divided by the penalty, a negative one multiplied by it (CTRL)."""
    r, t = _token_positions([(i, seen) for i, seen, _ in rows], out.shape[1], out.device)
    penalty = torch.zeros(out.shape[0], dtype=out.dtype, device=out.device)
    penalty[index_tensor([i for i, _, _ in rows], out.device)] = torch.tensor(
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
    index = index_tensor([i for i, _, _, _ in rows], out.device)
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
