"""Lenient where peers are lenient: fields the server does not know are dropped and logged (or,
with UNKNOWN_FIELDS=reject, a 400 naming them), vLLM's `stream_options.continuous_usage_stats`
and `chat_template_kwargs` are honoured. Decoders directly, then real servers."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from websockets.asyncio.client import connect

from compat.errors import ApiError
from compat.request_types import (
    ChatCompletionRequest,
    decode_chat_completion_request,
    decode_completion_request,
    decode_detokenize_request,
    decode_tokenize_request,
)
from compat.unknown_fields import drop_unknown_fields
from engine.model.loader import embedded_checkpoint_dir
from tests.conftest import MODEL_ID, RunningServer, start_server, stop_server
from tests.gateway_helpers import chat_body, completion_body, sse_chunks
from tests.openapi_schema import COMPLETION_CHUNK, validate

TIMEOUT = httpx.Timeout(300.0)
USER = {"role": "user", "content": "hi"}

# A body as a vLLM / SGLang client writes it, and the same body without what we do not know.
PEER_BODY: dict[str, Any] = {
    "model": MODEL_ID,
    "messages": [
        {"role": "system", "content": "Be brief.", "id": "m0"},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        USER,
    ],
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True, "extra": 1},
    "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "x-order": 1}, "q": 2}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"k": 1}, "v": 1}}],
    "skip_special_tokens": True,
    "guided_json": None,
}  # fmt: skip
PEER_BODY_KNOWN: dict[str, Any] = {
    "model": MODEL_ID,
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "Hello."},
        USER,
    ],
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "type": "object", "x-order": 1}}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"k": 1}}}],
}  # fmt: skip
PEER_UNKNOWN = [
    "messages[0].id",
    "messages[1].content[0].cache_control",
    "messages[2].reasoning_content",
    "stream_options.extra",
    "response_format.json_schema.q",
    "tools[0].function.v",
    "skip_special_tokens",
    "guided_json",
]


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# ------------------------------------------------------------------ decoding


def test_unknown_fields_are_dropped_at_every_level_and_named_by_path() -> None:
    known, dropped = drop_unknown_fields(json.loads(encoded(PEER_BODY)), ChatCompletionRequest)
    assert sorted(dropped) == sorted(PEER_UNKNOWN)
    assert known == PEER_BODY_KNOWN  # values typed Any (schemas, parameters) are kept whole


def test_ignore_decodes_as_if_the_unknown_fields_were_absent() -> None:
    assert decode_chat_completion_request(encoded(PEER_BODY)) == decode_chat_completion_request(
        encoded(PEER_BODY_KNOWN)
    )
    plain = {"model": MODEL_ID, "prompt": [[1, 2], [3]], "stream": True, "stream_options": {}}
    body = {**plain, "stream_options": {"x": 1}, "foo": {"a": [1]}}
    assert decode_completion_request(encoded(body)) == decode_completion_request(encoded(plain))
    assert decode_tokenize_request(b'{"prompt": "a", "b": 1}') == decode_tokenize_request(
        b'{"prompt": "a"}'
    )
    assert decode_detokenize_request(b'{"tokens": [2], "b": 1}').tokens == [2]
    # An already-parsed WebSocket body too.
    assert decode_chat_completion_request({**chat_body(), "x": 1}) == (
        decode_chat_completion_request(chat_body())
    )


@pytest.mark.parametrize("path", PEER_UNKNOWN)
def test_reject_names_the_unknown_field(path: str) -> None:
    body = json.loads(encoded(PEER_BODY_KNOWN))
    # Put just this one unknown field back where the peer body had it.
    *parents, name = re.findall(r"[^.\[\]]+", path)
    target: Any = body
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    target[name] = 1
    with pytest.raises(ApiError) as info:
        decode_chat_completion_request(encoded(body), "reject")
    error = info.value
    assert (error.status, error.code, error.param) == (400, "unknown_parameter", path)
    assert error.message == f"Unrecognized request argument supplied: {path}"
    decode_chat_completion_request(encoded(body))  # ignored by default


def _without(value: Any, name: str) -> Any:
    """`value` with every object key `name` removed, at any depth."""
    if isinstance(value, dict):
        return {k: _without(v, name) for k, v in value.items() if k != name}
    if isinstance(value, list):
        return [_without(v, name) for v in value]
    return value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_body(functions=[{"name": "f"}], z=1), "functions"),
        (chat_body(audio={"voice": "x"}, z=1), "audio"),
        ({"model": MODEL_ID, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "image_url": {"url": "http://x/y.png"}, "z": 1}]}]},
         "messages[0].content[0].image_url"),
        ({"model": MODEL_ID, "messages": [USER, {"role": "assistant", "content": "x",
                                                 "audio": {"id": "a"}, "z": 1}]},
         "messages[1].audio"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["ignore", "reject"])
def test_known_fields_we_cannot_honour_stay_refused(body: dict, param: str, mode: str) -> None:
    if mode == "reject":  # the unknown field `z` would be the error
        body = _without(body, "z")
    with pytest.raises(ApiError) as info:
        decode_chat_completion_request(encoded(body), mode)  # type: ignore[arg-type]
    assert info.value.param == param
    assert info.value.code == "unsupported_parameter"


def test_type_errors_still_name_the_field_among_unknown_ones() -> None:
    body = {**chat_body(foo=1), "messages": [{"role": "user", "content": 3, "id": "m"}]}
    with pytest.raises(ApiError) as info:
        decode_chat_completion_request(encoded(body))
    assert (info.value.param, info.value.code) == ("messages[0].content", "invalid_type")
    assert info.value.message == (
        "Invalid type for 'messages[0].content': expected string or array or null, got integer."
    )


# ------------------------------------------------------------------ the default server


def _stream(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = httpx.post(server.v1 + path, json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return sse_chunks(response.content)


def _prompt_tokens(server: RunningServer, **body: Any) -> int:
    response = httpx.post(server.base_url + "/tokenize", json={"model": MODEL_ID, **body})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_a_peer_body_is_served_and_its_unknown_fields_logged_once(server: RunningServer) -> None:
    marker = f"x_{uuid.uuid4().hex}"
    body = {**PEER_BODY, marker: 1, "max_tokens": 4, "response_format": None, "tools": None}
    chunks = _stream(server, "/chat/completions", body)
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    lines = [line for line in server.log().splitlines() if marker in line]
    assert len(lines) == 1, lines  # one warning per request
    assert "unknown fields ignored" in lines[0] and "warning" in lines[0].lower()
    for path in [p for p in PEER_UNKNOWN if not p.startswith(("response_format", "tools"))]:
        assert path in lines[0], path


def test_openai_client_extra_body_with_peer_fields(server: RunningServer) -> None:
    client = OpenAI(base_url=server.v1, api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"top_k": 1, "chat_template_kwargs": {"enable_thinking": False},
                    "repetition_detection": {"window": 3}},
    )  # fmt: skip
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


async def test_a_websocket_generate_frame_ignores_unknown_fields(server: RunningServer) -> None:
    url = server.base_url.replace("http://", "ws://") + "/v1/ws"
    async with connect(url, proxy=None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        frame = {"type": "generate", "id": "g", **completion_body(max_tokens=2), "foo": [1]}
        await ws.send(json.dumps(frame))
        while (event := json.loads(await ws.recv()))["type"] == "delta":
            pass
    assert event["type"] == "done", event
    assert event["usage"]["completion_tokens"] >= 1


def _check_continuous(chunks: list[dict[str, Any]], prompt_tokens: int, final: bool) -> None:
    """Every chunk's usage counts the prompt and what was generated so far; the last is the
    whole generation's."""
    counted = [c["usage"]["completion_tokens"] for c in chunks]
    assert counted == sorted(counted) and counted[0] <= 1
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (chunks[-1]["choices"] == []) is final  # the usage chunk of include_usage


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_on_completions(server: RunningServer, include_usage: bool) -> None:
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    body = completion_body(max_tokens=6, ignore_eos=True, stream=True, stream_options=options)
    chunks = _stream(server, "/completions", body)
    for chunk in chunks:
        validate(chunk, COMPLETION_CHUNK)
    _check_continuous(chunks, _prompt_tokens(server, prompt=body["prompt"]), include_usage)
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    # Each text chunk counts at least the tokens it shows.
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert [c["usage"]["completion_tokens"] for c in texts] == sorted(
        {c["usage"]["completion_tokens"] for c in texts}
    )


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_on_chat(server: RunningServer, include_usage: bool) -> None:
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    body = chat_body(max_tokens=6, ignore_eos=True, n=2, stream=True, stream_options=options)
    chunks = _stream(server, "/chat/completions", body)
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    _check_continuous(chunks, _prompt_tokens(server, messages=body["messages"]), include_usage)
    assert chunks[0]["usage"]["completion_tokens"] == 0  # the role chunk, before any token
    assert chunks[-1]["usage"]["completion_tokens"] == 12  # n = 2 choices of 6


def test_without_continuous_usage_only_the_last_chunk_counts(server: RunningServer) -> None:
    options = {"include_usage": True, "continuous_usage_stats": False}
    body = chat_body(max_tokens=3, stream=True, stream_options=options)
    chunks = _stream(server, "/chat/completions", body)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ UNKNOWN_FIELDS=reject, and a
# checkpoint whose chat template reads a variable of its own


PERSONA_TEMPLATE = (
    "{{ bos_token }}{% if persona is defined %}<start_of_turn>user\nYou are a {{ persona }}."
    "<end_of_turn>\n{% endif %}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The embedded model under a chat template with a `persona` variable, strict fields."""
    tmp = tmp_path_factory.mktemp("strict")
    source = embedded_checkpoint_dir()
    checkpoint = tmp / "models" / MODEL_ID  # the directory's name is the model id
    checkpoint.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        (checkpoint / name).symlink_to(source / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = PERSONA_TEMPLATE
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    running = start_server(tmp, MODEL_NAME=str(checkpoint), UNKNOWN_FIELDS="reject")
    yield running
    stop_server(running)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(foo=1), "foo"),
        ("/v1/chat/completions", chat_body(stream=True, stream_options={"x": 1}),
         "stream_options.x"),
        ("/v1/chat/completions",
         {"model": MODEL_ID, "messages": [{**USER, "reasoning_content": "r"}]},
         "messages[0].reasoning_content"),
        ("/v1/completions", completion_body(foo=1), "foo"),
        ("/tokenize", {"prompt": "x", "foo": 1}, "foo"),
        ("/detokenize", {"tokens": [2], "foo": 1}, "foo"),
    ],
)  # fmt: skip
def test_reject_mode_is_a_400_naming_the_field(
    strict: RunningServer, path: str, body: dict, param: str
) -> None:
    response = httpx.post(strict.base_url + path, json=body, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": {
            "message": f"Unrecognized request argument supplied: {param}",
            "type": "invalid_request_error",
            "param": param,
            "code": "unknown_parameter",
        }
    }


def _tokens(server: RunningServer, **body: Any) -> list[str]:
    response = httpx.post(
        server.base_url + "/tokenize",
        json={"model": MODEL_ID, "messages": [USER], "return_token_strs": True, **body},
        timeout=TIMEOUT,
    )
    assert response.status_code == 200, response.text
    return response.json()["token_strs"]


def test_chat_template_kwargs_reach_the_template(strict: RunningServer) -> None:
    plain = _tokens(strict)
    pirate = _tokens(strict, chat_template_kwargs={"persona": "pirate"})
    assert "pirate" in "".join(pirate) and "pirate" not in "".join(plain)
    assert len(pirate) > len(plain)
    # A chat request renders the same prompt: its usage counts the persona's tokens.
    for kwargs, tokens in ((None, plain), ({"persona": "pirate"}, pirate)):
        response = httpx.post(
            strict.v1 + "/chat/completions", timeout=TIMEOUT,
            json=chat_body("hi", max_tokens=1, chat_template_kwargs=kwargs),
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(tokens)


def test_chat_template_kwargs_cannot_replace_the_template(strict: RunningServer) -> None:
    hijack = {"chat_template": "{{ 'owned' }}", "add_generation_prompt": False}
    assert _tokens(strict, chat_template_kwargs=hijack) == _tokens(strict)
