"""From a validated OpenAI request to engine sequences and back to OpenAI responses.

Transport-agnostic: the HTTP routes and the WebSocket endpoint both use it. Each prompt x n
choices becomes one engine sequence; their outputs are merged into one response, or one stream
of chunks in OpenAI's exact order.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import structlog
from msgspec import UNSET

from compat.chat_template import GEMMA_END_OF_TURN, render_chat_prompt
from compat.engine_mapping import check_token_ids, to_sampling_params
from compat.errors import (
    ApiError,
    context_length_exceeded,
    invalid_value,
    rate_limited,
    server_shutting_down,
)
from compat.logprobs import chat_logprobs, completion_logprobs, piece_bytes
from compat.request_types import ChatCompletionRequest, CompletionRequest
from compat.response_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    Usage,
    make_usage,
    new_chat_completion_id,
    new_completion_id,
)
from compat.response_types import FinishReason as OpenAIFinishReason
from engine.async_engine import (
    AsyncEngine,
    EngineDraining,
    EngineOverloaded,
    RequestStream,
    RequestTooLarge,
)
from engine.request import DEFAULT_TENANT, FinishReason, Sequence, StepOutput, TokenLogprob
from engine.sampling import SamplingParams

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Identity:
    """Who is asking: the tenant (fairness) and the conversation (session)."""

    tenant: str = DEFAULT_TENANT
    session_id: str | None = None
    # The conversation whose KV stays pinned between turns (a WebSocket session, or a chat with
    # X-Session-Id); None: nothing is pinned.
    kv_session: str | None = None


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str  # for echo
    sampling: SamplingParams
    # The request's fields an error about its length names: the prompt's, the budget's.
    prompt_param: str
    max_tokens_param: str


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # per logprobs entry
    text_length: int = 0  # of the text so far
    finish_reason: FinishReason | None = None

    def add(self, out: StepOutput) -> list[int]:
        """Record one step; returns where its logprobs entries' tokens begin in the text."""
        # Where the text before the step ends: the detokenizer shows a character split over
        # byte tokens with its last one, so no offset passes the text, and a stream agrees
        # with the whole response.
        offsets = [self.text_length] * len(out.logprobs or [])
        self.text_length += len(out.new_text)
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs or [])
        self.text_offsets.extend(offsets)
        self.prompt_tokens = out.num_prompt_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
        return offsets


def openai_finish_reason(reason: FinishReason | None) -> OpenAIFinishReason:
    return "length" if reason is FinishReason.LENGTH else "stop"


class GenerationService:
    def __init__(
        self,
        engine: AsyncEngine,
        model_id: str,
        eviction_policy: str = "none",
        session_kv_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.backend.vocab_size
        self.eviction_policy = eviction_policy
        self.session_kv_tokens = session_kv_tokens
        # Caps an unset max_tokens; under an eviction policy the session budget bounds KV instead.
        self.kv_capacity_tokens = (
            engine.engine.scheduler.kv_capacity_tokens if eviction_policy == "none" else None
        )
        end_of_turn = self.tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN)
        unk = self.tokenizer.unk_token_id
        self.chat_stop_ids = (
            [end_of_turn] if isinstance(end_of_turn, int) and end_of_turn != unk else []
        )

    # ------------------------------------------------------------------ preparing

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise ApiError(
                f"The model `{model}` does not exist.", status=404, param="model",
                code="model_not_found",
            )  # fmt: skip

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids)
        assert isinstance(text, str)  # one list of ids decodes to one string
        return text

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, from its vocabulary piece: decoding a byte-fallback token
        alone gives U+FFFD, not its byte."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        assert isinstance(piece, str)  # one id converts to one piece
        return piece_bytes(piece)

    def prepare_completion(self, req: CompletionRequest) -> list[PreparedPrompt]:
        self.check_model(req.model)
        prepared = []
        for i, prompt in enumerate(req.prompts()):
            if isinstance(prompt, str):
                ids, text = self.encode_text(prompt), prompt
            else:
                check_token_ids(prompt, self.vocab_size, f"prompt[{i}]" if i else "prompt")
                ids, text = list(prompt), self.decode(prompt)
            sampling = to_sampling_params(
                req, num_prompt_tokens=len(ids), max_model_len=self.max_model_len,
                vocab_size=self.vocab_size, kv_capacity_tokens=self.kv_capacity_tokens,
            )  # fmt: skip
            prepared.append(
                PreparedPrompt(ids, text, sampling, req.prompt_param, req.max_tokens_param)
            )
        return prepared

    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedPrompt:
        self.check_model(req.model)
        text = render_chat_prompt(req.messages, self.tokenizer)
        ids = self.encode_text(text)
        sampling = to_sampling_params(
            req, num_prompt_tokens=len(ids), max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, extra_stop_token_ids=self.chat_stop_ids,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )  # fmt: skip
        return PreparedPrompt(ids, text, sampling, req.prompt_param, req.max_tokens_param)

    # ------------------------------------------------------------------ running

    def submit(
        self,
        prompts: list[PreparedPrompt],
        n: int,
        identity: Identity,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        eviction_policy: str | None = None,
        kv_tokens: int | None = None,
    ) -> list[RequestStream]:
        """Submit every prompt x n choices; all or none are admitted (429/400 otherwise).
        `eviction_policy` and `kv_tokens` override the server's per-session defaults."""
        policy = eviction_policy or self.eviction_policy
        budget = (kv_tokens or self.session_kv_tokens) if policy != "none" else None
        queue_len = self.engine.engine.scheduler.config.max_queue_len
        if len(prompts) * n > queue_len:  # could never be admitted: retrying (429) cannot help
            raise invalid_value(
                "n" if n > 1 else "prompt",
                f"This request asks for {len(prompts) * n} sequences (prompts x n), but the "
                f"server queues at most {queue_len} at once.",
            )
        streams: list[RequestStream] = []
        try:
            with self.engine.submitting_together():  # all choices start in one step
                for prompt in prompts:
                    for choice in range(n):
                        seq = Sequence(
                            prompt.token_ids,
                            _choice_sampling(prompt.sampling, choice),
                            request_id=uuid.uuid4().hex,
                            tenant=identity.tenant,
                            session_id=identity.session_id,
                            priority=priority,
                            cache_salt=cache_salt,
                            eviction_policy=policy,
                            max_kv_tokens=budget,
                            # One pin per conversation: a turn with several choices pins none.
                            kv_session=identity.kv_session if len(prompts) * n == 1 else None,
                        )
                        streams.append(self.engine.submit(seq))
        except EngineOverloaded as exc:
            for stream in streams:
                stream.abort()
            raise rate_limited(str(exc), exc.retry_after_s) from None
        except RequestTooLarge as exc:
            for stream in streams:
                stream.abort()
            raise self._too_large_for_kv(prompts, str(exc)) from None
        except EngineDraining as exc:
            for stream in streams:
                stream.abort()
            raise server_shutting_down(str(exc)) from None
        log.info(
            "generation admitted", tenant=identity.tenant, session=identity.session_id,
            sequences=len(streams), prompt_tokens=sum(len(p.token_ids) for p in prompts),
        )  # fmt: skip
        return streams

    def _too_large_for_kv(self, prompts: list[PreparedPrompt], message: str) -> ApiError:
        """The KV cache can never hold the request. As for the context length, the error names
        the prompt when it alone does not fit (max_tokens 1 would not help), else max_tokens."""
        capacity = self.engine.engine.scheduler.kv_capacity_tokens
        for prompt in prompts:
            if len(prompt.token_ids) > capacity:
                return context_length_exceeded(
                    prompt.prompt_param,
                    f"This server's KV cache holds at most {capacity} tokens of one request's "
                    f"context, but the prompt has {len(prompt.token_ids)} tokens. Please reduce "
                    f"the length of the {prompt.prompt_param}.",
                )
        return context_length_exceeded(prompts[0].max_tokens_param, message)

    def _submit_request(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[PreparedPrompt],
        identity: Identity,
    ) -> list[RequestStream]:
        """submit() with the request's choices, priority and cache salt."""
        return self.submit(
            prompts, req.num_choices, identity, priority=req.priority or 0,
            cache_salt=req.cache_salt,
        )  # fmt: skip

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, output) from all streams as they arrive; aborts all on exit."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((index, out))
            except Exception as exc:  # surfaced to the consumer below
                await queue.put((index, exc))
            await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise _stream_error(item)
                else:
                    yield index, item
        finally:
            for stream in streams:
                stream.abort()
            for task in tasks:
                task.cancel()
            log.info(
                "generation finished" if remaining == 0 else "generation aborted",
                sequences=len(streams),
                completion_tokens=sum(s.seq.num_output_tokens for s in streams),
            )

    # ------------------------------------------------------------------ /v1/completions

    async def completion(self, req: CompletionRequest, identity: Identity) -> Completion:
        prompts = self.prepare_completion(req)
        n = req.num_choices
        streams = self._submit_request(req, prompts, identity)
        choices = [ChoiceState(i) for i in range(len(streams))]
        async for index, out in self.merged(streams):
            choices[index].add(out)
        return Completion(
            id=new_completion_id(),
            created=int(time.time()),
            model=self.model_id,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=(prompts[c.index // n].text if req.echo else "") + "".join(c.text),
                    logprobs=completion_logprobs(c.logprobs, self.token_text, c.text_offsets)
                    if req.logprobs is not None
                    else None,
                    finish_reason=openai_finish_reason(c.finish_reason),
                )
                for c in choices
            ],
            usage=usage_of(choices, n),
        )

    async def completion_stream(
        self, req: CompletionRequest, identity: Identity
    ) -> AsyncIterator[Completion]:
        """Validate and admit now (errors raise before anything is sent), then stream."""
        prompts = self.prepare_completion(req)
        n = req.num_choices
        streams = self._submit_request(req, prompts, identity)
        return self._completion_chunks(req, prompts, n, streams)

    async def _completion_chunks(
        self, req: CompletionRequest, prompts: list[PreparedPrompt], n: int,
        streams: list[RequestStream],
    ) -> AsyncIterator[Completion]:  # fmt: skip
        completion_id, created = new_completion_id(), int(time.time())
        choices = [ChoiceState(i) for i in range(len(streams))]

        def chunk(choice: CompletionChoice) -> Completion:
            # No `usage: null` (chat chunks have it): the spec's completion usage is not nullable.
            return Completion(
                id=completion_id, created=created, model=self.model_id, choices=[choice]
            )

        if req.echo:
            for i in range(len(streams)):
                yield chunk(CompletionChoice(index=i, text=prompts[i // n].text))
        async for index, out in self.merged(streams):
            offsets = choices[index].add(out)
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(out.logprobs or [], self.token_text, offsets)
            if out.new_text or out.finished or logprobs is not None:
                yield chunk(
                    CompletionChoice(
                        index=index,
                        text=out.new_text,
                        logprobs=logprobs,
                        finish_reason=openai_finish_reason(out.finish_reason)
                        if out.finished
                        else None,
                    )
                )
        if req.include_usage:
            yield Completion(
                id=completion_id, created=created, model=self.model_id, choices=[],
                usage=usage_of(choices, n),
            )  # fmt: skip

    # ------------------------------------------------------------------ /v1/chat/completions

    async def chat(self, req: ChatCompletionRequest, identity: Identity) -> ChatCompletion:
        prompt = self.prepare_chat(req)
        n = req.num_choices
        streams = self._submit_request(req, [prompt], identity)
        choices = [ChoiceState(i) for i in range(n)]
        async for index, out in self.merged(streams):
            choices[index].add(out)
        return ChatCompletion(
            id=new_chat_completion_id(),
            created=int(time.time()),
            model=self.model_id,
            choices=[
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content="".join(c.text)),
                    logprobs=chat_logprobs(c.logprobs, self.token_text, self.token_bytes)
                    if req.logprobs
                    else None,
                    finish_reason=openai_finish_reason(c.finish_reason),
                )
                for c in choices
            ],
            usage=usage_of(choices, n),
        )

    async def chat_stream(
        self, req: ChatCompletionRequest, identity: Identity
    ) -> AsyncIterator[ChatCompletionChunk]:
        """Validate and admit now (errors raise before anything is sent), then stream."""
        prompt = self.prepare_chat(req)
        n = req.num_choices
        streams = self._submit_request(req, [prompt], identity)
        return self._chat_chunks(req, n, streams)

    async def _chat_chunks(
        self, req: ChatCompletionRequest, n: int, streams: list[RequestStream]
    ) -> AsyncIterator[ChatCompletionChunk]:
        chunk_id, created = new_chat_completion_id(), int(time.time())
        choices = [ChoiceState(i) for i in range(n)]

        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=chunk_id, created=created, model=self.model_id, choices=[choice],
                usage=None if req.include_usage else UNSET,
            )  # fmt: skip

        for i in range(n):
            yield chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        async for index, out in self.merged(streams):
            choices[index].add(out)
            logprobs = (
                chat_logprobs(out.logprobs or [], self.token_text, self.token_bytes)
                if req.logprobs
                else None
            )
            if out.new_text or logprobs is not None:
                yield chunk(
                    ChatChunkChoice(
                        index=index, delta=ChatDelta(content=out.new_text), logprobs=logprobs
                    )
                )
            if out.finished:
                yield chunk(
                    ChatChunkChoice(
                        index=index,
                        delta=ChatDelta(),
                        finish_reason=openai_finish_reason(out.finish_reason),
                    )
                )
        if req.include_usage:
            yield ChatCompletionChunk(
                id=chunk_id, created=created, model=self.model_id, choices=[],
                usage=usage_of(choices, n),
            )  # fmt: skip


def _stream_error(exc: Exception) -> ApiError:
    """What a client is told when the engine ended its generation with an error: a 503 when
    the server cut it to shut down, else a 500."""
    if isinstance(exc, EngineDraining):
        return server_shutting_down(str(exc))
    return ApiError(str(exc), status=500, code="internal_error")


def _choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The n choices of one prompt are independent samples: a seeded request gives choice i
    the seed `seed + i`, so it stays reproducible without n identical answers."""
    if sampling.seed is None or choice == 0:
        return sampling
    return replace(sampling, seed=sampling.seed + choice)


def usage_of(choices: list[ChoiceState], n: int) -> Usage:
    """Prompt tokens count once per prompt (not per choice), as OpenAI reports them."""
    prompt_tokens = sum(c.prompt_tokens for c in choices[::n])
    cached = sum(c.cached_tokens for c in choices[::n])
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return make_usage(prompt_tokens, completion_tokens, cached)
