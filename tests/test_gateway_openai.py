"""The official `openai` client, sync and async, against a real server (the session `server`).

Every response is also checked against the official OpenAPI component schemas. Greedy or
seeded sampling keeps the expected values exact; `ignore_eos` fixes the completion length.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest

from tests.conftest import MODEL_ID, RunningServer
from tests.openapi_schema import COMPLETION_CHUNK, validate

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colors."}]
FIXED_LENGTH = {"ignore_eos": True}  # vLLM's extension: exactly max_tokens tokens


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture
async def aclient(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=server.v1, api_key="unused", max_retries=0, timeout=300
    ) as c:
        yield c


def prompt_tokens(server: RunningServer, **body: object) -> int:
    response = httpx.post(server.base_url + "/tokenize", json=body, timeout=30)
    assert response.status_code == 200
    return response.json()["count"]


# ------------------------------------------------------------------ models


def test_models_list_and_retrieve(client: openai.OpenAI, server: RunningServer) -> None:
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    model = client.models.retrieve(MODEL_ID)
    assert (model.id, model.object) == (MODEL_ID, "model")
    raw = httpx.get(server.v1 + "/models", timeout=30).json()
    validate(raw, "ListModelsResponse")
    validate(raw["data"][0], "Model")


# ------------------------------------------------------------------ completions


def test_completion(client: openai.OpenAI, server: RunningServer) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=FIXED_LENGTH
    )
    validate(raw.http_response.json(), "CreateCompletionResponse")
    completion = raw.parse()
    assert completion.object == "text_completion" and completion.model == MODEL_ID
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    usage = completion.usage
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens == prompt_tokens(server, prompt=PROMPT)
    assert usage.total_tokens == usage.prompt_tokens + 6


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    args = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=FIXED_LENGTH)
    full = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    for chunk in chunks:
        validate(chunk.to_dict(), COMPLETION_CHUNK)
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == full.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_completion_stop_string(client: openai.OpenAI) -> None:
    args = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0)
    text = client.completions.create(**args, extra_body=FIXED_LENGTH).choices[0].text
    stop = text.strip()[len(text.strip()) // 2 :][:3]  # three characters from the middle
    assert stop.strip(), f"no usable stop string in {text!r}"
    stopped = client.completions.create(
        **args, stop=[stop, "never-generated-xyz"], extra_body=FIXED_LENGTH
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_completion_logprobs(client: openai.OpenAI, server: RunningServer) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        extra_body=FIXED_LENGTH,
    )  # fmt: skip
    validate(raw.http_response.json(), "CreateCompletionResponse")
    choice = raw.parse().choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == choice.text
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2  # greedy: the chosen token is one of the top 2
        assert top[token] == logprob == max(top.values())
        assert logprob <= 0.0


def test_completion_n2_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=4, n=2, seed=11, temperature=1.0,
            stream=True, extra_body=FIXED_LENGTH,
        )
    )  # fmt: skip
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for chunk in chunks:
        validate(chunk.to_dict(), COMPLETION_CHUNK)
        [choice] = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index].append(choice.finish_reason)
    for index in (0, 1):
        assert finishes[index][-1] == "length"
        assert set(finishes[index][:-1]) <= {None}
    assert texts[0] != texts[1]  # independent samples, not one answer twice


# ------------------------------------------------------------------ chat completions


def test_chat_completion(client: openai.OpenAI, server: RunningServer) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=FIXED_LENGTH
    )
    validate(raw.http_response.json(), "CreateChatCompletionResponse")
    chat = raw.parse()
    assert chat.object == "chat.completion" and chat.model == MODEL_ID
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 6
    assert chat.usage.prompt_tokens == prompt_tokens(server, messages=MESSAGES)


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    args = dict(
        model=MODEL_ID, messages=MESSAGES, max_tokens=6, temperature=0, extra_body=FIXED_LENGTH
    )
    full = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    for chunk in chunks:
        validate(chunk.to_dict(), "CreateChatCompletionStreamResponse")
    first, *content, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in content) == full.choices[0].message.content
    assert finish.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.model_dump() == full.usage.model_dump()


def test_chat_stream_without_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=2, temperature=0, stream=True
        )
    )
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)


def test_chat_n2_seeded(client: openai.OpenAI) -> None:
    args = dict(
        model=MODEL_ID, messages=MESSAGES, max_tokens=5, n=2, seed=5, temperature=1.0,
        extra_body=FIXED_LENGTH,
    )  # fmt: skip
    # The first time a prompt is seen, its last token is computed inside the prefill, and the
    # approximate kernels' last bits depend on the batch's shape (docs/kernels.md): compare
    # two requests that both find the prompt in the prefix cache, so both run the same steps.
    client.chat.completions.create(**args)
    chat = client.chat.completions.create(**args)
    assert [c.index for c in chat.choices] == [0, 1]
    texts = [c.message.content for c in chat.choices]
    assert texts[0] != texts[1]
    assert chat.usage.completion_tokens == 10
    again = client.chat.completions.create(**args)
    assert [c.message.content for c in again.choices] == texts


def test_chat_stop_strings(client: openai.OpenAI) -> None:
    args = dict(
        model=MODEL_ID, messages=MESSAGES, max_tokens=10, temperature=0, extra_body=FIXED_LENGTH
    )
    text = client.chat.completions.create(**args).choices[0].message.content
    stop = text.strip()[len(text.strip()) // 2 :][:3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    choice = client.chat.completions.create(**args, stop=stop).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.index(stop)]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_seeded_request_repeats_cold_and_cached(client: openai.OpenAI, endpoint: str) -> None:
    """A seeded 16-token request sent twice to a server that has not seen its prompt: the
    first computes the whole prompt, the second finds it in the prefix cache and computes
    only its last token. The scheduler gives a seeded prompt's last token a step of its own
    cold too, so both sample from the same logits: the same text, and the same logprobs bit
    for bit (computed inside the prompt's chunk, the default mode's kernels would round them
    differently). Another seed gives another text."""
    prompt = f"A seeded {endpoint} story, told twice. Once upon a time"

    def sample(seed: int) -> tuple[str, list[float], int]:
        args = dict(
            model=MODEL_ID, max_tokens=16, temperature=1.0, seed=seed, extra_body=FIXED_LENGTH
        )
        if endpoint == "chat":
            messages = [{"role": "user", "content": prompt}]
            chat = client.chat.completions.create(messages=messages, logprobs=True, **args)
            text, usage = chat.choices[0].message.content, chat.usage
            logprobs = [entry.logprob for entry in chat.choices[0].logprobs.content]
        else:
            completion = client.completions.create(prompt=prompt, logprobs=0, **args)
            text, usage = completion.choices[0].text, completion.usage
            logprobs = completion.choices[0].logprobs.token_logprobs
        details = usage.prompt_tokens_details
        return text, logprobs, details.cached_tokens if details else 0

    cold, cold_logprobs, cold_cached = sample(1234)
    cached, cached_logprobs, cached_tokens = sample(1234)
    assert cold_cached == 0 and cached_tokens > 0  # the second really came from the cache
    assert cached == cold
    assert len(cold_logprobs) == 16 and cached_logprobs == cold_logprobs
    assert sample(4321)[0] != cold


def test_chat_logprobs(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=3, extra_body=FIXED_LENGTH,
    )  # fmt: skip
    validate(raw.http_response.json(), "CreateChatCompletionResponse")
    choice = raw.parse().choices[0]
    content = choice.logprobs.content
    assert len(content) == 4
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        tops = [top.logprob for top in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_chat_logprobs_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
            top_logprobs=2, stream=True, extra_body=FIXED_LENGTH,
        )
    )  # fmt: skip
    entries = []
    for chunk in chunks:
        validate(chunk.to_dict(), "CreateChatCompletionStreamResponse")
        if chunk.choices[0].logprobs is not None:
            entries.extend(chunk.choices[0].logprobs.content)
    assert len(entries) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in entries)


def test_client_surfaces_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, temperature=3.5)
    assert bad.value.status_code == 400
    assert (bad.value.param, bad.value.code) == ("temperature", "invalid_value")
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=1)
    assert missing.value.code == "model_not_found"


# ------------------------------------------------------------------ the async client


async def test_async_client_completions_and_chat(aclient: openai.AsyncOpenAI) -> None:
    async def completion() -> None:
        c = await aclient.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=FIXED_LENGTH
        )
        validate(c.to_dict(), "CreateCompletionResponse")
        assert c.usage.completion_tokens == 4

    async def completion_stream() -> None:
        stream = await aclient.completions.create(
            model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=FIXED_LENGTH,
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        for chunk in chunks:
            validate(chunk.to_dict(), COMPLETION_CHUNK)
        assert chunks[-1].usage.completion_tokens == 4

    async def chat() -> None:
        c = await aclient.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=4, n=2, seed=3, extra_body=FIXED_LENGTH
        )
        validate(c.to_dict(), "CreateChatCompletionResponse")
        assert [choice.index for choice in c.choices] == [0, 1]
        assert c.usage.completion_tokens == 8

    async def chat_stream() -> None:
        stream = await aclient.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=FIXED_LENGTH,
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        for chunk in chunks:
            validate(chunk.to_dict(), "CreateChatCompletionStreamResponse")
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 4

    # Concurrently: the engine batches them, and each still gets exactly its own answer.
    await asyncio.gather(completion(), completion_stream(), chat(), chat_stream())


async def test_async_client_models_and_seed(aclient: openai.AsyncOpenAI) -> None:
    models = await aclient.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    args = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=99)
    first = await aclient.completions.create(**args)
    second = await aclient.completions.create(**args)
    assert first.choices[0].text == second.choices[0].text
