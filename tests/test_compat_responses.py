"""Responses, stream chunks and logprobs: exact JSON, and valid against the OpenAI spec."""

from __future__ import annotations

import json

import msgspec
import pytest

from compat.logprobs import chat_logprobs, completion_logprobs
from compat.response_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    DetokenizeResponse,
    Model,
    ModelList,
    TokenizeResponse,
    make_usage,
    new_chat_completion_id,
    new_completion_id,
)
from compat.sse import SSE_DONE, sse_event
from engine.request import TokenLogprob
from tests.openapi_schema import COMPLETION_CHUNK, errors, validate

VOCAB = {0: "Hel", 1: "lo", 2: "é", 3: " world"}
VOCAB_BYTES = {token_id: text.encode() for token_id, text in VOCAB.items()}
ENTRIES = [
    TokenLogprob(token_id=0, logprob=-0.5, top=[(0, -0.5), (3, -1.25)]),
    TokenLogprob(token_id=2, logprob=-2.0, top=[(1, -0.25)]),
]


def as_json(struct) -> dict:
    return json.loads(msgspec.json.encode(struct))


def test_ids():
    assert new_completion_id().startswith("cmpl-") and len(new_completion_id()) == 29
    assert new_chat_completion_id().startswith("chatcmpl-")
    assert new_chat_completion_id() != new_chat_completion_id()


def test_usage_exact():
    assert as_json(make_usage(5, 7, cached_tokens=4)) == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    validate(as_json(make_usage(1, 2)), "CompletionUsage")


def test_chat_completion_exact_json_and_schema():
    response = ChatCompletion(
        id="chatcmpl-1",
        created=1700000000,
        model="gemma-3-270m",
        choices=[
            ChatChoice(index=0, message=ChatResponseMessage(content="Hello"), finish_reason="stop"),
            ChatChoice(
                index=1,
                message=ChatResponseMessage(content="Hel"),
                logprobs=chat_logprobs(ENTRIES[:1], VOCAB.__getitem__, VOCAB_BYTES.__getitem__),
                finish_reason="length",
            ),
        ],
        usage=make_usage(10, 2, 8),
    )
    body = as_json(response)
    assert body["object"] == "chat.completion"
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hello", "refusal": None},
        "logprobs": None,
        "finish_reason": "stop",
    }
    validate(body, "CreateChatCompletionResponse")


def test_chat_stream_chunks_validate():
    def chunk(choices, **kw):
        return ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=choices, **kw)

    first = chunk(
        [ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))], usage=None
    )
    middle = chunk(
        [
            ChatChunkChoice(
                index=0,
                delta=ChatDelta(content="Hel"),
                logprobs=chat_logprobs(ENTRIES[:1], VOCAB.__getitem__, VOCAB_BYTES.__getitem__),
            )
        ]
    )
    last = chunk([ChatChunkChoice(index=0, delta=ChatDelta(), finish_reason="stop")], usage=None)
    usage = chunk([], usage=make_usage(3, 2))
    assert as_json(first) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    }
    assert "usage" not in as_json(middle)  # absent unless stream_options.include_usage
    assert as_json(last)["choices"][0]["delta"] == {}
    assert as_json(usage)["choices"] == [] and as_json(usage)["usage"]["total_tokens"] == 5
    for c in (first, middle, last, usage):
        validate(as_json(c), "CreateChatCompletionStreamResponse")


def test_completion_and_its_chunks_validate():
    logprobs = completion_logprobs(ENTRIES, VOCAB.__getitem__, [0, 3])
    full = Completion(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChoice(index=0, text="Helé", logprobs=logprobs, finish_reason="length")],
        usage=make_usage(4, 2),
    )
    body = as_json(full)
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["object"] == "text_completion"
    validate(body, "CreateCompletionResponse")

    chunk = Completion(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text="He")]
    )
    assert as_json(chunk)["choices"] == [
        {"index": 0, "text": "He", "logprobs": None, "finish_reason": None}
    ]
    validate(as_json(chunk), COMPLETION_CHUNK)
    # The spec's completion shape has a non-nullable finish_reason: exactly that is relaxed.
    assert errors(as_json(chunk), "CreateCompletionResponse") == [
        "choices/0/finish_reason: None is not of type 'string'",
        "choices/0/finish_reason: None is not one of ['stop', 'length', 'content_filter']",
    ]
    usage_chunk = Completion(id="cmpl-1", created=1, model="m", choices=[], usage=make_usage(1, 1))
    validate(as_json(usage_chunk), COMPLETION_CHUNK)


def test_chat_logprobs_exact():
    assert as_json(chat_logprobs(ENTRIES, VOCAB.__getitem__, VOCAB_BYTES.__getitem__)) == {
        "content": [
            {
                "token": "Hel",
                "logprob": -0.5,
                "bytes": [72, 101, 108],
                "top_logprobs": [
                    {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                    {"token": " world", "logprob": -1.25, "bytes": [32, 119, 111, 114, 108, 100]},
                ],
            },
            {
                "token": "é",
                "logprob": -2.0,
                "bytes": [195, 169],
                "top_logprobs": [{"token": "lo", "logprob": -0.25, "bytes": [108, 111]}],
            },
        ],
        "refusal": None,
    }


def test_completion_logprobs_exact_with_offset():
    assert as_json(completion_logprobs(ENTRIES, VOCAB.__getitem__, [10, 13])) == {
        "tokens": ["Hel", "é"],
        "token_logprobs": [-0.5, -2.0],
        # The sampled token is always among the alternatives.
        "top_logprobs": [{"Hel": -0.5, " world": -1.25}, {"lo": -0.25, "é": -2.0}],
        "text_offset": [10, 13],
    }


def test_models_list():
    models = ModelList(
        data=[Model(id="gemma-3-270m", created=1, owned_by="gemma-serve", max_model_len=32768)]
    )
    body = as_json(models)
    assert body == {
        "object": "list",
        "data": [
            {
                "id": "gemma-3-270m",
                "object": "model",
                "created": 1,
                "owned_by": "gemma-serve",
                "max_model_len": 32768,
            }
        ],
    }
    validate(body, "ListModelsResponse")
    validate(body["data"][0], "Model")


def test_tokenize_responses():
    assert as_json(TokenizeResponse(count=2, max_model_len=8, tokens=[2, 5])) == {
        "count": 2,
        "max_model_len": 8,
        "tokens": [2, 5],
    }
    assert as_json(TokenizeResponse(count=1, max_model_len=8, tokens=[2], token_strs=["<bos>"]))[
        "token_strs"
    ] == ["<bos>"]
    assert as_json(DetokenizeResponse(prompt="hi")) == {"prompt": "hi"}


def test_sse_framing():
    chunk = Completion(id="c", created=1, model="m", choices=[])
    assert sse_event(chunk) == (
        b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[]}\n\n'
    )
    assert sse_event({"error": {"message": "x"}}) == b'data: {"error":{"message":"x"}}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_schema_helper_catches_wrong_shapes():
    with pytest.raises(Exception, match="'object'"):
        validate(
            {"id": "x", "created": 1, "model": "m", "choices": []}, "CreateChatCompletionResponse"
        )
    with pytest.raises(KeyError):
        validate({}, "NoSuchSchema")
