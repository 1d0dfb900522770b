"""`POST /v1/responses` on the chat machinery, with `previous_response_id` chained on KV.

A Responses request is served as the chat request that asks the same (compat.responses_input):
its output plan (tools, text format), sampling and grammar are the chat code's, and its events
go through compat.responses_format. What is new is the chain: a stored response keeps the token
ids of its prompt and output, and a response continuing it prompts with exactly those ids, then
the end-of-turn token if the output did not end with one, then the tokens of only the new part
of the rendered conversation. Every turn of a chain runs under one KV session
("responses:<first id>"), so the finished turn's blocks stay pinned and the next turn prefills
only its new tokens. When the new rendering does not extend the old one (other instructions or
tools, or a template that rewrites earlier turns), the conversation is rendered afresh and the
prefix cache still serves what matches.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import msgspec
import structlog

from app.generation import Admitted, GenerationService, Identity, PreparedPrompt
from app.response_store import ResponseStore, StoredResponse
from compat.chat_output import plan_chat_output
from compat.chat_template import GEMMA_END_OF_TURN, render_chat_prompt, tool_dicts
from compat.engine_mapping import to_sampling_params
from compat.errors import ApiError
from compat.request_types import ChatCompletionRequest, ChatMessage
from compat.responses_format import ResponsesFormatter
from compat.responses_input import as_chat_request, call_ids_of, input_messages, renamed
from compat.responses_types import (
    CreateResponseRequest,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionTool,
    InputItem,
    OutputMessage,
    Response,
    StreamEvent,
    TextConfig,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    TextFormatText,
    ToolChoiceFunction,
    ToolChoiceFunctionParam,
    new_item_id,
    now_s,
)
from compat.tools import AssistantFunctionCall, AssistantToolCall, resolve_tool_choice

log = structlog.get_logger(__name__)


def previous_not_found(response_id: str) -> ApiError:
    """OpenAI's answer to a previous_response_id it does not have (unknown, expired, deleted,
    never stored, or another tenant's)."""
    return ApiError(
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id", code="previous_response_not_found",
    )  # fmt: skip


def response_not_found(response_id: str) -> ApiError:
    return ApiError(
        f"Response with id '{response_id}' not found.", status=404, param="response_id",
        code="not_found",
    )  # fmt: skip


@dataclass
class ResponseRun:
    """An admitted response: its generation, how its events read, what it will store."""

    req: CreateResponseRequest
    admitted: Admitted
    formatter: ResponsesFormatter
    tenant: str
    chain: str
    messages: list[ChatMessage]  # instructions excluded
    system: list[ChatMessage]  # the instructions, as a system message
    chat: ChatCompletionRequest
    render_key: str
    forced_calls: bool  # the output is a grammar's JSON, not the template's own call format


class ResponsesService:
    def __init__(self, generation: GenerationService, store: ResponseStore) -> None:
        self.generation = generation
        self.store = store
        ids = generation.chat_stop_ids
        self.end_of_turn: int | None = ids[0] if ids else None

    # ------------------------------------------------------------------ admitting

    async def start(self, req: CreateResponseRequest, identity: Identity) -> ResponseRun:
        """Validate, compose the prompt, compile any grammar and admit; errors raise here,
        before anything is sent."""
        service = self.generation
        service.check_model(req.model)
        previous = None
        if req.previous_response_id is not None:
            previous = self.store.get(identity.tenant, req.previous_response_id)
            if previous is None:
                raise previous_not_found(req.previous_response_id)
        history = list(previous.messages) if previous is not None else []
        new = input_messages(req, call_ids_of(history))
        system = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
        chat = as_chat_request(req, [*system, *history, *new])
        try:
            plan = plan_chat_output(
                chat, service.tool_parser, service.json_style, service.max_tool_calls
            )
            tools = chat.tools if resolve_tool_choice(chat) != "none" else None
            key = json.dumps([req.instructions, tool_dicts(tools) if tools else None])
            ids = self._prompt_ids(chat.messages, system, history, tools, previous, key)
            sampling = to_sampling_params(
                chat, num_prompt_tokens=len(ids), max_model_len=service.max_model_len,
                vocab_size=service.vocab_size, extra_stop_token_ids=service.chat_stop_ids,
                kv_capacity_tokens=service.kv_capacity_tokens,
            )  # fmt: skip
        except ApiError as exc:
            raise renamed(exc) from None
        if plan.tool_parser is not None and plan.tool_parser.uses_special_tokens:
            sampling = replace(sampling, skip_special_tokens=False)
        grammar_request = plan.grammar
        if grammar_request is not None and grammar_request.param == "response_format":
            grammar_request = replace(grammar_request, param="text.format")
        grammar = await service.compile_grammar(grammar_request)
        response_id = new_item_id("resp")
        chain = previous.chain if previous is not None else f"responses:{response_id}"
        store = req.store is not False
        # Only a stored response can be continued: only its chain keeps KV pinned.
        identity = replace(identity, kv_session=chain if store else None)
        prompt = PreparedPrompt(ids, "", sampling, "input", "max_output_tokens")
        streams = service.submit([prompt], 1, identity, grammar=grammar)
        admitted = Admitted(streams, 1, [""], plan)
        formatter = ResponsesFormatter(self._base(req, response_id))
        return ResponseRun(
            req, admitted, formatter, identity.tenant, chain, [*history, *new], system, chat,
            key, forced_calls=plan.tool_mode in ("named", "required"),
        )  # fmt: skip

    def _prompt_ids(
        self,
        messages: list[ChatMessage],
        system: list[ChatMessage],
        history: list[ChatMessage],
        tools: object,
        previous: StoredResponse | None,
        key: str,
    ) -> list[int]:
        """The prompt's token ids: the previous response's own tokens continued by the new
        turns' when the rendering allows it, else the whole conversation rendered."""
        tokenizer = self.generation.tokenizer
        full = render_chat_prompt(messages, tokenizer, tools=tools)  # type: ignore[arg-type]
        if previous is None or previous.render_key != key or self.end_of_turn is None:
            return self.generation.encode_text(full)
        head = render_chat_prompt(
            [*system, *history], tokenizer, add_generation_prompt=False,
            tools=tools,  # type: ignore[arg-type]
        )  # fmt: skip
        cut = head.rfind(GEMMA_END_OF_TURN)
        if cut < 0 or not full.startswith(head):
            log.info("responses chain rendered afresh", previous=previous.id)
            return self.generation.encode_text(full)
        suffix = full[cut + len(GEMMA_END_OF_TURN) :]
        ids = list(previous.token_ids)
        if not ids or ids[-1] != self.end_of_turn:
            ids.append(self.end_of_turn)
        return ids + tokenizer(suffix, add_special_tokens=False).input_ids

    def _base(self, req: CreateResponseRequest, response_id: str) -> Response:
        """The Response as created: in progress, the request's settings echoed."""
        choice = req.tool_choice
        return Response(
            id=response_id,
            created_at=now_s(),
            status="in_progress",
            model=self.generation.model_id,
            output=[],
            instructions=req.instructions,
            tools=[
                FunctionTool(
                    name=t.name or "",
                    parameters=t.parameters,
                    strict=t.strict,
                    description=t.description,
                )
                for t in req.tools or []
            ],
            tool_choice=ToolChoiceFunction(name=choice.name or "")
            if isinstance(choice, ToolChoiceFunctionParam)
            else (choice or "auto"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            metadata=dict(req.metadata or {}),
            text=TextConfig(format=_text_format(req)),
            store=req.store is not False,
            previous_response_id=req.previous_response_id,
            max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls,
            user=msgspec.UNSET if req.user is None else req.user,
            safety_identifier=req.safety_identifier,
            prompt_cache_key=req.prompt_cache_key,
        )

    # ------------------------------------------------------------------ running

    async def stream(self, run: ResponseRun) -> AsyncIterator[StreamEvent]:
        """The response's stream events; the finished response is stored (if asked). An
        engine failure mid-stream ends it with an `error` event."""
        formatter = run.formatter
        for event in formatter.opening():
            yield event
        try:
            async for neutral in self.generation.events(run.admitted):
                for shaped in formatter.feed(neutral):
                    yield shaped
        except ApiError as exc:
            for failed in formatter.failed(exc.code, exc.message, exc.param):
                yield failed
            return
        self._store(run)

    async def create(self, run: ResponseRun) -> Response:
        async for _ in self.stream(run):
            pass
        assert run.formatter.final is not None  # the stream ended with the usage
        return run.formatter.final

    def _store(self, run: ResponseRun) -> None:
        response = run.formatter.final
        if response is None or not response.store or run.formatter.finish == "abort":
            return
        seq = run.admitted.streams[0].seq
        reply = _reply_message(response)
        token_ids = list(seq.prompt_token_ids)
        if run.forced_calls:
            # The grammar's JSON is not how the template writes calls: the next turn reads
            # the reply as rendered (its prompt part still hits the cache).
            token_ids += self._rendered_reply_ids(run, reply)
        else:
            token_ids += seq.output_token_ids
        self.store.put(
            StoredResponse(
                response=response,
                tenant=run.tenant,
                chain=run.chain,
                messages=[*run.messages, reply],
                token_ids=token_ids,
                render_key=run.render_key,
                input_items=_input_items(run.req),
            )
        )

    def _rendered_reply_ids(self, run: ResponseRun, reply: ChatMessage) -> list[int]:
        tokenizer = self.generation.tokenizer
        tools = run.chat.tools if resolve_tool_choice(run.chat) != "none" else None
        before = render_chat_prompt(run.chat.messages, tokenizer, tools=tools)
        after = render_chat_prompt(
            [*run.chat.messages, reply], tokenizer, add_generation_prompt=False, tools=tools
        )
        end = after.rfind(GEMMA_END_OF_TURN)
        if not after.startswith(before) or end < len(before):
            return []  # the next turn appends end-of-turn and its own text
        return tokenizer(after[len(before) : end], add_special_tokens=False).input_ids

    # ------------------------------------------------------------------ stored responses

    def retrieve(self, tenant: str, response_id: str) -> StoredResponse:
        record = self.store.get(tenant, response_id)
        if record is None:
            raise response_not_found(response_id)
        return record


def _text_format(
    req: CreateResponseRequest,
) -> TextFormatText | TextFormatJsonObject | TextFormatJsonSchema:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonObject):
        return TextFormatJsonObject()
    if isinstance(fmt, FormatJsonSchema):
        return TextFormatJsonSchema(
            name=fmt.name, schema=fmt.schema, strict=fmt.strict,
            description=msgspec.UNSET if fmt.description is None else fmt.description,
        )  # fmt: skip
    return TextFormatText()


def _reply_message(response: Response) -> ChatMessage:
    """The assistant message the conversation keeps for a response's output."""
    text = "".join(
        part.text
        for item in response.output
        if isinstance(item, OutputMessage)
        for part in item.content
    )
    calls = [
        AssistantToolCall(
            id=item.call_id,
            type="function",
            function=AssistantFunctionCall(item.name, item.arguments or "{}"),
        )
        for item in response.output
        if isinstance(item, FunctionCallItem)
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def _input_items(req: CreateResponseRequest) -> list[dict[str, object]]:
    """The request's input items as GET .../input_items lists them, each with an id."""
    if isinstance(req.input, str):
        items = [InputItem(type="message", role="user", content=req.input)]
    else:
        items = list(req.input or [])
    listed: list[dict[str, object]] = []
    for item in items:
        kind = item.type or "message"
        entry: dict[str, object] = {"type": kind}
        if kind == "message":
            part = "output_text" if item.role == "assistant" else "input_text"
            content = item.content
            parts: list[dict[str, object]] = (
                [{"type": part, "text": content}]
                if isinstance(content, str)
                else [{"type": p.type, "text": p.text or ""} for p in content or []]
            )
            if item.role == "assistant":
                for p in parts:
                    p |= {"annotations": [], "logprobs": []}
            entry |= {"id": item.id or new_item_id("msg"), "role": item.role,
                      "content": parts, "status": item.status or "completed"}  # fmt: skip
        elif kind == "function_call":
            entry |= {"id": item.id or new_item_id("fc"), "call_id": item.call_id,
                      "name": item.name, "arguments": item.arguments,
                      "status": item.status or "completed"}  # fmt: skip
        else:
            output = item.output
            text = (
                output if isinstance(output, str) else "".join(p.text or "" for p in output or [])
            )
            entry |= {"id": item.id or new_item_id("fco"), "call_id": item.call_id,
                      "output": text, "status": item.status or "completed"}  # fmt: skip
        listed.append(entry)
    return listed
