"""Engine token logprobs -> the two OpenAI logprobs shapes.

`token_text` turns one token id into its text (the caller's tokenizer, decoding that single
token). A stream builds one piece per chunk; pass the running text offset to continue it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from compat.response_types import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from engine.request import TokenLogprob


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(
    entries: Sequence[TokenLogprob], token_text: Callable[[int], str]
) -> ChatLogprobs:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}."""
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        top = [
            TopLogprob(token=token_text(t), logprob=lp, bytes=_utf8(token_text(t)))
            for t, lp in entry.top
        ]
        content.append(
            ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=_utf8(text), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_text: Callable[[int], str], text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy shape: parallel lists of tokens, their logprobs, a {token: logprob} map of the
    alternatives (always including the sampled token, as OpenAI does), and each token's
    character offset in the choice text, starting at `text_offset`."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = text_offset
    for entry in entries:
        text = token_text(entry.token_id)
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out
