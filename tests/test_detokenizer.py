import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engine.detokenizer import DetokenizedStep, IncrementalDetokenizer, check_stop
from engine.request import FinishReason
from engine.request import Sequence as EngineSequence
from engine.sampling import SamplingParams

CORPUS = [
    "Hello world, this is the end.",
    "the quick brown fox jumps over the lazy dog",
    "stop here STOP there",
    "hello hello hello world",
]
TEXTS = [
    "héllo 你好 🙂 world",
    "Hello world, this is the end. More text follows here.",
    "naïve café, the end 🙂🙂 ok",
    "  two  spaces and\nnew lines\n",
]
EOS_TEXT = "<eos>"


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """Byte-level BPE with few merges: non-ASCII characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TEXT],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    """SentencePiece-style BPE: '▁' for spaces, a decoder that strips the leading space, and
    byte fallback (<0xNN> tokens) for every character outside the ASCII training text."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=[EOS_TEXT], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # ordinary (not special) tokens, as in SentencePiece models
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    return Tokenizer.from_str(json.dumps(spec))


def stream(
    tokenizer, prompt: list[int], output: list[int], eos_ids=(), **params
) -> tuple[list[DetokenizedStep], EngineSequence, IncrementalDetokenizer]:
    """Feed `output` one token at a time as the engine does, until the sequence finishes."""
    params.setdefault("max_tokens", max(1, len(output)))
    seq = EngineSequence(prompt_token_ids=prompt, sampling=SamplingParams(**params))
    detok = IncrementalDetokenizer(tokenizer, prompt, seq.sampling)
    steps = []
    for token in output:
        steps.append(detok.update(token, check_stop(seq, token, eos_ids)))
        seq.output_token_ids.append(token)
        if steps[-1].finish_reason is not None:
            break
    return steps, seq, detok


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_streamed_text_concatenates_to_the_full_decode(name, request):
    tokenizer = request.getfixturevalue(name)
    checked = 0
    for text in TEXTS:
        ids = encode(tokenizer, text)
        full = tokenizer.decode(ids)
        for split in range(len(ids)):
            prompt_text = tokenizer.decode(ids[:split])
            if prompt_text.endswith("\ufffd") or not full.startswith(prompt_text):
                continue  # a prompt cut inside a character has no text of its own
            steps, _, detok = stream(tokenizer, ids[:split], ids[split:])
            expected = full[len(prompt_text) :]
            assert "".join(s.text for s in steps) == expected, (text, split)
            assert detok.output_text == expected
            assert steps[-1].finish_reason is FinishReason.LENGTH
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_multibyte_characters_are_never_split(name, request):
    tokenizer = request.getfixturevalue(name)
    text = "héllo 你好 🙂 world"
    ids = encode(tokenizer, text)
    assert len(ids) > len(text.split()) + 6  # the characters really span several tokens
    steps, _, _ = stream(tokenizer, [], ids)
    shown = ""
    held = 0
    for step in steps:
        assert "\ufffd" not in step.text
        shown += step.text
        assert text.startswith(shown)
        held += step.text == ""
    assert shown == text
    assert held >= 6  # é, 你, 好, 🙂 waited for their later bytes


def test_incomplete_character_at_the_end_is_flushed(byte_level):
    ids = encode(byte_level, "ok 🙂")
    cut = ids[:-1]  # the emoji's last byte never comes
    _, _, detok = stream(byte_level, [], cut)
    assert detok.output_text == byte_level.decode(cut)
    assert detok.output_text.startswith("ok ") and detok.output_text.endswith("\ufffd")


def test_first_output_token_keeps_its_leading_space(sentencepiece):
    ids = encode(sentencepiece, "Hello world")
    assert sentencepiece.decode(ids[-1:]) == "world"  # decoded alone, the space is stripped
    prompt, output = ids[:-1], ids[-1:]
    assert sentencepiece.decode(prompt) == "Hello"
    steps, _, _ = stream(sentencepiece, prompt, output)
    assert [s.text for s in steps] == [" world"]


def test_long_prompt_only_its_tail_is_context(byte_level):
    prompt = encode(byte_level, "the quick brown fox jumps over the lazy dog " * 20)
    _, _, detok = stream(byte_level, prompt, encode(byte_level, "hello 🙂"))
    assert detok.output_text == "hello 🙂"


TEXT = "Hello world, this is the end. More text follows here."


def shown_after_each_step(steps: list[DetokenizedStep]) -> list[str]:
    shown, out = "", []
    for step in steps:
        shown += step.text
        out.append(shown)
    return out


def test_stop_string_spanning_several_tokens_cuts_where_it_starts(byte_level):
    ids = encode(byte_level, TEXT)
    assert len(encode(byte_level, "the end")) > 2
    steps, _, detok = stream(byte_level, [], ids, stop=["the end"], max_tokens=64)
    assert detok.output_text == "Hello world, this is "
    assert (steps[-1].finish_reason, steps[-1].stop_str, detok.stop_str) == (
        FinishReason.STOP,
        "the end",
        "the end",
    )
    assert byte_level.decode(ids[: len(steps)]).endswith("the end")  # stopped on completion
    assert byte_level.decode(ids[: len(steps) - 1]).endswith("the en")
    for shown in shown_after_each_step(steps):  # never a piece of the stop string
        assert "Hello world, this is ".startswith(shown)
    # "the" had arrived two or more steps before the match and was held back
    assert shown_after_each_step(steps)[-3] == "Hello world, this is "


def test_stop_string_included_when_asked(byte_level):
    ids = encode(byte_level, TEXT)
    steps, _, detok = stream(
        byte_level, [], ids, stop=["the end"], include_stop_str_in_output=True, max_tokens=64
    )
    assert detok.output_text == "Hello world, this is the end"
    assert "".join(s.text for s in steps) == "Hello world, this is the end"


def test_stop_string_inside_one_token(byte_level):
    ids = encode(byte_level, TEXT)
    assert " world" in [byte_level.decode([i]) for i in ids]
    steps, _, detok = stream(byte_level, [], ids, stop=["orl"], max_tokens=64)
    assert detok.output_text == "Hello w"
    assert steps[-1].stop_str == "orl"
    assert len(steps) == 3  # ended on the token that holds it


def test_held_back_prefix_is_released_when_it_does_not_match(byte_level):
    ids = encode(byte_level, TEXT)
    steps, _, detok = stream(byte_level, [], ids, stop=["the endless", "More texts"])
    assert detok.output_text == TEXT
    assert steps[-1].finish_reason is FinishReason.LENGTH and steps[-1].stop_str is None
    shown = shown_after_each_step(steps)
    # some step showed less than everything decoded so far: the possible stop prefix
    assert any(s != byte_level.decode(ids[: i + 1]) for i, s in enumerate(shown))
    assert all(TEXT.startswith(s) for s in shown)


def test_held_back_prefix_is_flushed_at_the_length_limit(byte_level):
    ids = encode(byte_level, "Hello world")
    steps, _, detok = stream(byte_level, [], ids, stop=["world peace"])
    assert detok.output_text == "Hello world"
    assert steps[-1].text.endswith("world")


def test_first_stop_string_to_complete_wins(byte_level):
    ids = encode(byte_level, TEXT)
    for stops in (["is the end", "the"], ["the", "is the end"]):
        _, _, detok = stream(byte_level, [], ids, stop=stops, max_tokens=64)
        assert (detok.output_text, detok.stop_str) == ("Hello world, this is ", "the")


def test_stop_strings_wait_for_min_tokens(byte_level):
    ids = encode(byte_level, TEXT)
    the = next(i for i in range(len(ids)) if byte_level.decode(ids[: i + 1]).endswith("the"))
    # "the" (once in TEXT) completes on output token the + 1: it ends the text at min_tokens
    # up to that, and never once min_tokens skipped it.
    _, _, detok = stream(byte_level, [], ids, stop=["the"], min_tokens=the + 1, max_tokens=64)
    assert (detok.output_text, detok.stop_str) == ("Hello world, this is ", "the")
    _, _, detok = stream(byte_level, [], ids, stop=["the"], min_tokens=the + 2, max_tokens=64)
    assert (detok.output_text, detok.stop_str) == (TEXT, None)  # never matched later
    # "is" completes twice, in "this" and then " is": min_tokens skips only the first.
    this = byte_level.decode(ids).index("this")
    first_is = next(i for i in range(len(ids)) if len(byte_level.decode(ids[: i + 1])) > this + 3)
    _, _, detok = stream(byte_level, [], ids, stop=["is"], min_tokens=first_is + 2, max_tokens=64)
    assert (detok.output_text, detok.stop_str) == ("Hello world, this ", "is")  # the second one


def test_multibyte_stop_string(sentencepiece):
    ids = encode(sentencepiece, "héllo 你好 🙂 world")
    steps, _, detok = stream(sentencepiece, [], ids, stop=["你好"], max_tokens=64)
    assert detok.output_text == "héllo "
    assert steps[-1].stop_str == "你好"


def test_stop_string_in_the_prompt_does_not_count(byte_level):
    prompt = encode(byte_level, "say the end")
    steps, _, detok = stream(byte_level, prompt, encode(byte_level, " ok"), stop=["the end"])
    assert detok.output_text == " ok"
    assert steps[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_text_is_left_out_unless_asked(byte_level):
    ids = encode(byte_level, "hello world")
    world = ids[-1]
    assert byte_level.decode([world]) == " world"
    steps, _, detok = stream(byte_level, [], ids, stop_token_ids=[world], max_tokens=64)
    assert (detok.output_text, steps[-1].finish_reason, steps[-1].stop_str) == (
        "hello",
        FinishReason.STOP,
        None,
    )
    _, _, detok = stream(
        byte_level, [], ids, stop_token_ids=[world], include_stop_str_in_output=True, max_tokens=64
    )
    assert detok.output_text == "hello world"


def test_eos_ends_the_text(byte_level):
    eos = byte_level.token_to_id(EOS_TEXT)
    ids = [*encode(byte_level, "hello"), eos, *encode(byte_level, " more")]
    steps, seq, detok = stream(byte_level, [], ids, eos_ids=[eos], max_tokens=64)
    assert detok.output_text == "hello"
    assert steps[-1].finish_reason is FinishReason.STOP
    assert seq.output_token_ids[-1] == eos


def test_update_after_finish_is_refused(byte_level):
    ids = encode(byte_level, "hello")
    _, _, detok = stream(byte_level, [], ids)
    with pytest.raises(RuntimeError):
        detok.update(ids[0])


def sequence_with(output: list[int], **params) -> EngineSequence:
    seq = EngineSequence(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(**params))
    seq.output_token_ids.extend(output)
    return seq


@pytest.mark.parametrize(
    "output, params, max_model_len, expected",
    [
        ([3, 4], dict(max_tokens=10), None, None),
        ([3, 1], dict(max_tokens=10), None, FinishReason.STOP),  # EOS
        ([3, 1], dict(max_tokens=10, ignore_eos=True), None, None),
        ([3, 9], dict(max_tokens=10, stop_token_ids=[9]), None, FinishReason.STOP),
        ([3, 9], dict(max_tokens=10, stop_token_ids=[9], ignore_eos=True), None, FinishReason.STOP),
        ([3, 1], dict(max_tokens=10, min_tokens=2), None, None),  # still within min_tokens
        ([3, 4, 1], dict(max_tokens=10, min_tokens=2), None, FinishReason.STOP),
        ([3, 4, 5], dict(max_tokens=3), None, FinishReason.LENGTH),
        ([3, 4, 1], dict(max_tokens=3), None, FinishReason.STOP),  # EOS wins over length
        ([3, 1], dict(max_tokens=2, ignore_eos=True), None, FinishReason.LENGTH),
        ([3, 4], dict(max_tokens=10), 5, FinishReason.LENGTH),  # 3 prompt + 2 fill the context
        ([3], dict(max_tokens=10), 5, None),
    ],
)
def test_check_stop(output, params, max_model_len, expected):
    seq = sequence_with(output[:-1], **params)  # output[-1] is the token just sampled
    assert check_stop(seq, output[-1], {1, 106}, max_model_len) is expected


@pytest.mark.slow
def test_gemma_tokenizer_streaming():
    from transformers import AutoTokenizer

    from engine.model.loader import embedded_checkpoint_dir

    tok = AutoTokenizer.from_pretrained(embedded_checkpoint_dir())
    prompt = tok.encode("<start_of_turn>user\nSay hi<end_of_turn>\n<start_of_turn>model\n")
    emoji_bytes = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "🙂".encode()]
    output = tok.encode("Hello  world, héllo 你好", add_special_tokens=False) + emoji_bytes
    output += tok.encode(" done. STOP here", add_special_tokens=False)
    output.append(tok.convert_tokens_to_ids("<end_of_turn>"))
    expected = "Hello  world, héllo 你好🙂 done. STOP here"
    assert tok.decode(output, skip_special_tokens=True) == expected

    steps, _, detok = stream(tok, prompt, output, eos_ids=[tok.eos_token_id], stop_token_ids=[106])
    assert detok.output_text == expected
    assert all("\ufffd" not in s.text for s in steps)
    assert steps[-1].finish_reason is FinishReason.STOP

    steps, _, detok = stream(tok, prompt, output, stop=[". STOP"], max_tokens=64)
    assert detok.output_text == "Hello  world, héllo 你好🙂 done"
    final = "Hello  world, héllo 你好🙂 done"
    assert all(final.startswith(s) for s in shown_after_each_step(steps))
