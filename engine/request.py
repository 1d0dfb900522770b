"""A request as the engine sees it, and the per-step outputs it streams back."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarMatcher

DEFAULT_TENANT = "default"

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client went away or cancelled


@dataclass
class Sequence:
    """One generation: a prompt and the tokens produced so far.

    `num_computed_tokens` counts the tokens whose K/V are in the cache (from a prefix-cache
    hit or an earlier step). The scheduler advances it; preemption resets it to 0.
    """

    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str = ""
    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    priority: int = 0  # lower value = more urgent, as in vLLM
    cache_salt: str | None = None  # sequences with different salts never share cached KV
    eviction_policy: str = "none"  # per-session KV eviction: none / lru / sink / h2o
    max_kv_tokens: int | None = None  # this session's KV budget when eviction is on
    # The conversation whose KV this sequence's blocks stay pinned for once it finishes, so the
    # next turn prefills only its new tokens (engine.kv.manager: session pins); None: no pin.
    kv_session: str | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # The output's grammar state (engine.structured): each of a request's n choices gets its
    # own matcher of one CompiledGrammar. The engine advances it and drops it at the end.
    grammar: GrammarMatcher | None = field(default=None, repr=False, compare=False)
    # With sampling.prompt_logprobs: entry i scores prompt token i + 1 (engine.prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob) alternatives
    rank: int | None = None  # 1 for the most likely token; computed for prompt tokens


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None = None
    # Once, with the output that ends the prompt's prefill: entry i scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
