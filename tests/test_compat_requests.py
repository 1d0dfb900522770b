"""Decoding and validating OpenAI request bodies: what is accepted, and the exact 400s."""

from __future__ import annotations

import functools
import json

import pytest

from compat.errors import ApiError
from compat.request_types import (
    ChatCompletionRequest,
    CompletionRequest,
    decode_chat_completion_request,
    decode_completion_request,
    decode_detokenize_request,
    decode_tokenize_request,
)
from tests.openapi_schema import errors as spec_errors

USER_HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": USER_HI, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def refused(decode, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode(body)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


# --- accepted requests -------------------------------------------------------------------------


def test_minimal_chat_request_defaults():
    req = decode_chat_completion_request(chat())
    assert isinstance(req, ChatCompletionRequest)
    assert req.model == "m"
    assert req.messages[0].role == "user" and req.messages[0].text() == "hi"
    assert req.num_choices == 1
    assert not req.is_stream and not req.include_usage
    assert req.requested_max_tokens is None and req.num_logprobs is None


def test_full_chat_request_with_extensions():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": "hello", "refusal": None},
            {"role": "user", "content": [{"type": "text", "text": "again"}]},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 7,
        "n": 2,
        "stop": ["x", "y"],
        "seed": -3,
        "temperature": 0.5,
        "top_p": 0.9,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "logit_bias": {"17": -100, "4": 3},
        "logprobs": True,
        "top_logprobs": 20,
        "user": "u1",
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "stop_token_ids": [1, 106],
        "ignore_eos": False,
        "min_tokens": 2,
        "priority": -1,
        "cache_salt": "s",
        # Values that ask for nothing beyond plain text generation are accepted.
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "service_tier": "auto",
        "reasoning_effort": "none",
        "store": False,
        "prompt_cache_key": "k",
        "prompt_cache_retention": "in_memory",
        "safety_identifier": "sid",
    }
    assert spec_errors(body, "CreateChatCompletionRequest") == []  # a spec-valid body, too
    req = decode_chat_completion_request(json.dumps(body))
    assert req.messages[1].text() == "a\nb"
    assert req.messages[2].name == "ann"
    assert req.requested_max_tokens == 7
    assert req.num_logprobs == 20
    assert req.num_choices == 2
    assert req.is_stream and req.include_usage
    assert req.logit_bias == {"17": -100.0, "4": 3.0}
    assert (req.top_k, req.min_p, req.priority, req.cache_salt) == (40, 0.05, -1, "s")


def test_fractional_logit_bias_is_accepted():
    # The spec types the values as integers; like vLLM we accept any number in [-100, 100].
    assert decode_chat_completion_request(chat(logit_bias={"3": 0.5})).logit_bias == {"3": 0.5}


def test_nulls_mean_defaults():
    req = decode_chat_completion_request(
        chat(temperature=None, top_p=None, n=None, stop=None, seed=None, logprobs=None, tools=None)
    )
    assert req.temperature is None and req.num_choices == 1


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        (None, [""]),
        ("", [""]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = decode_completion_request(completion(prompt=prompt))
    assert isinstance(req, CompletionRequest)
    assert req.prompts() == expected


def test_completion_fields():
    req = decode_completion_request(
        completion(echo=True, n=3, best_of=3, logprobs=None, max_tokens=9, stop="\n", suffix=None)
    )
    assert (req.echo, req.num_choices, req.max_tokens, req.stop) == (True, 3, 9, "\n")
    req = decode_completion_request(completion(logprobs=5, best_of=1))
    assert req.logprobs == 5


def test_decode_accepts_parsed_dict_and_str():
    body = {"model": "m", "prompt": "x", "temperature": 1}
    assert decode_completion_request(body).temperature == 1.0
    assert decode_completion_request(json.dumps(body)).prompt == "x"


# --- malformed and out-of-range bodies ---------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, code, message",
    [
        (
            chat(temperature=3),
            "temperature",
            "invalid_value",
            "Invalid value for 'temperature': expected number <= 2.0.",
        ),
        (
            chat(temperature="hot"),
            "temperature",
            "invalid_type",
            "Invalid type for 'temperature': expected number or null, got string.",
        ),
        (chat(n=0), "n", "invalid_value", "Invalid value for 'n': expected integer >= 1."),
        (
            chat(top_logprobs=21, logprobs=True),
            "top_logprobs",
            "invalid_value",
            "Invalid value for 'top_logprobs': expected integer <= 20.",
        ),
        (
            chat(logit_bias={"5": 101}),
            "logit_bias",
            "invalid_value",
            "Invalid value for 'logit_bias': expected number <= 100.0.",
        ),
        (
            chat(stop_token_ids=[-1]),
            "stop_token_ids[0]",
            "invalid_value",
            "Invalid value for 'stop_token_ids[0]': expected integer >= 0.",
        ),
        (
            chat(max_completion_tokens=0),
            "max_completion_tokens",
            "invalid_value",
            "Invalid value for 'max_completion_tokens': expected integer >= 1.",
        ),
        (
            chat(messages=[]),
            "messages",
            "invalid_value",
            "Invalid value for 'messages': expected array of length >= 1.",
        ),
        (
            chat(messages=[{"role": "robot", "content": "x"}]),
            "messages[0].role",
            "invalid_value",
            "Invalid value for 'messages[0].role': invalid enum value 'robot'.",
        ),
        (
            chat(stream_options={"include_usage": True, "extra": 1}, stream=True),
            "stream_options.extra",
            "unknown_parameter",
            "Unrecognized request argument supplied: stream_options.extra",
        ),
        (
            chat(frobnicate=1),
            "frobnicate",
            "unknown_parameter",
            "Unrecognized request argument supplied: frobnicate",
        ),
        (
            json.dumps({"messages": USER_HI}).encode(),
            "model",
            "missing_required_parameter",
            "Missing required parameter: 'model'.",
        ),
        (
            json.dumps({"model": "m"}).encode(),
            "messages",
            "missing_required_parameter",
            "Missing required parameter: 'messages'.",
        ),
        (
            chat(messages=[{"content": "x"}]),
            "messages[0].role",
            "missing_required_parameter",
            "Missing required parameter: 'messages[0].role'.",
        ),
        (
            b"[1, 2]",
            None,
            "invalid_type",
            "Invalid type for the request body: expected object, got array.",
        ),
        (
            b'{"model": "m",',
            None,
            "invalid_json",
            "We could not parse the JSON body of your request: Input data was truncated",
        ),
        (
            chat(seed=2**63),
            "seed",
            "invalid_value",
            "Invalid value for 'seed': expected integer <= 9223372036854775807.",
        ),
        (
            chat(user="u" * 257),
            "user",
            "invalid_value",
            "Invalid value for 'user': expected string of length <= 256.",
        ),
        (
            chat(safety_identifier="s" * 65),
            "safety_identifier",
            "invalid_value",
            "Invalid value for 'safety_identifier': expected string of length <= 64.",
        ),
    ],
)
@pytest.mark.parametrize("unknown_fields", ["ignore", "reject"])
def test_chat_decode_errors(body, param, code, message, unknown_fields):
    decode = functools.partial(decode_chat_completion_request, unknown_fields=unknown_fields)
    if code == "unknown_parameter" and unknown_fields == "ignore":
        decode(body)  # the unknown field is dropped (tests/test_unknown_fields.py)
        return
    err = refused(decode, body)
    assert (err.param, err.code, err.message) == (param, code, message)


@pytest.mark.parametrize(
    "fields, param, code, message",
    [
        (
            {"prompt": {"a": 1}},
            "prompt",
            "invalid_type",
            "Invalid type for 'prompt': expected string or array or null, got object.",
        ),
        ({"prompt": []}, "prompt", "invalid_value", "'prompt' must not be an empty list."),
        (
            {"prompt": ["a", 1]},
            "prompt",
            "invalid_value",
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, not a mix.",
        ),
        (
            {"prompt": [[1], []]},
            "prompt[1]",
            "invalid_value",
            "'prompt[1]' must not be an empty list.",
        ),
        (
            {"prompt": [[1, -2]]},
            "prompt[0][1]",
            "invalid_value",
            "Invalid value for 'prompt[0][1]': expected integer >= 0.",
        ),
        (
            {"logprobs": 6},
            "logprobs",
            "invalid_value",
            "Invalid value for 'logprobs': expected integer <= 5.",
        ),
        (
            {"max_tokens": 0},  # 0 only scores a prompt (echo, prompt_logprobs)
            "max_tokens",
            "invalid_value",
            "'max_tokens' must be at least 1, or 0 with 'echo' or 'prompt_logprobs' to score "
            "the prompt alone.",
        ),
        (
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_value",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        ),
        (
            {"messages": USER_HI},
            "messages",
            "unknown_parameter",
            "Unrecognized request argument supplied: messages",
        ),
        (
            {"user": "\u00e9" * 257},
            "user",
            "invalid_value",
            "Invalid value for 'user': expected string of length <= 256.",
        ),
    ],
)
@pytest.mark.parametrize("unknown_fields", ["ignore", "reject"])
def test_completion_decode_errors(fields, param, code, message, unknown_fields):
    decode = functools.partial(decode_completion_request, unknown_fields=unknown_fields)
    if code == "unknown_parameter" and unknown_fields == "ignore":
        decode(completion(**fields))  # the unknown field is dropped
        return
    err = refused(decode, completion(**fields))
    assert (err.param, err.code, err.message) == (param, code, message)


def test_identifiers_are_served_up_to_their_limits_in_characters():
    """`user` names the tenant and session: 256 characters, counted as characters (not UTF-8
    bytes); `safety_identifier` has OpenAI's 64."""
    assert decode_completion_request(completion(user="\u00e9" * 256)).user == "\u00e9" * 256
    req = decode_chat_completion_request(chat(user="u" * 256, safety_identifier="s" * 64))
    assert (req.user, req.safety_identifier) == ("u" * 256, "s" * 64)


@pytest.mark.parametrize(
    "body, params",
    [
        (completion(max_tokens=3), ("prompt", "max_tokens")),
        (chat(max_tokens=3), ("messages", "max_tokens")),
        (chat(max_completion_tokens=3), ("messages", "max_completion_tokens")),
        (chat(max_tokens=3, max_completion_tokens=3), ("messages", "max_completion_tokens")),
    ],
)
def test_the_fields_a_length_error_names(body, params):
    decode = decode_chat_completion_request if b"messages" in body else decode_completion_request
    req = decode(body)
    assert (req.prompt_param, req.max_tokens_param) == params


def test_completion_prompt_is_required():
    err = refused(decode_completion_request, b'{"model": "m"}')
    assert (err.param, err.code) == ("prompt", "missing_required_parameter")


# --- parameters we know but cannot serve -------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"function_call": "auto"}, "function_call", "unsupported_value"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_parameter"),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_value"),
        (
            {"prediction": {"type": "content", "content": "x"}},
            "prediction",
            "unsupported_parameter",
        ),
        ({"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
        ({"reasoning_effort": "high"}, "reasoning_effort", "unsupported_value"),
        ({"verbosity": "low"}, "verbosity", "unsupported_value"),
        ({"service_tier": "flex"}, "service_tier", "unsupported_value"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"metadata": {"a": "b"}}, "metadata", "unsupported_parameter"),
        ({"moderation": {"model": "x"}}, "moderation", "unsupported_parameter"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "unsupported_value"),
        (
            {"prompt_cache_options": {"mode": "explicit"}},
            "prompt_cache_options",
            "unsupported_parameter",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
                ]
            },
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x", "image_url": {}}]}
                ]
            },
            "messages[0].content[0].image_url",
            "unsupported_parameter",
        ),
        (
            {
                "messages": [
                    *USER_HI,
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                ]
            },
            "messages[1].content[0].type",
            "unsupported_value",
        ),
        (
            {"messages": [*USER_HI, {"role": "function", "content": "42", "name": "f"}]},
            "messages[1].role",
            "unsupported_value",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ],
)
def test_chat_unsupported_parameters_are_refused_by_name(fields, param, code):
    err = refused(decode_chat_completion_request, chat(**fields))
    assert (err.param, err.code) == (param, code)
    assert param.split(".")[0].split("[")[0] in err.message


def test_unsupported_messages_are_exact():
    err = refused(decode_chat_completion_request, chat(functions=[{"name": "f"}]))
    assert err.message == (
        "Unsupported parameter: 'functions' is not supported by this server: "
        "the legacy function calling is not available; use tools."
    )
    err = refused(decode_chat_completion_request, chat(response_format={"type": "json_schema"}))
    assert err.message == "Missing required parameter: 'response_format.json_schema'."
    err = refused(decode_chat_completion_request, chat(response_format={"type": "xml"}))
    assert (err.param, err.code) == ("response_format.type", "invalid_value")
    err = refused(
        decode_chat_completion_request,
        chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
    )
    assert err.message == (
        "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar' or "
        "'json_object'; got regex, choice."
    )
    err = refused(decode_chat_completion_request, chat(top_logprobs=2, logprobs=False))
    assert err.message == "'top_logprobs' requires 'logprobs' to be true."


def test_assistant_message_without_content_is_refused():
    err = refused(
        decode_chat_completion_request,
        chat(messages=[*USER_HI, {"role": "assistant", "content": None}]),
    )
    assert (err.param, err.code, err.message) == (
        "messages[1].content",
        "missing_required_parameter",
        "Missing required parameter: 'messages[1].content'.",
    )


@pytest.mark.parametrize(
    "fields, param, code, message",
    [
        (
            {"suffix": "end"},
            "suffix",
            "unsupported_parameter",
            "Unsupported parameter: 'suffix' is not supported by this server: "
            "insertion (fill-in-the-middle) is not available.",
        ),
        (
            {"best_of": 3, "n": 2},
            "best_of",
            "unsupported_value",
            "Unsupported value: 'best_of' does not support 3 on this server: "
            "best_of must equal n (2); candidates are not ranked server-side.",
        ),
        (
            {"best_of": 2},
            "best_of",
            "unsupported_value",
            "Unsupported value: 'best_of' does not support 2 on this server: "
            "best_of must equal n (1); candidates are not ranked server-side.",
        ),
    ],
)
def test_completion_unsupported_parameters(fields, param, code, message):
    err = refused(decode_completion_request, completion(**fields))
    assert (err.param, err.code, err.message) == (param, code, message)


# --- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_requests():
    req = decode_tokenize_request(b'{"prompt": "hi"}')
    assert (req.prompt, req.messages, req.add_special_tokens, req.return_token_strs) == (
        "hi",
        None,
        True,
        False,
    )
    req = decode_tokenize_request(
        json.dumps({"model": "m", "messages": USER_HI, "add_generation_prompt": False})
    )
    assert req.messages[0].text() == "hi" and req.add_generation_prompt is False
    err = refused(decode_tokenize_request, json.dumps({"prompt": "a", "messages": USER_HI}))
    assert (err.param, err.message) == ("prompt", "Provide exactly one of 'prompt' or 'messages'.")
    err = refused(decode_tokenize_request, b"{}")
    assert err.param == "prompt"
    err = refused(
        decode_tokenize_request, json.dumps({"messages": [{"role": "function", "content": "x"}]})
    )
    assert err.param == "messages[0].role"
    err = refused(
        decode_tokenize_request,
        json.dumps({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}),
    )
    assert err.param == "messages[0].tool_call_id"


def test_detokenize_requests():
    assert decode_detokenize_request(b'{"tokens": [2, 3]}').tokens == [2, 3]
    err = refused(decode_detokenize_request, b'{"tokens": [2, -3]}')
    assert err.param == "tokens[1]"
