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
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2

from compat.errors import ApiError, invalid_value
from compat.request_types import ChatMessage

GEMMA_BOS = "<bos>"
GEMMA_START_OF_TURN = "<start_of_turn>"
GEMMA_END_OF_TURN = "<end_of_turn>"  # a chat reply ends here: the caller stops on its token id

_SYSTEM_ROLES = ("system", "developer")


def _conversation(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Messages as templates expect them; "developer" is OpenAI's newer name for "system"."""
    conversation = []
    for msg in messages:
        entry = {"role": "system" if msg.role in _SYSTEM_ROLES else msg.role, "content": msg.text()}
        if msg.name is not None:
            entry["name"] = msg.name
        conversation.append(entry)
    return conversation


def render_gemma_turns(messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
    """Gemma's turn format without the leading BOS; raises ApiError (400) on a conversation the
    format cannot express (roles out of turn, a system message after the first, no user turn)."""
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


def render_chat_prompt(
    messages: Sequence[ChatMessage],
    tokenizer: object | None = None,
    *,
    add_generation_prompt: bool = True,
    include_bos: bool = False,
) -> str:
    """The prompt text for `messages`.

    `tokenizer` may be anything; its chat template is used when it has `chat_template` set and
    an `apply_chat_template` method (a transformers tokenizer), and its `bos_token` names BOS.
    Raises ApiError (400, param "messages") when the template refuses the conversation.
    """
    bos = getattr(tokenizer, "bos_token", None) or GEMMA_BOS
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        try:
            text = tokenizer.apply_chat_template(
                _conversation(messages), tokenize=False, add_generation_prompt=add_generation_prompt
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
    text = render_gemma_turns(messages, add_generation_prompt)
    return bos + text if include_bos else text
