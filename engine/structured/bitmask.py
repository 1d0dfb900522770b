"""Token bitmasks: one bit per vocabulary entry, 32 to an int32 word (bit j of word i is token
32 * i + j), the layout llguidance and xgrammar both fill; 1 = the token is allowed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask covering `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def set_bits(row: np.ndarray, token_ids: Sequence[int], allowed: bool) -> None:
    """Allow (or forbid) `token_ids` in one bitmask row (a numpy int32 view)."""
    words = row.view(np.uint32)
    for token in token_ids:
        word, bit = divmod(token, 32)
        if word < words.shape[0]:
            if allowed:
                words[word] |= np.uint32(1 << bit)
            else:
                words[word] &= np.uint32(~(1 << bit) & 0xFFFFFFFF)


def allowed_tokens(row: torch.Tensor, vocab: int, limit: int) -> torch.Tensor | None:
    """The token ids (ascending, int64) one CPU bitmask row allows among the first `vocab`,
    or None when they may be more than `limit`. Reads only the nonzero words, so a row that
    allows a few tokens costs microseconds whatever the vocabulary."""
    words = row.numpy().view(np.uint32)
    nonzero = np.flatnonzero(words)
    if len(nonzero) * 32 > limit:
        return None
    bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32)
    word, bit = np.nonzero(bits)
    ids = nonzero[word].astype(np.int64) * 32 + bit
    return torch.from_numpy(ids[ids < vocab])


def apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, every logit of row rows[j] whose bit in bitmask[j] is 0.

    `bitmask` is a CPU int32 [>= len(rows), words] tensor with words * 32 >= the vocabulary.
    On the CPU the bits are unpacked with numpy (0.25 ms for 16 rows of 262,144) and written
    with masked_fill_, one call per row, or one for the whole tensor when every row is masked:
    about 0.25 ms a row of 262,144 float32 logits, memory-bound (xgrammar's CPU kernel took
    1 ms a row, evals/bench_grammar.py). Rows not named are not touched.
    """
    if not rows:
        return
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover {vocab} tokens")
    words = bitmask[: len(rows)]
    if logits.device.type == "cpu":
        disallowed = _disallowed_numpy(words, vocab)
    else:
        disallowed = _disallowed_torch(words.to(logits.device), vocab)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        logits.masked_fill_(disallowed, float("-inf"))
        return
    for j, i in enumerate(rows):
        logits[i].masked_fill_(disallowed[j], float("-inf"))


def _disallowed_numpy(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, True where the (CPU) bitmask's bit is 0."""
    inverted = np.bitwise_not(words.numpy()).view(np.uint8)
    unpacked = np.unpackbits(inverted, axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(unpacked).view(torch.bool)


def _disallowed_torch(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """_disallowed_numpy with tensor operations, on the words' device (a GPU's)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift; the & 1 keeps one bit
    return (bits == 0).view(words.shape[0], -1)[:, :vocab]
