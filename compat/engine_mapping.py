"""From a validated OpenAI request to the engine's SamplingParams.

OpenAI defaults apply where the request leaves a field unset or null: temperature 1, top_p 1,
max_tokens 16 for completions and "the rest of the context" for chat. The engine's own checks
still run (SamplingParams validates itself); its refusals become the same 400 as ours.
"""

from __future__ import annotations

from collections.abc import Sequence

from compat.errors import context_length_exceeded, from_invalid_request, invalid_value
from compat.request_types import ChatCompletionRequest, CompletionRequest
from engine.sampling import InvalidRequestError, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def resolve_max_tokens(
    request: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    kv_capacity_tokens: int | None = None,
) -> int:
    """The completion budget: what was asked for, which must fit the context with the prompt;
    unset, 16 for completions (shortened if the context is nearly full) or all the room left
    for chat - but no more than a KV cache of `kv_capacity_tokens` can hold next to the prompt,
    so a request that asked for no length is not refused for the length it was given."""
    is_chat = isinstance(request, ChatCompletionRequest)
    prompt_param = request.prompt_param
    requested = (
        request.requested_max_tokens
        if isinstance(request, ChatCompletionRequest)
        else request.max_tokens
    )
    room = max_model_len - num_prompt_tokens
    if room < 1 and not (requested == 0 and room == 0):  # scoring a prompt needs no room
        raise context_length_exceeded(
            prompt_param,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens, leaving no room for the completion. Please "
            f"reduce the length of the {prompt_param}.",
        )
    max_param = request.max_tokens_param
    if requested is None:
        default = room if is_chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        if kv_capacity_tokens is not None:
            # A sequence holds prompt + max_tokens - 1 tokens of KV at most.
            default = min(default, max(1, kv_capacity_tokens - num_prompt_tokens + 1))
        return default
    if requested > room:
        raise context_length_exceeded(
            max_param,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Please reduce the length of the "
            f"{prompt_param} or the completion.",
        )
    return requested


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Token ids given by the client must exist in the vocabulary."""
    for token_id in token_ids:
        if token_id >= vocab_size:
            raise invalid_value(
                param,
                f"Token id {token_id} in '{param}' is out of range (vocabulary size {vocab_size}).",
            )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid_value(
                "logit_bias", f"'logit_bias' keys must be token ids, got {key!r}."
            ) from None
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise invalid_value("logit_bias", f"Token id {key} in 'logit_bias' is out of range.")
        bias[token_id] = value
    return bias


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int | None = None,
    extra_stop_token_ids: Sequence[int] = (),
    kv_capacity_tokens: int | None = None,
) -> SamplingParams:
    """SamplingParams for one prompt of `request`.

    `extra_stop_token_ids` are the model's end-of-turn ids for chat (e.g. <end_of_turn>); like
    EOS they are not added when the request sets ignore_eos. `vocab_size`, when given, bounds the
    client's token ids (logit_bias, stop_token_ids). `kv_capacity_tokens` caps a default
    max_tokens (see resolve_max_tokens). Raises ApiError (400).
    """
    stop = request.stop
    stop_token_ids = list(request.stop_token_ids or [])
    if vocab_size is not None:
        check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    if not request.ignore_eos:
        stop_token_ids += [t for t in extra_stop_token_ids if t not in stop_token_ids]
    prompt_logprobs = request.prompt_logprobs
    if isinstance(request, ChatCompletionRequest):
        logprobs = request.num_logprobs
    else:
        logprobs = request.logprobs
        if request.echo and logprobs is not None:  # the echoed prompt comes with its logprobs
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    try:
        return SamplingParams(
            max_tokens=resolve_max_tokens(
                request, num_prompt_tokens, max_model_len, kv_capacity_tokens
            ),
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0
            if request.repetition_penalty is None
            else request.repetition_penalty,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            seed=request.seed,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(request.ignore_eos),
            min_tokens=request.min_tokens or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
        )
    except InvalidRequestError as exc:
        raise from_invalid_request(exc) from None
