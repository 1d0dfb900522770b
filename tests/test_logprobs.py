"""Logprobs over byte-fallback tokens, with the embedded Gemma tokenizer: chat `bytes` join into
the text, and legacy `text_offset`s stay inside the text, the same streamed or not."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from compat.logprobs import chat_logprobs, completion_logprobs, piece_bytes
from engine.detokenizer import IncrementalDetokenizer
from engine.events import ChoiceTracker, TextDelta, fold
from engine.request import FinishReason, StepOutput, TokenLogprob
from engine.sampling import SamplingParams
from tests.conftest import RunningServer
from tests.gateway_helpers import chat_body, completion_body, sse_chunks

ASTRAL = "𠜎"  # one character, four byte-fallback tokens


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.model.loader import embedded_checkpoint_dir

    return AutoTokenizer.from_pretrained(embedded_checkpoint_dir())


def text_of(tokenizer) -> Callable[[int], str]:
    return lambda token_id: tokenizer.decode([token_id])


def bytes_of(tokenizer) -> Callable[[int], bytes]:
    return lambda token_id: piece_bytes(tokenizer.convert_ids_to_tokens(token_id))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "piece, expected",
    [
        ("<0xF0>", b"\xf0"),
        ("<0x0A>", b"\n"),
        ("▁h", b" h"),
        ("▁▁", b"  "),
        ("él", "él".encode()),
        ("<end_of_turn>", b"<end_of_turn>"),
        ("<0xF0", b"<0xF0"),  # not a byte piece
    ],
)
def test_piece_bytes(piece: str, expected: bytes) -> None:
    assert piece_bytes(piece) == expected


def test_chat_bytes_join_into_the_text(tokenizer) -> None:
    text = f" {ASTRAL} {ASTRAL} héllo  world,\n你好🙂"
    ids = encode(tokenizer, text)
    entries = [TokenLogprob(t, -1.0, top=[(t, -1.0)]) for t in ids]
    content = chat_logprobs(entries, text_of(tokenizer), bytes_of(tokenizer)).content
    assert content is not None
    assert b"".join(bytes(c.bytes or []) for c in content).decode() == text
    assert [c.top_logprobs[0].bytes for c in content] == [c.bytes for c in content]
    # The byte-fallback tokens: their own byte each, while the token string stays the decode.
    assert [(c.token, c.bytes) for c in content[1:5]] == [
        ("\ufffd", [0xF0]), ("\ufffd", [0xA0]), ("\ufffd", [0x9C]), ("\ufffd", [0x8E]),
    ]  # fmt: skip


def detokenized_steps(tokenizer, output: list[int], **params) -> list[StepOutput]:
    """What the engine emits for `output`, one token a step, ending at its last token."""
    sampling = SamplingParams(max_tokens=len(output), **params)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say:"), sampling)
    steps = []
    for i, token in enumerate(output):
        step = detok.update(token, FinishReason.LENGTH if i == len(output) - 1 else None)
        steps.append(
            StepOutput(
                "r",
                [token],
                step.text,
                logprobs=[TokenLogprob(token, -1.0)],
                finished=step.finish_reason is not None,
                finish_reason=step.finish_reason,
            )
        )
        if step.finish_reason is not None:
            break
    return steps


def offsets_whole_and_streamed(
    tokenizer, steps: list[StepOutput]
) -> tuple[str, list[int], list[int]]:
    """(choice text, text_offset of the whole response, text_offset joined from a stream)."""
    tracker = ChoiceTracker(0)
    events = [event for out in steps for event in tracker.events(out)]
    chunk_offsets = []
    for event in events:
        if isinstance(event, TextDelta):
            chunk = completion_logprobs(event.logprobs, text_of(tokenizer), event.text_offsets)
            chunk_offsets += chunk.text_offset
    [whole] = fold(events, 1).choices
    response = completion_logprobs(whole.logprobs, text_of(tokenizer), whole.text_offsets)
    return whole.text, response.text_offset, chunk_offsets


def test_text_offsets_over_byte_tokens(tokenizer) -> None:
    # ' 𠜎 𠜎 ' and the first byte of a third: the request of the bug report.
    output = encode(tokenizer, f" {ASTRAL} {ASTRAL} {ASTRAL}")[:12]
    text, whole, streamed = offsets_whole_and_streamed(
        tokenizer, detokenized_steps(tokenizer, output)
    )
    assert text == f" {ASTRAL} {ASTRAL} \ufffd"
    assert whole == streamed == [0, 1, 1, 1, 1, 2, 3, 3, 3, 3, 4, 5]


def test_text_offsets_stay_in_a_text_cut_at_a_stop_string(tokenizer) -> None:
    output = encode(tokenizer, f" {ASTRAL} done. STOP here")
    steps = detokenized_steps(tokenizer, output, stop=[". STOP"])
    text, whole, streamed = offsets_whole_and_streamed(tokenizer, steps)
    assert text == f" {ASTRAL} done"
    assert whole == streamed == sorted(whole)
    assert max(whole) <= len(text)


# ------------------------------------------------------------------ through a real server


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    response = httpx.post(server.v1 + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response


def test_server_chat_bytes_join_into_the_content(server: RunningServer) -> None:
    body = chat_body(
        "Repeat: " + " ".join([ASTRAL] * 8), max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    choice = post(server, "/chat/completions", body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["finish_reason"] == "length"  # no end-of-turn token among the content
    assert [0xF0] in [c["bytes"] for c in content]  # a byte-fallback token came out
    joined = bytes(b for c in content for b in c["bytes"])
    assert joined.decode() == choice["message"]["content"]
    for c in content:  # greedy: the sampled token is the first alternative, bytes and all
        assert c["top_logprobs"][0]["bytes"] == c["bytes"]


def test_server_text_offsets_agree_streamed_or_not(server: RunningServer) -> None:
    prompt = " ".join([ASTRAL] * 10)
    body = completion_body(prompt, max_tokens=12, temperature=0, logprobs=1)
    choice = post(server, "/completions", body).json()["choices"][0]
    chunks = sse_chunks(post(server, "/completions", body | {"stream": True}).content)
    streamed_text = "".join(c["choices"][0]["text"] for c in chunks)
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    streamed_offsets = [offset for piece in pieces for offset in piece["text_offset"]]
    text, logprobs = choice["text"], choice["logprobs"]
    assert streamed_text == text
    assert streamed_offsets == logprobs["text_offset"]
    offsets = logprobs["text_offset"]
    assert len(offsets) == 12 and offsets == sorted(offsets)
    assert offsets[0] == 0 and offsets[-1] <= len(text)
    assert "\ufffd" in logprobs["tokens"]  # byte-fallback tokens came out
    for token, offset in zip(logprobs["tokens"], offsets, strict=True):
        if token != "\ufffd":  # a whole token's text is where its offset says
            assert text.startswith(token, offset), (token, offset, text)
