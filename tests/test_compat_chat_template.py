"""Chat messages -> prompt text: a tokenizer's own template, and Gemma's turn format fallback."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from compat.chat_template import GEMMA_END_OF_TURN, render_chat_prompt, render_gemma_turns
from compat.errors import ApiError
from compat.request_types import ChatMessage, ContentPart

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ["user", "model", "system", "Hi", "Hello", "!", "Again", "Be", "brief", "."]

# Our own Jinja rendering of Gemma's documented turn format, to check that a tokenizer template
# and the built-in fallback produce the same prompt.
GEMMA_FORMAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(prefix='') %}"
    "{% if messages[0].role == 'system' %}"
    "{% set ns.prefix = messages[0].content + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ ns.prefix if loop.first else '' }}{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A tiny word-level tokenizer that, like Gemma's, adds BOS when encoding special tokens."""
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def msg(role: str, content: str | list[str], name: str | None = None) -> ChatMessage:
    if isinstance(content, list):
        return ChatMessage(
            role=role, content=[ContentPart(type="text", text=t) for t in content], name=name
        )
    return ChatMessage(role=role, content=content, name=name)


CONVERSATION = [
    msg("system", " Be brief. "),
    msg("user", "  Hi \n"),
    msg("assistant", "Hello!"),
    msg("user", "Again"),
]
CONVERSATION_TEXT = (
    "<start_of_turn>user\n Be brief. \n\nHi<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nAgain<end_of_turn>\n"
    "<start_of_turn>model\n"
)


# --- Gemma's turn format (no template on the tokenizer) ---------------------------------------


def test_single_user_turn():
    assert render_chat_prompt([msg("user", "Hi")]) == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render_chat_prompt([msg("user", "Hi")], include_bos=True) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_system_prompt_joins_the_first_user_turn_untrimmed():
    assert render_chat_prompt(CONVERSATION) == CONVERSATION_TEXT


def test_developer_is_a_system_message():
    developer = [msg("developer", " Be brief. "), *CONVERSATION[1:]]
    assert render_chat_prompt(developer) == CONVERSATION_TEXT


def test_without_generation_prompt():
    assert render_gemma_turns(
        [msg("user", "Hi"), msg("assistant", "Hello")], add_generation_prompt=False
    ) == ("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n")


def test_text_parts_are_joined_with_newlines():
    assert render_chat_prompt([msg("user", ["Hi", "there "])]) == (
        "<start_of_turn>user\nHi\nthere<end_of_turn>\n<start_of_turn>model\n"
    )


def test_tokenizer_without_template_uses_gemma_format_and_its_bos():
    tokenizer = make_tokenizer(chat_template=None)
    tokenizer.bos_token = "<s>"
    assert render_chat_prompt([msg("user", "Hi")], tokenizer, include_bos=True) == (
        "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )


def test_end_of_turn_marker():
    assert GEMMA_END_OF_TURN == "<end_of_turn>"


@pytest.mark.parametrize(
    "messages, param, message",
    [
        (
            [msg("user", "a"), msg("user", "b")],
            "messages",
            "Conversation roles must alternate user/assistant/user/assistant/...",
        ),
        (
            [msg("system", "s"), msg("assistant", "a")],
            "messages",
            "Conversation roles must alternate user/assistant/user/assistant/...",
        ),
        ([msg("system", "s")], "messages", "The conversation must contain a user message."),
        (
            [msg("user", "a"), msg("system", "s")],
            "messages[1].role",
            "A system or developer message is only supported as the first message.",
        ),
        (
            [msg("system", "s"), msg("user", "a"), msg("developer", "d")],
            "messages[2].role",
            "A system or developer message is only supported as the first message.",
        ),
    ],
)
def test_conversations_gemma_refuses(messages, param, message):
    with pytest.raises(ApiError) as info:
        render_chat_prompt(messages)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


# --- a tokenizer with its own chat template ---------------------------------------------------


def test_tokenizer_template_is_used_and_bos_is_left_to_the_encoder():
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "[{{ m.role }}{% if m.name %}/{{ m.name }}{% endif %}:{{ m.content }}]{% endfor %}"
        "{% if add_generation_prompt %}[model]{% endif %}"
    )
    tokenizer = make_tokenizer(template)
    messages = [msg("developer", "S"), msg("user", "Hi", name="ann")]
    assert render_chat_prompt(messages, tokenizer) == "[system:S][user/ann:Hi][model]"
    assert (
        render_chat_prompt(messages, tokenizer, include_bos=True)
        == "<bos>[system:S][user/ann:Hi][model]"
    )
    assert (
        render_chat_prompt(messages, tokenizer, add_generation_prompt=False)
        == "[system:S][user/ann:Hi]"
    )


def test_template_and_fallback_agree_on_gemma_format():
    tokenizer = make_tokenizer(GEMMA_FORMAT_TEMPLATE)
    for conversation in ([msg("user", "Hi")], CONVERSATION):
        assert render_chat_prompt(conversation, tokenizer) == render_chat_prompt(conversation)
        assert render_chat_prompt(conversation, tokenizer, include_bos=True) == render_chat_prompt(
            conversation, include_bos=True
        )


def test_template_refusal_is_a_400():
    tokenizer = make_tokenizer(GEMMA_FORMAT_TEMPLATE)
    with pytest.raises(ApiError) as info:
        render_chat_prompt([msg("user", "a"), msg("user", "b")], tokenizer)
    assert (info.value.status, info.value.param, info.value.code) == (
        400,
        "messages",
        "invalid_value",
    )
    assert info.value.message == (
        "The conversation cannot be rendered with the model's chat template: roles must alternate"
    )


@pytest.mark.parametrize("template", [None, GEMMA_FORMAT_TEMPLATE])
def test_bos_appears_exactly_once(template):
    tokenizer = make_tokenizer(template)
    bos = tokenizer.bos_token_id
    with_special = tokenizer.encode(
        render_chat_prompt(CONVERSATION, tokenizer), add_special_tokens=True
    )
    without_special = tokenizer.encode(
        render_chat_prompt(CONVERSATION, tokenizer, include_bos=True), add_special_tokens=False
    )
    assert with_special == without_special
    assert with_special[0] == bos and with_special.count(bos) == 1
    assert tokenizer.convert_ids_to_tokens(with_special[:4]) == [
        "<bos>",
        "<start_of_turn>",
        "user",
        "Be",
    ]
