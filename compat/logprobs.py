"""Engine token logprobs -> the two OpenAI logprobs shapes.

`token_text` turns one token id into its text (the caller's tokenizer, decoding that single
token); `token_bytes` into its own bytes (`piece_bytes` of its vocabulary piece), which differ
for a byte-fallback token: alone it decodes to U+FFFD, but its bytes join with its neighbours'
into the character. A stream builds one piece per chunk, with each token's text offset.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from compat.response_types import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from engine.request import TokenLogprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
_SPACE_MARK = "\u2581"  # SentencePiece's "▁" for a space


def piece_bytes(piece: str) -> bytes:
    """The bytes a vocabulary piece stands for: one byte for a byte-fallback piece such as
    `<0xF0>`, else the piece's text with "▁" as a space, UTF-8 encoded."""
    if match := _BYTE_PIECE.fullmatch(piece):
        return bytes([int(match[1], 16)])
    return piece.replace(_SPACE_MARK, " ").encode()


def chat_logprobs(
    entries: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], bytes],
) -> ChatLogprobs:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}."""
    content = []
    for entry in entries:
        top = [
            TopLogprob(token=token_text(t), logprob=lp, bytes=list(token_bytes(t)))
            for t, lp in entry.top
        ]
        token, raw = token_text(entry.token_id), list(token_bytes(entry.token_id))
        content.append(ChatTokenLogprob(token, entry.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_text: Callable[[int], str], text_offsets: Sequence[int]
) -> CompletionLogprobs:
    """The legacy shape: parallel lists of tokens, their logprobs, a {token: logprob} map of the
    alternatives (always including the sampled token, as OpenAI does), and each token's
    character offset in the choice text (`text_offsets`, one per entry)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry, offset in zip(entries, text_offsets, strict=True):
        text = token_text(entry.token_id)
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
    return out
