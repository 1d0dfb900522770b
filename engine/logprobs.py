"""Logprobs as the API reports them: a chosen token's log-probability, its rank and the most
likely alternatives, from a row of log-softmax (engine.sampler for sampled tokens,
engine.prompt_logprobs for a prompt's own)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.logits_processors import index_tensor
from engine.request import TokenLogprob


def sampled_logprobs(
    logits: torch.Tensor, tops: Sequence[int | None], token_ids: torch.Tensor
) -> list[TokenLogprob | None]:
    """Per row of `logits` (raw, [rows, vocab]): the logprob of `token_ids[row]` with the row's
    `tops[row]` alternatives, or None where `tops[row]` is None (the row asked for none)."""
    wanted = [i for i, top in enumerate(tops) if top is not None]
    result: list[TokenLogprob | None] = [None] * len(tops)
    if not wanted:
        return result
    index = index_tensor(wanted, logits.device)
    entries = token_logprobs(
        torch.log_softmax(logits[index], dim=-1), token_ids[index], [tops[i] or 0 for i in wanted]
    )
    for i, entry in zip(wanted, entries, strict=True):
        result[i] = entry
    return result


def token_logprobs(
    logprobs: torch.Tensor, targets: torch.Tensor, top: Sequence[int], *, rank: bool = False
) -> list[TokenLogprob]:
    """Per row of `logprobs` ([R, vocab] log-softmax): the logprob of `targets[row]`, the
    row's `top[row]` most likely tokens and, with `rank`, the target's rank (1: the most
    likely; a pass over the vocabulary, so only where asked)."""
    chosen = logprobs.gather(1, targets.to(logprobs.device)[:, None])
    values = chosen.squeeze(1).tolist()
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist() if rank else [None] * len(values)
    most = max(top, default=0)
    best_ids: list[list[int]] = [[] for _ in values]
    best_values: list[list[float]] = [[] for _ in values]
    if most:
        best = logprobs.topk(most, dim=-1)
        best_ids, best_values = best.indices.tolist(), best.values.tolist()
    target_ids = targets.tolist()
    return [
        TokenLogprob(
            token_id=target_ids[j],
            logprob=values[j],
            top=list(zip(best_ids[j][:k], best_values[j][:k], strict=True)),
            rank=ranks[j],
        )
        for j, k in enumerate(top)
    ]
