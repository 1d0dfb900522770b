"""Logprobs of a prompt's own tokens: what an eval harness scores a continuation by.

The logits at position p predict token p + 1, so a prompt of P tokens has P - 1 scored tokens
(the first has no context and no logprob). A prefill chunk [start, start + count) scores the
tokens its positions predict that lie in the prompt and were not scored before (a sequence
recomputed after preemption does not score them twice).

A chunk's logits would take chunk x vocabulary floats; `reduce_prompt_logprobs` makes them
SLICE_ROWS rows at a time from the chunk's final hidden states and keeps, per row, only the
target token's logprob, its rank and the top alternatives. Every slice is a full SLICE_ROWS
rows (a short one is padded with copies of its last row): a CPU GEMM may round a row
differently when it has only a few rows beside it (seen below 16 rows), and transformers
makes a whole prompt's logits in one GEMM, so a fixed, large row count keeps NUMERICS=exact's
prompt logprobs equal to its log-softmax; the fast kernels see one shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.logprobs import token_logprobs
from engine.request import Sequence, TokenLogprob

# Rows of logits made at once: 32 rows of a 262,144-token vocabulary are 32 MiB in float32.
SLICE_ROWS = 32


def positions_to_score(seq: Sequence, start: int, count: int) -> range:
    """The positions of the chunk [start, start + count) whose logits score a prompt token
    that seq wants scored and has not been scored yet; empty when it wants none."""
    if seq.sampling.prompt_logprobs is None:
        return range(0)
    first = max(start, len(seq.prompt_logprobs))
    return range(first, min(start + count, seq.num_prompt_tokens - 1))


def reduce_prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    top: list[int],
) -> list[TokenLogprob]:
    """Per row of `hidden` ([R, H] final hidden states): the log-softmax of its logits
    (`logits_of`, [r, H] -> [r, vocab] float32) at `targets[row]`, that token's rank (1 for
    the most likely) and the row's `top[row]` most likely tokens."""
    out: list[TokenLogprob] = []
    for begin in range(0, hidden.shape[0], SLICE_ROWS):
        end = min(begin + SLICE_ROWS, hidden.shape[0])
        rows = hidden[begin:end]
        if end - begin < SLICE_ROWS:
            rows = torch.cat([rows, rows[-1:].expand(SLICE_ROWS - (end - begin), -1)])
        logprobs = torch.log_softmax(logits_of(rows)[: end - begin], dim=-1)
        out += token_logprobs(logprobs, targets[begin:end], top[begin:end], rank=True)
    return out
