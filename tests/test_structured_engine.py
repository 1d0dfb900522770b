"""Grammar-constrained decoding through the engine, on the real embedded Gemma 3 270M and its
262,144-token tokenizer: JSON schemas (checked with jsonschema), regexes, choices and Lark/GBNF
grammars, greedy and sampled; finish reasons; stop tokens at the grammar's end; a mixed batch
whose unconstrained rows are untouched; the compiler's refusals and cache."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Sequence
from engine.sampler import Sampler, SamplingRow
from engine.sampling import SamplingParams
from engine.structured import GrammarCompiler, GrammarSpec, InvalidGrammar
from engine.structured.bitmask import (
    _disallowed_numpy,
    _disallowed_torch,
    apply_bitmask_rows,
    set_bits,
)
from tests.engine_harness import (
    PROMPTS,
    encode,
    greedy,
    new_engine,
    one_torch_thread,  # noqa: F401 (a fixture)
    run,
    shared_backend,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EOS = 1
END_OF_TURN = 106

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def loaded(embedded_model):
    return embedded_model


@pytest.fixture(scope="module")
def compiler(loaded) -> GrammarCompiler:
    """One compiler for the module (its tokenizer data takes seconds to build)."""
    vocab = shared_backend(loaded).vocab_size
    compiler = GrammarCompiler(loaded.tokenizer, vocab, loaded.eos_token_ids)
    compiler.warm_up().result()
    return compiler


def small_engine(loaded) -> LLMEngine:
    """An engine with a KV cache for a few short sequences (the default sizes it from memory)."""
    return new_engine(loaded, max_active_tokens=1024)


def generate(engine, seqs: list[Sequence]) -> list[str]:
    """Run seqs to the end; the text each streamed."""
    texts = {seq.seq_id: "" for seq in seqs}
    for outputs in run(engine, seqs):
        for seq, out in outputs:
            texts[seq.seq_id] += out.new_text
    return [texts[seq.seq_id] for seq in seqs]


def whitespace_outside_strings(text: str) -> list[int]:
    """Positions of whitespace characters outside JSON strings."""
    positions, in_string, escaped = [], False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char.isspace():
            positions.append(i)
    return positions


def greedy_params(max_tokens: int) -> SamplingParams:
    """Greedy, EOS not ignored (tests.engine_harness.greedy ignores it)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def sampled(max_tokens: int, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, **kwargs)


def test_json_schema_greedy_and_sampled_is_valid_compact_json(loaded, compiler):
    compiled = compiler.compile_sync(GrammarSpec.json_schema(PERSON))
    prompt = encode(loaded, "A user record in JSON:\n")
    params = [greedy_params(200)]
    params += [sampled(200, seed) for seed in (1, 2, 3)]
    # One matcher per sequence, all of one compiled grammar (as a request's n choices).
    seqs = [Sequence(prompt, p, grammar=compiled.matcher()) for p in params]
    texts = generate(small_engine(loaded), seqs)
    for seq, text in zip(seqs, texts, strict=True):
        assert seq.finish_reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), PERSON)
        assert whitespace_outside_strings(text) == [], text
        # Ended on the closing brace, without a step spent sampling EOS.
        assert text.endswith("}") and EOS not in seq.output_token_ids
        assert loaded.tokenizer.decode(seq.output_token_ids) == text
        assert seq.grammar is None  # dropped at the end
    assert len(set(texts)) > 1  # the seeds drew different records


def test_flexible_whitespace_on_request(loaded, compiler):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    compiled = compiler.compile_sync(GrammarSpec.json_schema(schema, whitespace="flexible"))
    prompt = encode(loaded, 'A result:\n{\n  "ok": true,\n  "n": 3\n}\nAnother result:\n')
    params = [greedy_params(40), sampled(40, seed=4)]
    seqs = [Sequence(prompt, p, grammar=compiled.matcher()) for p in params]
    texts = generate(small_engine(loaded), seqs)
    for seq, text in zip(seqs, texts, strict=True):
        assert seq.finish_reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), schema)
    assert whitespace_outside_strings(texts[0])  # the model's own layout, which compact forbids


def test_max_length_is_honoured(loaded, compiler):
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 4}},
        "required": ["title"],
        "additionalProperties": False,
    }
    compiled = compiler.compile_sync(GrammarSpec.json_schema(schema))
    prompt = encode(loaded, 'The full title of the novel, as JSON: {"title": "The Adventures of')
    params = [greedy_params(40)]
    params += [sampled(40, seed) for seed in (11, 12, 13)]
    seqs = [Sequence(prompt, p, grammar=compiled.matcher()) for p in params]
    for seq, text in zip(seqs, generate(small_engine(loaded), seqs), strict=True):
        assert seq.finish_reason is FinishReason.STOP
        value = json.loads(text)
        assert set(value) == {"title"} and len(value["title"]) <= 4, text


def test_too_few_max_tokens_ends_with_length_not_stop(loaded, compiler):
    compiled = compiler.compile_sync(GrammarSpec.json_schema(PERSON))
    seq = Sequence(
        encode(loaded, "A user record in JSON:\n"),
        greedy_params(6),
        grammar=compiled.matcher(),
    )
    (text,) = generate(small_engine(loaded), [seq])
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 6
    assert text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert seq.grammar is None


def test_regex_choice_and_grammars(loaded, compiler):
    lark = (
        'start: pair ("; " pair)~0..2\n'
        'pair: KEY "=" VALUE\n'
        "KEY: /[a-z]{1,5}/\n"
        "VALUE: /[0-9]{1,3}/\n"
    )
    cases = [
        (GrammarSpec("regex", r"[A-Z][a-z]{1,8} [0-9]{2,3}"), r"[A-Z][a-z]{1,8} [0-9]{2,3}"),
        (GrammarSpec.choice(["Paris", "London", "Berlin"]), r"Paris|London|Berlin"),
        (GrammarSpec("grammar", lark), r"[a-z]{1,5}=[0-9]{1,3}(; [a-z]{1,5}=[0-9]{1,3}){0,2}"),
        (GrammarSpec("grammar", 'root ::= "yes" | "no" | "maybe"'), r"yes|no|maybe"),  # GBNF
    ]
    prompt = encode(loaded, PROMPTS[0])
    seqs = []
    for spec, _ in cases:  # every language is bounded: at most 31 characters
        compiled = compiler.compile_sync(spec)
        seqs.append(Sequence(prompt, greedy_params(40), grammar=compiled.matcher()))
        seqs.append(Sequence(prompt, sampled(40, seed=21), grammar=compiled.matcher()))
    texts = generate(small_engine(loaded), seqs)
    for i, (seq, text) in enumerate(zip(seqs, texts, strict=True)):
        assert re.fullmatch(cases[i // 2][1], text), (cases[i // 2][1], text)
        assert seq.finish_reason is FinishReason.STOP, text
    # The choice and GBNF grammars end as soon as the word is complete: no EOS sampled.
    for seq in seqs[2:4] + seqs[6:8]:
        assert EOS not in seq.output_token_ids


def test_unconstrained_rows_of_a_mixed_batch_are_untouched(loaded, compiler):
    prompts = [encode(loaded, text) for text in PROMPTS[:3]]
    alone = [Sequence(p, greedy(12)) for p in prompts]
    generate(small_engine(loaded), alone)  # the same rows without the constrained ones
    compiled = compiler.compile_sync(GrammarSpec.json_schema(PERSON))
    free = [Sequence(p, greedy(12)) for p in prompts]
    constrained = [
        Sequence(prompts[0], greedy_params(12), grammar=compiled.matcher()),
        Sequence(prompts[1], sampled(12, seed=3), grammar=compiled.matcher()),
    ]
    texts = generate(
        small_engine(loaded), [free[0], constrained[0], free[1], constrained[1], free[2]]
    )
    assert [seq.output_token_ids for seq in free] == [seq.output_token_ids for seq in alone]
    for seq, text in zip(constrained, [texts[1], texts[3]], strict=True):
        assert text.startswith('{"name":"') and seq.finish_reason is FinishReason.LENGTH


def test_stop_tokens_follow_the_grammar(loaded, compiler):
    """A row's stop ids (here <end_of_turn>, as a chat's) are allowed exactly when the grammar
    is complete; EOS too, unless ignore_eos; the caller's logits and the logprobs stay raw."""
    compiled = compiler.compile_sync(GrammarSpec("regex", "[0-9]+"))
    digit = loaded.tokenizer.convert_tokens_to_ids("7")
    vocab = shared_backend(loaded).vocab_size
    logits = torch.zeros(4, vocab)
    logits[:, END_OF_TURN] = 50.0  # the model wants to stop, then EOS, then a digit
    logits[:, EOS] = 40.0
    logits[:, digit] = 10.0

    fresh = compiled.matcher()
    complete = compiled.matcher()
    assert complete.accept(digit) and complete.is_accepting and not complete.is_terminated
    chat = dict(max_tokens=8, temperature=0.0, stop_token_ids=[END_OF_TURN], logprobs=1)
    rows = [
        SamplingRow(SamplingParams(**chat), [2], [], 0, fresh),
        SamplingRow(SamplingParams(**chat), [2], [digit], 1, complete),
        SamplingRow(SamplingParams(max_tokens=8, temperature=0.0), [2], [digit], 1, complete),
        SamplingRow(
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            [2],
            [digit],
            1,
            complete,
        ),
    ]
    before = logits.clone()
    out = Sampler([EOS]).sample(logits, rows)
    assert out.token_ids == [digit, END_OF_TURN, EOS, digit]
    assert torch.equal(logits, before)
    raw = torch.log_softmax(before[0], dim=-1)
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(raw[digit].item())
    assert out.logprobs[0].top[0][0] == END_OF_TURN  # what the model wanted, not the grammar

    # Mixed with an unconstrained row the masked rows are put back in the caller's tensor.
    rows = [SamplingRow(SamplingParams(max_tokens=8, temperature=0.0), [2], [], 0), rows[0]]
    out = Sampler([EOS]).sample(logits[:2], rows)
    assert out.token_ids == [END_OF_TURN, digit] and torch.equal(logits, before)


def test_a_token_the_grammar_allows_is_kept_and_a_refused_one_redrawn(loaded, compiler):
    """The sampler first chooses without the mask (Sampler._constrain): greedy rows must still
    get the best allowed token, and sampled rows the masked distribution, computed here by
    hand: a choice of two words whose first tokens have probabilities 1:3 once the token the
    model prefers, which the grammar refuses, is masked."""
    tokenizer = loaded.tokenizer
    red, blue = (tokenizer(w, add_special_tokens=False).input_ids[0] for w in ("red", "blue"))
    brace = tokenizer.convert_tokens_to_ids("{")
    compiled = compiler.compile_sync(GrammarSpec.choice(["red", "blue"]))
    vocab = shared_backend(loaded).vocab_size

    def logits_for(rows: int, preferred: int) -> torch.Tensor:
        logits = torch.full((rows, vocab), -30.0)
        logits[:, red] = 0.0
        logits[:, blue] = float(torch.log(torch.tensor(3.0)))
        logits[:, preferred] = 12.0
        return logits

    greedy_params = SamplingParams(max_tokens=4, temperature=0.0)
    for preferred, expected in ((brace, blue), (red, red)):
        rows = [SamplingRow(greedy_params, [2], [], 0, compiled.matcher())]
        assert Sampler([EOS]).sample(logits_for(1, preferred), rows).token_ids == [expected]

    sampled = SamplingParams(max_tokens=4, temperature=1.0)
    draws: list[int] = []
    for _ in range(8):
        rows = [SamplingRow(sampled, [2], [], 0, compiled.matcher()) for _ in range(50)]
        draws += Sampler([EOS]).sample(logits_for(50, brace), rows).token_ids
    assert set(draws) <= {red, blue}
    share = draws.count(blue) / len(draws)  # 0.75 expected; 4 standard deviations: 0.087
    assert abs(share - 0.75) < 0.087, share


def test_matchers_are_dropped_on_abort(loaded, compiler):
    compiled = compiler.compile_sync(GrammarSpec.json_schema(PERSON))  # not done in one token
    seq = Sequence(encode(loaded, "JSON:"), greedy_params(50), grammar=compiled.matcher())
    engine = small_engine(loaded)
    assert engine.add(seq).accepted
    engine.step()
    assert seq.grammar is not None
    engine.abort(seq.seq_id)
    assert seq.grammar is None


def test_invalid_specs_raise_invalid_grammar(compiler):
    cases = {
        GrammarSpec("json_schema", "{not json"): "not valid JSON",
        GrammarSpec("json_schema", "[1, 2]"): "must be a JSON object",
        GrammarSpec.json_schema({"type": "strnig"}): "strnig",
        GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}): "minimum",
        GrammarSpec.json_schema({"type": "array", "uniqueItems": True}): "uniqueItems",
        GrammarSpec("regex", "(unclosed"): "invalid regex",
        GrammarSpec("choice", "[]"): "non-empty",
        GrammarSpec("grammar", "start: undefined_rule"): "undefined_rule",
    }
    for spec, words in cases.items():
        with pytest.raises(InvalidGrammar, match=re.escape(words)):
            compiler.compile_sync(spec)
        with pytest.raises(InvalidGrammar, match=re.escape(words)):  # the refusal is cached
            compiler.compile_sync(spec)
    assert issubclass(InvalidGrammar, ValueError)
    with pytest.raises(InvalidGrammar):
        GrammarSpec("yaml", "")  # type: ignore[arg-type]
    with pytest.raises(InvalidGrammar, match="invalid JSON schema"):
        asyncio.run(compiler.compile(GrammarSpec.json_schema({"type": "strnig", "x": 1})))


def test_compile_cache_and_shared_compiles(loaded, compiler):
    spec = GrammarSpec.json_schema(PERSON)
    first = compiler.compile_sync(spec)
    assert (
        compiler.compile_sync(GrammarSpec.json_schema(json.dumps(PERSON, separators=(",", ":"))))
        is first
    )

    async def twice() -> list:
        fresh = GrammarSpec.json_schema({**PERSON, "title": "fresh"})  # compiled once, shared
        return await asyncio.gather(compiler.compile(fresh), compiler.compile(fresh))

    a, b = asyncio.run(twice())
    assert a is b and a is not first
    assert asyncio.run(compiler.compile(spec)) is first

    small = GrammarCompiler(loaded.tokenizer, shared_backend(loaded).vocab_size, [EOS], 2)
    small._ll_tokenizer = compiler._tokenizer()  # skip rebuilding the tokenizer data
    specs = [GrammarSpec.choice([word]) for word in ("a", "b", "c")]
    compiled = [small.compile_sync(spec) for spec in specs]
    assert small.cache_size == 2  # least recently used first out
    assert small.compile_sync(specs[2]) is compiled[2]
    assert small.compile_sync(specs[0]) is not compiled[0]
    small.close()


def test_engine_exposes_a_lazy_compiler(loaded):
    engine = small_engine(loaded)
    assert engine._grammars is None  # nothing built until asked
    assert engine.grammars is engine.grammars


def test_bitmask_unpacking_and_rows():
    """Bit j of word i is token 32 * i + j; the numpy (CPU) and tensor (GPU) unpackings agree;
    only the named rows are masked; set_bits flips single bits."""
    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    allowed = torch.rand(3, vocab, generator=generator) < 0.3
    words = torch.zeros(3, 32, dtype=torch.int64)
    for row, token in allowed.nonzero().tolist():
        words[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(_disallowed_numpy(bitmask, vocab), ~allowed)
    assert torch.equal(_disallowed_torch(bitmask, vocab), ~allowed)

    logits = torch.randn(4, vocab, generator=generator)
    masked = logits.clone()
    apply_bitmask_rows(masked, bitmask[:2], [3, 1])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    for row, mask_row in ((3, 0), (1, 1)):
        expected = logits[row].masked_fill(~allowed[mask_row], float("-inf"))
        assert torch.equal(masked[row], expected)

    row = bitmask[0].clone().numpy()
    set_bits(row, [5, 999], allowed=True)
    set_bits(row, [6], allowed=False)
    unpacked = _disallowed_numpy(torch.from_numpy(row)[None], vocab)[0]
    assert not unpacked[5] and not unpacked[999] and unpacked[6]
