"""OpenAI request -> engine SamplingParams: defaults, max_tokens budget, engine refusals."""

from __future__ import annotations

import json

import pytest

from compat.engine_mapping import check_token_ids, resolve_max_tokens, to_sampling_params
from compat.errors import ApiError
from compat.request_types import decode_chat_completion_request, decode_completion_request
from engine.sampling import SamplingParams

END_OF_TURN = 106


def chat(**fields):
    return decode_chat_completion_request(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    )


def completion(**fields):
    return decode_completion_request(json.dumps({"model": "m", "prompt": "hi", **fields}))


def test_completion_defaults_are_openai_defaults():
    params = to_sampling_params(completion(), num_prompt_tokens=3, max_model_len=100)
    assert params == SamplingParams(
        max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, logprobs=None
    )


def test_chat_defaults_use_the_rest_of_the_context_and_stop_at_end_of_turn():
    params = to_sampling_params(
        chat(), num_prompt_tokens=30, max_model_len=100, extra_stop_token_ids=[END_OF_TURN]
    )
    assert params == SamplingParams(max_tokens=70, stop_token_ids=[END_OF_TURN])


def test_every_field_is_carried_over():
    req = chat(
        max_completion_tokens=8,
        max_tokens=50,
        temperature=0,
        top_p=0.5,
        top_k=7,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"5": -100, "9": 2},
        seed=42,
        stop=["END", "\n\n"],
        stop_token_ids=[3, END_OF_TURN],
        min_tokens=2,
        logprobs=True,
        top_logprobs=4,
        include_stop_str_in_output=True,
    )
    params = to_sampling_params(
        req,
        num_prompt_tokens=10,
        max_model_len=100,
        vocab_size=200,
        extra_stop_token_ids=[END_OF_TURN],
    )
    assert params == SamplingParams(
        max_tokens=8,  # max_completion_tokens wins over the deprecated max_tokens
        temperature=0.0,
        top_p=0.5,
        top_k=7,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={5: -100.0, 9: 2.0},
        seed=42,
        stop=["END", "\n\n"],
        stop_token_ids=[3, END_OF_TURN],  # not repeated
        ignore_eos=False,
        min_tokens=2,
        logprobs=4,
        include_stop_str_in_output=True,
    )
    assert params.greedy


def test_chat_logprobs_without_top_logprobs_means_zero_alternatives():
    assert (
        to_sampling_params(chat(logprobs=True), num_prompt_tokens=1, max_model_len=10).logprobs == 0
    )
    assert (
        to_sampling_params(chat(logprobs=False), num_prompt_tokens=1, max_model_len=10).logprobs
        is None
    )


def test_completion_stop_string_and_logprobs():
    params = to_sampling_params(
        completion(stop="\n", logprobs=3, max_tokens=5), num_prompt_tokens=1, max_model_len=10
    )
    assert (params.stop, params.logprobs, params.max_tokens) == (["\n"], 3, 5)


def test_ignore_eos_also_ignores_end_of_turn():
    params = to_sampling_params(
        chat(ignore_eos=True, stop_token_ids=[4]),
        num_prompt_tokens=1,
        max_model_len=10,
        extra_stop_token_ids=[END_OF_TURN],
    )
    assert (params.ignore_eos, params.stop_token_ids) == (True, [4])


@pytest.mark.parametrize(
    "make, prompt_tokens, expected",
    [
        (lambda: completion(), 95, 5),  # the default 16 shrinks to the room left
        (lambda: completion(), 10, 16),
        (lambda: completion(max_tokens=90), 10, 90),
        (lambda: chat(), 99, 1),
        (lambda: chat(max_tokens=20), 80, 20),
    ],
)
def test_resolve_max_tokens(make, prompt_tokens, expected):
    assert resolve_max_tokens(make(), prompt_tokens, 100) == expected


def test_prompt_filling_the_context_is_refused():
    with pytest.raises(ApiError) as info:
        to_sampling_params(chat(), num_prompt_tokens=100, max_model_len=100)
    err = info.value
    assert (err.status, err.param, err.code, err.message) == (
        400,
        "messages",
        "context_length_exceeded",
        "This model's maximum context length is 100 tokens, but the prompt has 100 tokens, "
        "leaving no room for the completion. Please reduce the length of the messages.",
    )


@pytest.mark.parametrize(
    "req, param, where",
    [
        (lambda: completion(max_tokens=91), "max_tokens", "prompt"),
        (lambda: chat(max_tokens=91), "max_tokens", "messages"),
        (lambda: chat(max_completion_tokens=91), "max_completion_tokens", "messages"),
    ],
)
def test_completion_budget_over_the_context_is_refused(req, param, where):
    with pytest.raises(ApiError) as info:
        to_sampling_params(req(), num_prompt_tokens=10, max_model_len=100)
    err = info.value
    assert (err.param, err.code, err.message) == (
        param,
        "context_length_exceeded",
        f"This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        f"(10 in the prompt, 91 for the completion). Please reduce the length of the {where} "
        f"or the completion.",
    )


@pytest.mark.parametrize(
    "req, param, message",
    [
        (
            lambda: chat(min_tokens=9, max_tokens=3),
            "min_tokens",
            "min_tokens must be in [0, max_tokens], got 9",
        ),
        (lambda: chat(stop=["a", ""]), "stop", "stop strings must not be empty"),
        (
            lambda: chat(logit_bias={"x": 1}),
            "logit_bias",
            "'logit_bias' keys must be token ids, got 'x'.",
        ),
        (
            lambda: chat(logit_bias={"-1": 1}),
            "logit_bias",
            "Token id -1 in 'logit_bias' is out of range.",
        ),
        (
            lambda: chat(logit_bias={"500": 1}),
            "logit_bias",
            "Token id 500 in 'logit_bias' is out of range.",
        ),
        (
            lambda: chat(stop_token_ids=[1, 500]),
            "stop_token_ids",
            "Token id 500 in 'stop_token_ids' is out of range (vocabulary size 200).",
        ),
    ],
)
def test_refusals_become_400s(req, param, message):
    with pytest.raises(ApiError) as info:
        to_sampling_params(req(), num_prompt_tokens=1, max_model_len=100, vocab_size=200)
    err = info.value
    assert (err.status, err.param, err.code, err.message) == (400, param, "invalid_value", message)


def test_check_token_ids():
    check_token_ids([0, 199], 200, "prompt")
    with pytest.raises(ApiError) as info:
        check_token_ids([0, 200], 200, "prompt")
    assert info.value.param == "prompt"
