"""Engine token logprobs -> the two OpenAI logprobs shapes.

`token_text` turns one token id into its text (the caller's tokenizer, decoding that single
token); `token_bytes` into its own bytes (`piece_bytes` of its vocabulary piece), which differ
for a byte-fallback token: alone it decodes to U+FFFD, but its bytes join with its neighbours'
into the character. A stream builds one piece per chunk, with each token's text offset.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from compat.response_types import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from engine.events import PromptScored
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


def echo_logprobs(
    scored: PromptScored, token_text: Callable[[int], str], text_offsets: Sequence[int]
) -> CompletionLogprobs:
    """The legacy shape for an echoed prompt: every prompt token, the first with null for its
    logprob and alternatives; `text_offsets` gives each token's offset in the echo."""
    first = token_text(scored.token_ids[0]) if scored.token_ids else None
    rest = completion_logprobs(scored.entries, token_text, text_offsets[1:])
    if first is None:
        return rest
    return CompletionLogprobs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[text_offsets[0], *rest.text_offset],
    )


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """One legacy logprobs list after another (an echo's, then the generated text's)."""
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def shifted(logprobs: CompletionLogprobs, by: int) -> CompletionLogprobs:
    """The same logprobs with every text offset moved `by` characters (past an echo)."""
    if not by:
        return logprobs
    offsets = [offset + by for offset in logprobs.text_offset]
    return CompletionLogprobs(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, offsets
    )


def prompt_logprobs(scored: PromptScored, token_text: Callable[[int], str]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: null for the first position, then per position the prompt's
    own token and the most likely ones, each with its logprob, rank and text."""
    out: PromptLogprobs = [None] if scored.token_ids else []
    for entry in scored.entries:
        position = {
            str(token): PromptLogprob(logprob=lp, rank=rank, decoded_token=token_text(token))
            for rank, (token, lp) in enumerate(entry.top, start=1)
        }
        position.setdefault(
            str(entry.token_id),
            PromptLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(entry.token_id)
            ),
        )
        out.append(position)
    return out
