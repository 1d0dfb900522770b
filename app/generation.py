"""From a validated OpenAI request to engine sequences and back to OpenAI responses.

Transport-agnostic: the HTTP routes and the WebSocket endpoint both use it. Each prompt x n
choices becomes one engine sequence; `events()` merges their outputs into one stream of neutral
events (engine.events: text, tool-call deltas, finishes, usage), which a formatter
(compat.formatters, or the WebSocket's) turns into the wire's shape. A non-streamed response is
the fold of the same events.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import structlog

from compat.chat_output import ChatOutputPlan, ChoiceOutput, plan_chat_output
from compat.chat_template import GEMMA_END_OF_TURN, render_chat_prompt
from compat.engine_mapping import check_token_ids, to_sampling_params
from compat.errors import (
    ApiError,
    context_length_exceeded,
    invalid_value,
    rate_limited,
    server_shutting_down,
)
from compat.formatters import ChatFormatter, CompletionFormatter, ResponseMeta
from compat.logprobs import piece_bytes
from compat.request_types import ChatCompletionRequest, CompletionRequest
from compat.response_types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    new_chat_completion_id,
    new_completion_id,
)
from compat.structured import GrammarRequest, JsonStyle, grammar_error, requested_grammar
from compat.tool_parsers import ToolParser, parser_for
from compat.tools import resolve_tool_choice
from engine.async_engine import (
    AsyncEngine,
    EngineDraining,
    EngineOverloaded,
    RequestStream,
    RequestTooLarge,
)
from engine.detokenizer import IncrementalDetokenizer
from engine.events import (
    ChoiceTracker,
    Event,
    PromptScored,
    TextDelta,
    UsageReport,
    fold,
    usage_of,
)
from engine.request import DEFAULT_TENANT, Sequence, StepOutput
from engine.sampling import SamplingParams
from engine.structured import CompiledGrammar, InvalidGrammar

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
class Admitted:
    """A request whose sequences are in the engine (prompt-major, n choices per prompt)."""

    streams: list[RequestStream]
    n: int
    echo_texts: list[str]  # per prompt: what a completion with `echo` repeats first
    output: ChatOutputPlan | None = None  # how a chat's text becomes content and tool calls
    # Per prompt, where each prompt token's text begins in its echo, when the echo carries
    # the prompt's logprobs (sent once the prefill scored them); None: the echo goes first.
    echo_offsets: list[list[int]] | None = None

    # Each choice's counts, as `GenerationService.events` reads its outputs.
    trackers: list[ChoiceTracker] = field(default_factory=list)

    def output_for(self, choice: int) -> ChoiceOutput:
        """The per-choice reader of the generated text (tool calls, or plain text)."""
        return ChoiceOutput(choice, self.output)

    def usage_so_far(self) -> UsageReport:
        """The tokens of every prompt, and those generated up to the last output read."""
        prompts = [stream.seq for stream in self.streams[:: self.n]]
        return UsageReport(
            prompt_tokens=sum(seq.num_prompt_tokens for seq in prompts),
            completion_tokens=sum(t.completion_tokens for t in self.trackers),
            cached_tokens=sum(seq.num_cached_prompt_tokens for seq in prompts),
        )


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str  # for echo
    sampling: SamplingParams
    # The request's fields an error about its length names: the prompt's, the budget's.
    prompt_param: str
    max_tokens_param: str


class GenerationService:
    def __init__(
        self,
        engine: AsyncEngine,
        model_id: str,
        eviction_policy: str = "none",
        session_kv_tokens: int | None = None,
        json_style: JsonStyle = JsonStyle(),
        max_tool_calls: int = 4,
    ) -> None:
        self.engine = engine
        # How structured outputs' JSON is written (compat.structured), and the most calls in
        # one reply forced by tool_choice "required".
        self.json_style = json_style
        self.max_tool_calls = max_tool_calls
        self.model_id = model_id
        self.info = info = engine.info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eviction_policy = eviction_policy
        self.session_kv_tokens = session_kv_tokens
        # Caps an unset max_tokens; under an eviction policy the session budget bounds KV instead.
        self.kv_capacity_tokens = info.kv_capacity_tokens if eviction_policy == "none" else None
        end_of_turn = self.tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN)
        unk = self.tokenizer.unk_token_id
        self.chat_stop_ids = (
            [end_of_turn] if isinstance(end_of_turn, int) and end_of_turn != unk else []
        )
        self.tool_parser: ToolParser = parser_for(self.tokenizer)  # how the model writes calls

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
        # tool_choice "none": the model is not told of tools it may not call.
        tools = req.tools if resolve_tool_choice(req) != "none" else None
        text = render_chat_prompt(
            req.messages, self.tokenizer, tools=tools, chat_template_kwargs=req.chat_template_kwargs
        )
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
        grammar: CompiledGrammar | None = None,
    ) -> list[RequestStream]:
        """Submit every prompt x n choices; all or none are admitted (429/400 otherwise).
        `eviction_policy` and `kv_tokens` override the server's per-session defaults; each
        sequence follows its own matcher of `grammar`."""
        policy = eviction_policy or self.eviction_policy
        budget = (kv_tokens or self.session_kv_tokens) if policy != "none" else None
        queue_len = self.info.max_queue_len
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
                            grammar=None if grammar is None else grammar.matcher(),
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
        capacity = self.info.kv_capacity_tokens
        for prompt in prompts:
            if len(prompt.token_ids) > capacity:
                return context_length_exceeded(
                    prompt.prompt_param,
                    f"This server's KV cache holds at most {capacity} tokens of one request's "
                    f"context, but the prompt has {len(prompt.token_ids)} tokens. Please reduce "
                    f"the length of the {prompt.prompt_param}.",
                )
        return context_length_exceeded(prompts[0].max_tokens_param, message)

    async def compile_grammar(self, request: GrammarRequest | None) -> CompiledGrammar | None:
        """Compile (off the engine thread, cached by spec) what a request's output must match;
        a grammar that does not compile is a 400 naming the field that gave it."""
        if request is None:
            return None
        try:
            return await self.engine.grammars.compile(request.spec)
        except InvalidGrammar as exc:
            raise grammar_error(request.param, str(exc)) from None

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

    async def events(self, admitted: Admitted) -> AsyncIterator[Event]:
        """The generation as neutral events: each choice's echo, its text and tool calls as
        they come, its finish, then the usage of all choices."""
        n, scored_echo = admitted.n, admitted.echo_offsets
        trackers = [
            ChoiceTracker(i, tuple(stream.seq.prompt_token_ids))
            for i, stream in enumerate(admitted.streams)
        ]
        admitted.trackers = trackers
        outputs = [admitted.output_for(i) for i in range(len(trackers))]
        for i in range(len(trackers)):
            if (echo := admitted.echo_texts[i // n]) and scored_echo is None:
                yield TextDelta(i, echo, echo=True)
        async for index, out in self.merged(admitted.streams):
            for event in trackers[index].events(out):
                for shaped in outputs[index].shape(event):
                    yield shaped
                if isinstance(event, PromptScored) and scored_echo is not None:
                    offsets = tuple(scored_echo[index // n])
                    yield TextDelta(index, admitted.echo_texts[index // n], (), offsets, echo=True)
        yield usage_of(trackers, n)

    # ------------------------------------------------------------------ /v1/completions

    async def start_completion(self, req: CompletionRequest, identity: Identity) -> Admitted:
        """Validate, compile any grammar and admit (errors raise before anything is sent)."""
        prompts = self.prepare_completion(req)
        grammar = await self.compile_grammar(
            requested_grammar(None, req.structured_outputs, self.json_style)
        )
        streams = self.submit(
            prompts, req.num_choices, identity, priority=req.priority or 0,
            cache_salt=req.cache_salt, grammar=grammar,
        )  # fmt: skip
        echo = [p.text if req.echo else "" for p in prompts]
        offsets = None
        if req.echo and req.logprobs is not None:
            offsets = [
                self.text_offsets(p.token_ids, skip_special=isinstance(source, str))
                for p, source in zip(prompts, req.prompts(), strict=True)
            ]
        return Admitted(streams, req.num_choices, echo, echo_offsets=offsets)

    def text_offsets(self, token_ids: list[int], *, skip_special: bool) -> list[int]:
        """Where each token's text begins in the text of `token_ids`, decoded one token at a
        time as a stream would show them (special tokens as text unless `skip_special`)."""
        sampling = SamplingParams(
            max_tokens=len(token_ids), ignore_eos=True, skip_special_tokens=skip_special
        )
        detokenizer = IncrementalDetokenizer(self.tokenizer, [], sampling)
        offsets, length = [], 0
        for token in token_ids:
            offsets.append(length)
            length += len(detokenizer.update(token, None).text)
        return offsets

    def completion_formatter(
        self, req: CompletionRequest, admitted: Admitted | None = None
    ) -> CompletionFormatter:
        """`admitted`: the stream's generation, whose usage so far continuous usage reports."""
        return CompletionFormatter(
            ResponseMeta(new_completion_id(), int(time.time()), self.model_id),
            self.token_text, logprobs=req.logprobs is not None, include_usage=req.include_usage,
            prompt_logprobs=req.prompt_logprobs is not None,
            usage_so_far=_usage_so_far(req, admitted),
        )  # fmt: skip

    async def completion(self, req: CompletionRequest, identity: Identity) -> Completion:
        admitted = await self.start_completion(req, identity)
        folded = fold([event async for event in self.events(admitted)], len(admitted.streams))
        return self.completion_formatter(req).response(folded)

    async def completion_stream(
        self, req: CompletionRequest, identity: Identity
    ) -> AsyncIterator[Completion]:
        """Validate and admit now (errors raise before anything is sent), then stream."""
        admitted = await self.start_completion(req, identity)
        return _formatted(self.completion_formatter(req, admitted), self.events(admitted))

    # ------------------------------------------------------------------ /v1/chat/completions

    async def start_chat(
        self,
        req: ChatCompletionRequest,
        identity: Identity,
        *,
        eviction_policy: str | None = None,
        kv_tokens: int | None = None,
    ) -> Admitted:
        """Validate, compile any grammar and admit (errors raise before anything is sent)."""
        plan = plan_chat_output(req, self.tool_parser, self.json_style, self.max_tool_calls)
        prompt = self.prepare_chat(req)
        if plan.tool_parser is not None and plan.tool_parser.uses_special_tokens:
            prompt.sampling = replace(prompt.sampling, skip_special_tokens=False)
        grammar = await self.compile_grammar(plan.grammar)
        streams = self.submit(
            [prompt], req.num_choices, identity, priority=req.priority or 0,
            cache_salt=req.cache_salt, grammar=grammar, eviction_policy=eviction_policy,
            kv_tokens=kv_tokens,
        )  # fmt: skip
        return Admitted(streams, req.num_choices, [""], plan)

    def chat_formatter(
        self, req: ChatCompletionRequest, admitted: Admitted | None = None
    ) -> ChatFormatter:
        """`admitted`: the stream's generation, whose usage so far continuous usage reports."""
        return ChatFormatter(
            ResponseMeta(new_chat_completion_id(), int(time.time()), self.model_id),
            self.token_text, self.token_bytes, logprobs=bool(req.logprobs),
            include_usage=req.include_usage, prompt_logprobs=req.prompt_logprobs is not None,
            usage_so_far=_usage_so_far(req, admitted),
        )  # fmt: skip

    async def chat(self, req: ChatCompletionRequest, identity: Identity) -> ChatCompletion:
        admitted = await self.start_chat(req, identity)
        folded = fold([event async for event in self.events(admitted)], len(admitted.streams))
        return self.chat_formatter(req).response(folded)

    async def chat_stream(
        self, req: ChatCompletionRequest, identity: Identity
    ) -> AsyncIterator[ChatCompletionChunk]:
        """Validate and admit now (errors raise before anything is sent), then stream."""
        admitted = await self.start_chat(req, identity)
        formatter = self.chat_formatter(req, admitted)
        return _chat_chunks(formatter, admitted.n, self.events(admitted))


def _usage_so_far(
    req: CompletionRequest | ChatCompletionRequest, admitted: Admitted | None
) -> Callable[[], UsageReport] | None:
    """What stamps every chunk with the usage so far (stream_options.continuous_usage_stats)."""
    return admitted.usage_so_far if admitted is not None and req.continuous_usage else None


async def _formatted(
    formatter: CompletionFormatter | ChatFormatter, events: AsyncIterator[Event]
) -> AsyncIterator:
    async for event in events:
        if (chunk := formatter.chunk(event)) is not None:
            yield chunk


async def _chat_chunks(
    formatter: ChatFormatter, n: int, events: AsyncIterator[Event]
) -> AsyncIterator[ChatCompletionChunk]:
    for opening in formatter.opening(n):
        yield opening
    async for chunk in _formatted(formatter, events):
        yield chunk


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
