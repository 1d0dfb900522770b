"""OpenAI-shaped errors: one exception for every failure the gateway reports, and its JSON body.

Body: {"error": {"message", "type", "param", "code"}}. The `type` follows OpenAI's own API,
which reports bad requests, bad keys and unknown models alike as "invalid_request_error" and
puts the detail in `code` (e.g. "invalid_api_key", "model_not_found").
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from engine.sampling import InvalidRequestError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def error_type_for_status(status: int) -> str:
    """The OpenAI error `type` for an HTTP status: client errors are invalid requests."""
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    """The JSON body OpenAI clients expect for an error (encode with msgspec.json.encode)."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))


class ApiError(Exception):
    """A request the server refuses, with everything needed for the HTTP response.

    `headers` carries response headers the status needs, e.g. Retry-After on a 429.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or error_type_for_status(status)
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return (
            f"ApiError(status={self.status}, param={self.param!r}, code={self.code!r}, "
            f"message={self.message!r})"
        )


# --- errors the gateway raises ---------------------------------------------------------------


def missing_api_key() -> ApiError:
    return ApiError(
        "You didn't provide an API key. Provide it in the Authorization header "
        "(Authorization: Bearer YOUR_KEY).",
        status=401,
        code="missing_api_key",
    )


def invalid_api_key() -> ApiError:
    # The key itself is never echoed back.
    return ApiError("Incorrect API key provided.", status=401, code="invalid_api_key")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found"
    )


def route_not_found(method: str, path: str) -> ApiError:
    return ApiError(f"Invalid URL ({method} {path})", status=404, code="not_found")


def request_too_large(limit_bytes: int) -> ApiError:
    return ApiError(
        f"The request body is larger than the limit of {limit_bytes} bytes.",
        status=413,
        code="request_too_large",
    )


def unsupported_media_type(got: str | None) -> ApiError:
    """415: a body that does not say it is JSON (what a cross-site form or text/plain fetch
    sends); the message says what to send instead."""
    what = repr(got) if got else "no Content-Type header"
    return ApiError(
        f"Content-Type must be application/json; got {what}. Send the body as JSON with the "
        "header `Content-Type: application/json` (curl: -H 'Content-Type: application/json').",
        status=415,
        code="unsupported_media_type",
    )


def rate_limited(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        message,
        status=429,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def server_error(
    message: str = "The server had an error while processing your request.",
) -> ApiError:
    return ApiError(message, status=500, code="internal_error")


def server_shutting_down(message: str) -> ApiError:
    """503: this server is draining before it stops; another instance can take the request."""
    return ApiError(message, status=503, code="server_shutting_down")


def unsupported_parameter(param: str, reason: str) -> ApiError:
    return ApiError(
        f"Unsupported parameter: '{param}' is not supported by this server: {reason}",
        param=param,
        code="unsupported_parameter",
    )


def unsupported_value(param: str, value: object, reason: str) -> ApiError:
    return ApiError(
        f"Unsupported value: '{param}' does not support {value!r} on this server: {reason}",
        param=param,
        code="unsupported_value",
    )


def invalid_value(param: str | None, message: str) -> ApiError:
    return ApiError(message, param=param, code="invalid_value")


def context_length_exceeded(param: str, message: str) -> ApiError:
    """The request does not fit: `param` names the prompt when it alone is too long, else the
    completion budget (max_tokens), as OpenAI reports it."""
    return ApiError(message, param=param, code="context_length_exceeded")


def from_invalid_request(exc: InvalidRequestError) -> ApiError:
    """The engine refused the request's parameters: a 400 naming the same field."""
    return invalid_value(exc.param, str(exc))


# --- msgspec decode errors -> 400 naming the field ---------------------------------------------

# msgspec appends " - at `$.path`" to every error below the top level.
_AT_PATH = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_WRONG_TYPE = re.compile(r"^Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)`$")
_TYPE_NAME = re.compile(r"`([^`]+)`")
_JSON_NAMES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "array": "array",
    "object": "object",
    "null": "null",
}


def _json_type(msgspec_type: str) -> str:
    """`float | null` -> `number or null`, in JSON's vocabulary rather than Python's."""
    return " or ".join(_JSON_NAMES.get(t.strip(), t.strip()) for t in msgspec_type.split("|"))


def _param_from_path(path: str) -> str | None:
    """`.messages[0].content` -> `messages[0].content`; dict-value markers are dropped."""
    param = path.replace("[...]", "").lstrip(".")
    return param or None


def _join(parent: str | None, field: str) -> str:
    return f"{parent}.{field}" if parent else field


def too_deeply_nested(what: str = "the JSON body of your request") -> ApiError:
    """msgspec gives up on deep nesting with a RecursionError, which is no DecodeError."""
    return ApiError(f"We could not parse {what}: it is nested too deeply.", code="invalid_json")


def is_unknown_field_error(exc: msgspec.ValidationError) -> bool:
    """Whether msgspec refused the body for a field its type does not declare."""
    match = _AT_PATH.match(str(exc))
    return match is not None and _UNKNOWN.match(match["detail"]) is not None


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """Turn a msgspec decode/validation error into a 400 that names the offending field."""
    if not isinstance(exc, msgspec.ValidationError):
        return ApiError(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        )
    match = _AT_PATH.match(str(exc))
    assert match is not None  # the pattern matches every string
    detail, parent = match["detail"], _param_from_path(match["path"] or "")
    if m := _MISSING.match(detail):
        param = _join(parent, m["field"])
        return ApiError(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if m := _UNKNOWN.match(detail):
        param = _join(parent, m["field"])
        return ApiError(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if m := _WRONG_TYPE.match(detail):
        expected, got = _json_type(m["expected"]), _json_type(m["got"])
        where = f"for '{parent}'" if parent else "for the request body"
        return ApiError(
            f"Invalid type {where}: expected {expected}, got {got}.",
            param=parent,
            code="invalid_type",
        )
    # Constraint violations: "Expected `float` <= 2.0", "Invalid enum value 'x'", ...
    readable = _TYPE_NAME.sub(lambda t: _json_type(t.group(1)), detail)
    readable = readable[0].lower() + readable[1:]
    where = f"for '{parent}'" if parent else "in the request body"
    return ApiError(f"Invalid value {where}: {readable}.", param=parent, code="invalid_value")
