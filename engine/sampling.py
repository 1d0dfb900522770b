"""Sampling parameters of one request.

The batched sampler that applies them lives in `engine.sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by a smaller one overflows float32.
GREEDY_TEMPERATURE = 1e-5


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return; None: no logprobs
    # The same for the prompt's own tokens (engine.prompt_logprobs). Such a sequence reads no
    # KV from the prefix cache: every prompt position's logits are needed.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Special tokens' text is left out of the output, except where it carries meaning (Gemma
    # 4's tool-call tokens, which the tool parser reads).
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        # 0: the prompt alone is computed (scoring it, or warming the prefix cache).
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidRequestError(
                f"max_tokens must be a non-negative integer, got {self.max_tokens!r}",
                "max_tokens",
            )
        if self.temperature < 0.0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", "temperature"
            )
        if not 0.0 <= self.top_p <= 1.0:  # 0, as in OpenAI's API: the most likely token only
            raise InvalidRequestError(f"top_p must be in [0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
                "presence_penalty",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                "frequency_penalty",
            )
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                "prompt_logprobs",
            )
        for token_id, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    f"logit_bias for token {token_id} must be in [-100, 100], got {bias}",
                    "logit_bias",
                )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
