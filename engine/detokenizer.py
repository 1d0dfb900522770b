"""Turning a stream of sampled tokens into a stream of text, and deciding when to stop.

Per step the engine asks `check_stop` whether a token rule (EOS, stop token id, length) ends
the sequence with its newly sampled token, and hands both to the sequence's
`IncrementalDetokenizer.update`, which returns the text that became visible and the final
finish reason (a stop string may end the sequence even when no token rule did); the scheduler
then appends the token (Scheduler.update):

    step = detokenizer.update(token, check_stop(seq, token, eos_token_ids, max_model_len))

Streamed text never shows half a UTF-8 character, nor the start of a stop string that is
then matched; the concatenation of every step's text is the final output text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.request import FinishReason
from engine.request import Sequence as EngineSequence
from engine.sampling import SamplingParams

# Prompt tokens decoded in front of the output so that the first output tokens decode as they
# do inside the full text (SentencePiece drops or keeps a leading space depending on context).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Decoder(Protocol):
    """Any tokenizer with a `decode` like transformers' or the `tokenizers` library's
    (transformers' is typed for batches too, hence `list[str]`: one list of ids gives a str)."""

    def decode(self, ids: list[int], /, skip_special_tokens: bool = ...) -> str | list[str]: ...


def check_stop(
    seq: EngineSequence,
    new_token: int,
    eos_token_ids: Collection[int],
    max_model_len: int | None = None,
) -> FinishReason | None:
    """Whether `new_token`, sampled for seq and not yet appended to its output, ends it.

    STOP for an EOS token (unless ignore_eos) or a stop token id, but not while the output is
    within min_tokens (the sampler suppresses those tokens then); LENGTH once max_tokens tokens
    were generated or the sequence fills max_model_len. Stop strings are the detokenizer's.
    """
    params = seq.sampling
    num_output = seq.num_output_tokens + 1  # with new_token
    if num_output > params.min_tokens:
        if new_token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and new_token in eos_token_ids:
            return FinishReason.STOP
    if num_output >= params.max_tokens:
        return FinishReason.LENGTH
    if max_model_len is not None and seq.num_tokens + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


@dataclass
class DetokenizedStep:
    text: str  # text that became visible with this token (may be empty)
    finish_reason: FinishReason | None  # the token rule's reason, or STOP for a stop string
    stop_str: str | None = None  # the stop string that matched, if one did


class IncrementalDetokenizer:
    """The output text of one sequence, built one token at a time.

    Decoding uses the "prefix offset / read offset" window: each step decodes the few tokens
    since the last emitted text both with and without the new tokens and emits the difference,
    so context-dependent decoding (SentencePiece leading spaces, byte-level BPE) matches a
    decode of the whole sequence. Text ending in U+FFFD is an incomplete UTF-8 character and
    waits for the next token.

    Stop strings: the earliest-completing match wins (as if text arrived one character at a
    time); the output is cut where it starts, or where it ends with
    include_stop_str_in_output. A tail of the text that could begin a stop string is held
    back until it cannot, or until the sequence finishes. While fewer than min_tokens tokens
    were generated no stop string ends the sequence, and one completed then never does later
    (as vLLM does).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: context for decoding the unread tokens
        self._read_offset = len(self._tokens)  # tokens before this are in self._text
        self._text = ""  # decoded output text (complete characters), possibly cut at a stop
        self._emitted = 0  # characters of self._text already returned
        self._searched = 0  # length of the text already searched for stop strings
        self._num_output_tokens = 0
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self.finished = False
        self.stop_str: str | None = None

    @property
    def output_text(self) -> str:
        """The text returned so far."""
        return self._text[: self._emitted]

    def update(
        self,
        token_id: int,
        finish_reason: FinishReason | None = None,
        *,
        stop_token: bool = True,
    ) -> DetokenizedStep:
        """Add one generated token; `finish_reason` is what `check_stop` said about it.
        A STOP with `stop_token` false ends the text after this token (a grammar completed
        by it) instead of at a stop token whose text is left out."""
        if self.finished:
            raise RuntimeError("update() after the sequence finished")
        self._num_output_tokens += 1
        # A stop token's own text is left out unless the request asks for it.
        dropped = finish_reason is FinishReason.STOP and stop_token
        if not dropped or self._params.include_stop_str_in_output:
            self._tokens.append(token_id)
        self._decode_new_tokens(flush=finish_reason is not None)

        match = self._find_stop_string()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._params.include_stop_str_in_output else start
            self._text = self._text[:end]
            self.stop_str = stop
            finish_reason = FinishReason.STOP
        self.finished = finish_reason is not None
        visible = len(self._text) if self.finished else len(self._text) - self._stop_prefix_len()
        new_text = self._text[self._emitted : visible]
        self._emitted = max(self._emitted, visible)
        return DetokenizedStep(new_text, finish_reason, self.stop_str)

    def _decode(self, start: int, end: int | None = None) -> str:
        text = self._tokenizer.decode(
            self._tokens[start:end], skip_special_tokens=self._params.skip_special_tokens
        )
        assert isinstance(text, str)  # one list of ids decodes to one string
        return text

    def _decode_new_tokens(self, flush: bool) -> None:
        """Move the unread tokens' text into self._text once it ends in a whole character
        (or regardless, when flushing at the end)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text):
            return
        if full_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return
        self._text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)

    def _find_stop_string(self) -> tuple[int, str] | None:
        """(start, stop string) of the first stop string to complete in the new text; None
        while the output is within min_tokens."""
        if not self._max_stop_len:
            return None
        searched, self._searched = self._searched, len(self._text)
        if self._num_output_tokens < self._params.min_tokens:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._params.stop:
            start = self._text.find(stop, max(0, searched - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._params.stop:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
