"""The offline Python API: load a model once, generate for a batch of prompts.

    llm = LLM()                                   # the embedded Gemma 3 270M
    results = llm.generate(["The sky is"], SamplingParams(max_tokens=16, temperature=0))
    print(results[0].text)

Every prompt becomes one sequence in the same continuous-batching engine the server runs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.build import build_engine, plan_engine
from engine.config import EngineConfig
from engine.events import ChoiceTracker, Event, fold
from engine.model.loader import LoadedModel
from engine.request import FinishReason, Sequence, TokenLogprob
from engine.sampling import InvalidRequestError, SamplingParams
from engine.sched.admission import AdmissionStatus

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int]  # text, or token ids


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(
        self,
        model: str | LoadedModel | None = None,
        backend: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        config: EngineConfig = EngineConfig(),
        weights: str | None = None,
        numerics: str | None = None,
    ) -> None:
        """An engine built as the server builds one (engine.build.build_engine), from `config`
        with any of its model settings given here instead: `model` a name for load_model(), or
        an already loaded model (loaded once and shared, e.g. by tests; the backend casts its
        weights to `dtype`); `backend`, `device`, `dtype`, and `weights` / `numerics` as the
        BACKEND, DEVICE, DTYPE, WEIGHTS and NUMERICS settings. The defaults are the server's:
        the embedded model with WEIGHTS=auto."""
        loaded = model if isinstance(model, LoadedModel) else None
        given: dict[str, str | None] = {
            "name": model if isinstance(model, str) else None,
            "backend": backend,
            "device": device,
            "dtype": dtype,
            "weights": weights,
            "numerics": numerics,
        }
        overrides = {name: value for name, value in given.items() if value is not None}
        config = replace(config, model=replace(config.model, **overrides))
        plan = plan_engine(config)
        self.device, self.dtype = plan.device, plan.dtype
        self.engine = build_engine(config, loaded, plan)
        self.model_id = self.engine.model_id
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (BOS added to text); token-id prompts are checked and kept."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return self.tokenizer(prompt).input_ids
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        vocab = self.engine.backend.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", "prompt"
            )
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling: SamplingParams | SequenceOf[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids) together; results in prompt order."""
        if _is_one_prompt(prompts):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("prompts must not be empty", "prompt")
        params = sampling or SamplingParams()
        params_list = (
            [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one", "sampling")
        seqs = []
        for prompt, p in zip(prompts, params_list, strict=True):
            p.validate()  # SamplingParams is mutable: check what is used, not what was built
            seq = Sequence(self.encode(prompt), p)
            if seq.num_prompt_tokens + p.max_tokens > self.engine.max_model_len:
                raise InvalidRequestError(
                    f"prompt ({seq.num_prompt_tokens} tokens) plus max_tokens ({p.max_tokens}) "
                    f"exceeds the model's context length {self.engine.max_model_len}",
                    "max_tokens",
                )
            seqs.append(seq)
        # The same events the server streams (engine.events), folded into each prompt's result.
        trackers = {seq.seq_id: ChoiceTracker(i) for i, seq in enumerate(seqs)}
        events: list[Event] = []
        # More prompts than the waiting queue holds are fed in as it drains.
        pending = deque(seqs)
        while pending or self.engine.has_work:
            while pending:
                result = self.engine.add(pending[0])
                if result.accepted:
                    pending.popleft()
                elif result.status is AdmissionStatus.TOO_LARGE or not self.engine.has_work:
                    for seq in seqs:
                        self.engine.abort(seq.seq_id)
                    raise InvalidRequestError(result.message, "prompt")
                else:
                    break  # queue full: retry after a step
            for seq, out in self.engine.step():
                if (tracker := trackers.get(seq.seq_id)) is not None:
                    events += tracker.events(out)
        self.engine.on_idle()
        folded = fold(events, len(seqs))
        return [
            GenerationResult(
                prompt_token_ids=seq.prompt_token_ids,
                token_ids=list(seq.output_token_ids),
                text=result.text,
                finish_reason=seq.finish_reason or FinishReason.STOP,
                logprobs=result.logprobs,
                num_cached_tokens=seq.num_cached_prompt_tokens,
            )
            for seq, result in zip(seqs, folded.choices, strict=True)
        ]


def _is_one_prompt(prompts: Prompt | SequenceOf[Prompt]) -> TypeIs[Prompt]:
    """Whether generate() got a single prompt rather than a sequence of prompts."""
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
