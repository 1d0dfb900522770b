"""Render chat messages into the prompt text the model was trained on.

A tokenizer that carries a chat template (transformers' `chat_template` +
`apply_chat_template`) renders with it. Otherwise - the embedded GGUF has no template - the
messages are rendered exactly as Gemma's official template does:

    <bos><start_of_turn>user
    {system}\\n\\n{first user text}<end_of_turn>
    <start_of_turn>model
    {assistant text}<end_of_turn>
    <start_of_turn>model

Gemma has no system role: a leading system (or developer) message is prepended to the first
user turn; texts are stripped of surrounding whitespace; assistant turns are "model" turns;
user and model turns must alternate.

BOS: by default the text returned does NOT start with BOS, because the tokenizer adds BOS
itself when encoding with special tokens - encode with special tokens and BOS appears once.
With include_bos=True the text starts with BOS as the template renders it; encode it without
special tokens.

Tools. A template that knows tools (Gemma 4's mentions `tools` and `tool_calls`) gets them as
OpenAI tool dicts, the assistant calls as `tool_calls: [{"id", "type": "function", "function":
{"name", "arguments": <dict>}}]` and the results as `{"role": "tool", "content",
"tool_call_id", "name"}`. Otherwise (no template, or Gemma 3's, which has no tools) the turns
are Gemma's with a pythonic tool format, the one compat.tool_parsers reads back:

    <start_of_turn>user
    {system}\n\n{tool instructions and declarations}\n\n{first user text}<end_of_turn>
    <start_of_turn>model
    [get_weather(city="Paris", days=3)]<end_of_turn>
    <start_of_turn>user
    ```tool_output
    {the result}
    ```<end_of_turn>
    <start_of_turn>model

An assistant turn with calls is its text (if any), a newline, then the calls as a Python list
with keyword arguments in Python literal syntax; consecutive tool results share one user turn
(a user message right after them joins it too), so user and model turns still alternate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from compat.errors import ApiError, invalid_value
from compat.request_types import ChatMessage
from compat.tools import ToolDefinition

GEMMA_BOS = "<bos>"
GEMMA_START_OF_TURN = "<start_of_turn>"
GEMMA_END_OF_TURN = "<end_of_turn>"  # a chat reply ends here: the caller stops on its token id

_SYSTEM_ROLES = ("system", "developer")

# The pythonic tool format's instructions, after any system text in the first user turn.
TOOLS_PREAMBLE = (
    "You can call the following functions, declared in JSON:\n"
    "{declarations}\n"
    "To call functions, reply with only a Python list of calls, with keyword arguments and "
    "Python literal values, such as [function_name(parameter=value, other=value), "
    "other_function()]. Do not write anything else when you call functions. "
    "Their results come back in ```tool_output blocks. "
    "If no function fits, answer normally.\n\n"
)
# Keys a request's chat_template_kwargs cannot set: render_chat_prompt's own arguments, and the
# template itself (a client does not choose the Jinja the server runs).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
     "return_dict", "return_tensors", "continue_final_message", "tokenizer_kwargs"}
)  # fmt: skip

ToolLike = ToolDefinition | Mapping[str, Any]


def _conversation(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as templates expect them; "developer" is OpenAI's newer name for "system".
    Assistant calls carry their arguments as dicts; a tool message names the function of the
    call it answers."""
    conversation: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for msg in messages:
        entry: dict[str, Any] = {
            "role": "system" if msg.role in _SYSTEM_ROLES else msg.role,
            "content": msg.text(),
        }
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in msg.tool_calls
            ]
            call_names.update((call.id, call.function.name) for call in msg.tool_calls)
        if msg.role == "tool":
            entry["tool_call_id"] = msg.tool_call_id
            name = call_names.get(msg.tool_call_id or "")
            if name is not None:
                entry.setdefault("name", name)
        conversation.append(entry)
    return conversation


def tool_dicts(tools: Sequence[ToolLike]) -> list[dict[str, Any]]:
    """OpenAI tool dicts ({"type": "function", "function": {...}}), unset fields left out."""
    result = []
    for tool in tools:
        if isinstance(tool, ToolDefinition):
            fn = tool.function
            given = {"name": fn.name, "description": fn.description, "parameters": fn.parameters}
        else:
            fn_dict = tool["function"]
            given = {key: fn_dict.get(key) for key in ("name", "description", "parameters")}
        function = {key: value for key, value in given.items() if value is not None}
        result.append({"type": "function", "function": function})
    return result


def python_literal(value: Any) -> str:
    """A JSON value in Python literal syntax (strings double-quoted, True, None)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        items = (
            f"{json.dumps(str(k), ensure_ascii=False)}: {python_literal(v)}"
            for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"not a JSON value: {value!r}")


def pythonic_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """`[name(a=1, b="x"), other()]`: calls as the pythonic tool format writes them."""
    return (
        "["
        + ", ".join(
            f"{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in args.items()) + ")"
            for name, args in calls
        )
        + "]"
    )


def _tools_preamble(tools: Sequence[ToolLike]) -> str:
    declarations = "\n".join(
        json.dumps(tool["function"], ensure_ascii=False) for tool in tool_dicts(tools)
    )
    return TOOLS_PREAMBLE.format(declarations=declarations)


def _turns(
    messages: Sequence[ChatMessage], tools: Sequence[ToolLike] | None
) -> tuple[str, list[tuple[str, str]]]:
    """(first-turn prefix, [(role, text)]) for Gemma's turns with the pythonic tool format."""
    prefix, offset = "", 0
    if messages[0].role in _SYSTEM_ROLES:
        prefix, offset = messages[0].text() + "\n\n", 1
    if tools:
        prefix += _tools_preamble(tools)
    turns: list[tuple[str, list[str]]] = []
    results_open = False  # the last turn is tool results, which a user message may join
    for i, msg in enumerate(messages[offset:], start=offset):
        if msg.role in _SYSTEM_ROLES:
            raise invalid_value(
                f"messages[{i}].role",
                "A system or developer message is only supported as the first message.",
            )
        if msg.role == "tool":
            block = f"```tool_output\n{msg.text().strip()}\n```"
            if results_open:
                turns[-1][1].append(block)
            else:
                turns.append(("user", [block]))
            results_open = True
            continue
        text = msg.text().strip()
        if msg.role == "assistant":
            if msg.tool_calls:
                calls = pythonic_calls(
                    [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
                )
                text = f"{text}\n{calls}" if text else calls
            turns.append(("model", [text]))
        elif results_open:
            turns[-1][1].append(text)
        else:
            turns.append(("user", [text]))
        results_open = False
    return prefix, [(role, "\n".join(parts)) for role, parts in turns]


def render_gemma_turns(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool = True,
    tools: Sequence[ToolLike] | None = None,
) -> str:
    """Gemma's turn format without the leading BOS; raises ApiError (400) on a conversation the
    format cannot express (roles out of turn, a system message after the first, no user turn).
    With tools, or calls and results in the history, the pythonic tool format is used."""
    if tools or any(msg.tool_calls or msg.role == "tool" for msg in messages):
        return _render_gemma_tool_turns(messages, add_generation_prompt, tools)
    conversation = _conversation(messages)
    prefix, offset = "", 0  # offset: index in `messages` of conversation[0]
    if conversation[0]["role"] == "system":
        prefix, offset = conversation[0]["content"] + "\n\n", 1
        conversation = conversation[1:]
        if not conversation:
            raise invalid_value("messages", "The conversation must contain a user message.")
    parts = []
    for i, turn in enumerate(conversation):
        if turn["role"] == "system":
            raise invalid_value(
                f"messages[{i + offset}].role",
                "A system or developer message is only supported as the first message.",
            )
        if (turn["role"] == "user") != (i % 2 == 0):
            raise invalid_value(
                "messages", "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        role = "model" if turn["role"] == "assistant" else "user"
        text = (prefix if i == 0 else "") + turn["content"].strip()
        parts.append(f"{GEMMA_START_OF_TURN}{role}\n{text}{GEMMA_END_OF_TURN}\n")
    if add_generation_prompt:
        parts.append(f"{GEMMA_START_OF_TURN}model\n")
    return "".join(parts)


def _render_gemma_tool_turns(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    tools: Sequence[ToolLike] | None,
) -> str:
    prefix, turns = _turns(messages, tools)
    if not turns:
        raise invalid_value("messages", "The conversation must contain a user message.")
    parts = []
    for i, (role, text) in enumerate(turns):
        if (role == "user") != (i % 2 == 0):
            raise invalid_value(
                "messages", "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        parts.append(
            f"{GEMMA_START_OF_TURN}{role}\n{prefix if i == 0 else ''}{text}{GEMMA_END_OF_TURN}\n"
        )
    if add_generation_prompt:
        parts.append(f"{GEMMA_START_OF_TURN}model\n")
    return "".join(parts)


def template_supports_tools(template: str) -> bool:
    """Whether a chat template renders tools and calls (Gemma 4's does, Gemma 3's does not)."""
    return "tools" in template and "tool_calls" in template


def render_chat_prompt(
    messages: Sequence[ChatMessage],
    tokenizer: object | None = None,
    *,
    add_generation_prompt: bool = True,
    include_bos: bool = False,
    tools: Sequence[ToolLike] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for `messages`, offering `tools` (a request's, or OpenAI tool dicts).

    `tokenizer` may be anything; its chat template is used when it has `chat_template` set and
    an `apply_chat_template` method (a transformers tokenizer), and its `bos_token` names BOS.
    A template that does not know tools is passed over for Gemma's turns with the pythonic tool
    format when the request has tools, calls or tool results. `chat_template_kwargs` go to the
    template as extra variables (e.g. `enable_thinking`), except those naming this function's
    own arguments or the template. Raises ApiError (400, param "messages") when the template
    refuses the conversation.
    """
    bos = getattr(tokenizer, "bos_token", None) or GEMMA_BOS
    template = getattr(tokenizer, "chat_template", None)
    uses_tools = bool(tools) or any(msg.tool_calls or msg.role == "tool" for msg in messages)
    if (
        template
        and hasattr(tokenizer, "apply_chat_template")
        and (not uses_tools or not isinstance(template, str) or template_supports_tools(template))
    ):
        extra = {
            key: value
            for key, value in (chat_template_kwargs or {}).items()
            if key not in _RESERVED_TEMPLATE_KWARGS
        }
        if tools:
            extra["tools"] = tool_dicts(tools)
        try:
            text = tokenizer.apply_chat_template(
                _conversation(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise ApiError(
                f"The conversation cannot be rendered with the model's chat template: {exc}",
                param="messages",
                code="invalid_value",
            ) from None
        if not include_bos and text.startswith(bos):
            text = text[len(bos) :]
        return text
    text = render_gemma_turns(messages, add_generation_prompt, tools)
    return bos + text if include_bos else text
