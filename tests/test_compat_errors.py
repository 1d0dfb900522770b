"""OpenAI-shaped error bodies and the errors the gateway raises."""

from __future__ import annotations

import msgspec
import pytest

from compat import errors
from compat.errors import ApiError, error_body, error_type_for_status, from_invalid_request
from compat.request_types import decode_chat_completion_request
from engine.sampling import InvalidRequestError, SamplingParams
from tests.openapi_schema import validate


def encoded(err: ApiError) -> dict:
    return msgspec.json.decode(msgspec.json.encode(err.body()))


def test_error_body_shape_is_exact_and_matches_the_spec():
    body = msgspec.json.encode(
        error_body("bad", "invalid_request_error", "temperature", "invalid_value")
    )
    assert body == (
        b'{"error":{"message":"bad","type":"invalid_request_error",'
        b'"param":"temperature","code":"invalid_value"}}'
    )
    validate(msgspec.json.decode(body), "ErrorResponse")
    # param and code are required in the body even when null.
    nulls = msgspec.json.decode(msgspec.json.encode(error_body("x", "server_error")))
    assert nulls == {"error": {"message": "x", "type": "server_error", "param": None, "code": None}}
    validate(nulls, "ErrorResponse")


@pytest.mark.parametrize(
    "status, type_",
    [
        (400, "invalid_request_error"),
        (401, "invalid_request_error"),
        (404, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_exceeded"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_type_for_status(status, type_):
    assert error_type_for_status(status) == type_
    assert ApiError("m", status=status).type == type_


@pytest.mark.parametrize(
    "err, status, param, code, message, headers",
    [
        (
            errors.missing_api_key(),
            401,
            None,
            "missing_api_key",
            "You didn't provide an API key. Provide it in the Authorization header "
            "(Authorization: Bearer YOUR_KEY).",
            {},
        ),
        (errors.invalid_api_key(), 401, None, "invalid_api_key", "Incorrect API key provided.", {}),
        (
            errors.model_not_found("gpt-9"),
            404,
            "model",
            "model_not_found",
            "The model `gpt-9` does not exist.",
            {},
        ),
        (
            errors.route_not_found("POST", "/v1/x"),
            404,
            None,
            "not_found",
            "Invalid URL (POST /v1/x)",
            {},
        ),
        (
            errors.request_too_large(1024),
            413,
            None,
            "request_too_large",
            "The request body is larger than the limit of 1024 bytes.",
            {},
        ),
        (
            errors.rate_limited("The queue is full.", 2),
            429,
            None,
            "rate_limit_exceeded",
            "The queue is full.",
            {"Retry-After": "2"},
        ),
        (
            errors.server_error(),
            500,
            None,
            "internal_error",
            "The server had an error while processing your request.",
            {},
        ),
    ],
)
def test_gateway_errors(err, status, param, code, message, headers):
    assert (err.status, err.param, err.code, err.message, err.headers) == (
        status,
        param,
        code,
        message,
        headers,
    )
    body = encoded(err)
    assert body["error"]["message"] == message and body["error"]["code"] == code
    validate(body, "ErrorResponse")


def test_engine_refusal_becomes_a_400_naming_the_field():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_p=1.5)
    err = from_invalid_request(info.value)
    assert (err.status, err.type, err.param, err.code, err.message) == (
        400,
        "invalid_request_error",
        "top_p",
        "invalid_value",
        "top_p must be in [0, 1], got 1.5",
    )


def test_decode_error_inside_a_dict_value_names_the_dict():
    with pytest.raises(ApiError) as info:
        decode_chat_completion_request(
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
            b'"logit_bias": {"1": "a"}}'
        )
    err = info.value
    assert (err.param, err.code, err.message) == (
        "logit_bias",
        "invalid_type",
        "Invalid type for 'logit_bias': expected number, got string.",
    )
