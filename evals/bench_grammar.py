"""Grammar-constrained decoding libraries on the embedded model's 262,144-token vocabulary:
llguidance as the engine runs it (engine.structured's compiler and matchers) and xgrammar
through its own API, set up as the engine would (compact JSON, the model's EOS).

Speed, per library: building its tokenizer data (once per process) and the memory it keeps,
compiling a typical JSON schema (the first compile, a second schema, the same schema again),
making a matcher for a new sequence, the token mask of each step while valid documents are fed
token by token (the first sequence of a grammar and a later one), the masks of 16 sequences at
once, and applying a [16, 262144] bitmask to float32 logits (the library's own kernel and the
engine's engine.structured.bitmask.apply_bitmask_rows).

Correctness: for each feature a grammar is compiled and strings are fed as the tokenizer
tokenizes them; the feature is honoured ("yes") when every valid string is accepted (all tokens,
then EOS allowed) and every invalid one is refused (some token refused, or EOS not allowed at
the end). "refused" means the library would not compile it, saying so (an HTTP 400 for the
client); "NO" that it compiled and then allowed an invalid output or refused a valid one.

    python -m evals.bench_grammar [--libraries llguidance xgrammar] [--repeats 3]

llguidance is the project's dependency; for the comparison install xgrammar too
(`pip install xgrammar==0.2.9`, which brings triton); a library not installed is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.model.loader import load_model
from engine.structured.bitmask import apply_bitmask_rows
from evals.harness import write_results

VOCAB = 262_144
ROWS = 16

# A typical response_format schema: nested object, array of objects, enums, bounds, optionals.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 5,
        },
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "gift": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 200},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}
SCHEMA_2 = {**SCHEMA, "properties": {**SCHEMA["properties"], "priority": {"type": "integer"}}}
DOCUMENTS = [
    {
        "order_id": "AB-1234",
        "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
        "items": [{"sku": "KB-001", "quantity": 2, "price": 49.5}],
        "status": "shipped",
        "gift": False,
    },
    {
        "order_id": "ZX-0042",
        "customer": {"name": "Grace Hopper", "tier": "enterprise"},
        "items": [
            {"sku": "MON-27", "quantity": 1, "price": 329.99},
            {"sku": "CBL-HDMI", "quantity": 3, "price": 7.25},
        ],
        "status": "pending",
        "notes": "Please leave the parcel at the front desk, next to the plants.",
    },
    {
        "order_id": "QQ-9999",
        "customer": {"name": "Alan Turing", "email": "alan@bletchley.uk", "tier": "free"},
        "items": [{"sku": "BK-ENIGMA", "quantity": 12, "price": 15}],
        "status": "delivered",
        "gift": True,
        "notes": "Happy birthday!",
    },
]


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def _schema(schema: dict) -> tuple[str, str]:
    return ("json_schema", json.dumps(schema))


# (feature, (kind, source), strings that must be accepted, strings that must be refused).
# Kinds: json_schema (compact), json_flexible (free whitespace allowed), regex, choice, lark,
# special (a lark grammar naming a special token; strings hold token ids, see _tokens).
FEATURES: list[tuple[str, tuple[str, str], list[str], list[str]]] = [
    (
        "compact JSON (no free whitespace)",
        _schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        ['{"a":1}'],
        ['{"a": 1}', '{ "a":1}', '{"a":1}\n'],
    ),
    (
        "flexible JSON whitespace on request",
        ("json_flexible", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
        ['{"a":1}', '{"a": 1}', '{\n  "a": 1\n}'],
        ['{"a":"x"}'],
    ),
    (
        "string maxLength",
        _schema({"type": "string", "maxLength": 5}),
        ['"abcde"', '""'],
        ['"abcdef"', '"hello world"'],
    ),
    ("string minLength", _schema({"type": "string", "minLength": 3}), ['"abc"'], ['"ab"', '""']),
    (
        "array maxItems / minItems",
        _schema({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}),
        ["[1]", "[1,2,3]"],
        ["[]", "[1,2,3,4]"],
    ),
    (
        "integer minimum / maximum",
        _schema({"type": "integer", "minimum": -5, "maximum": 120}),
        ["-5", "0", "7", "120"],
        ["-6", "121", "1000", "1.5"],
    ),
    (
        "integer exclusiveMinimum / exclusiveMaximum",
        _schema({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
        ["1", "9"],
        ["0", "10"],
    ),
    (
        "number minimum / maximum",
        _schema({"type": "number", "minimum": 0.5, "maximum": 2.5}),
        ["0.5", "1", "2.25"],
        ["0.4", "2.6", "3"],
    ),
    (
        "enum",
        _schema({"enum": ["red", "green", 3]}),
        ['"red"', '"green"', "3"],
        ['"blue"', '"re"', "4"],
    ),
    (
        "required + additionalProperties false",
        _schema(
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        ),
        ['{"a":1}', '{"a":1,"b":"x"}'],
        ['{"b":"x"}', '{"a":1,"c":2}'],
    ),
    (
        "string pattern",
        _schema({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}),
        ['"abc-12"'],
        ['"abc-123"', '"ABC-12"'],
    ),
    (
        "json_object (any object)",
        ("json_schema", json.dumps({"type": "object"})),
        ['{"x":[1,{"y":null}],"z":"w"}', "{}"],
        ["[1]", '"s"'],
    ),
    ("regex", ("regex", r"[0-9]{3}-[0-9]{4}"), ["555-1234"], ["55-1234", "555-12345"]),
    ("choice", ("choice", json.dumps(["yes", "no", "maybe"])), ["yes", "maybe"], ["ye", "yess"]),
    (
        "lark grammar",
        (
            "lark",
            'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\n'
            "NUMBER: /[0-9]+/\n",
        ),
        ["1+2", "(3-4)+15"],
        ["1+", "(1", "a"],
    ),
    *[
        (f"keyword {name}", _schema(schema), good, bad)
        for name, schema, good, bad in [
            ("format", {"type": "string", "format": "date"}, ['"2024-01-02"'], ['"today"']),
            ("multipleOf", {"type": "integer", "multipleOf": 5}, ["10"], ["7"]),
            ("uniqueItems", {"type": "array", "uniqueItems": True}, ["[1,2]"], ["[1,1]"]),
            ("not", {"not": {"type": "string"}}, ["1"], ['"a"']),
            ("minProperties", {"type": "object", "minProperties": 1}, ['{"a":1}'], ["{}"]),
            (
                "maxProperties",
                {"type": "object", "maxProperties": 1},
                ['{"a":1}'],
                ['{"a":1,"b":2}'],
            ),
            (
                "patternProperties",
                {
                    "type": "object",
                    "patternProperties": {"^x": {"type": "integer"}},
                    "additionalProperties": False,
                },
                ['{"x1":1}'],
                ['{"y":1}'],
            ),
            ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, ["5"], ["4"]),
            ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, ["1", "null"], ['"a"']),
            ("const", {"const": "hi"}, ['"hi"'], ['"ho"']),
            ("contains", {"type": "array", "contains": {"const": 3}}, ["[1,3]"], ["[1,2]"]),
            (
                "if/then/else",
                {"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}},
                ["3", '"x"'],
                ["1"],
            ),
            (
                "dependentRequired",
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "dependentRequired": {"a": ["b"]},
                },
                ['{"a":1,"b":2}'],
                ['{"a":1}'],
            ),
            (
                "$ref recursion",
                {
                    "$defs": {
                        "n": {
                            "type": "object",
                            "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                            "required": ["c"],
                            "additionalProperties": False,
                        }
                    },
                    "$ref": "#/$defs/n",
                },
                ['{"c":[{"c":[]}]}'],
                ['{"c":[1]}'],
            ),
        ]
    ],
    (
        "special token in a grammar",
        ("special", 'start: <start_of_turn> "ok"\n'),
        ["\x00105 ok"],  # token 105 (<start_of_turn>) then "ok"
        ["ok"],
    ),
]


class Library:
    """The calls the engine needs, over one library."""

    name = ""

    def setup(self, tokenizer: Any, eos: list[int]) -> None: ...

    def compile(self, kind: str, source: str) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            self.fill(matcher, bitmask, row)

    def consume(self, matcher: Any, token: int) -> bool: ...

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class LLGuidance(Library):
    """llguidance as the engine runs it: engine.structured's compiler and matchers."""

    name = "llguidance"

    def setup(self, tokenizer: Any, eos: list[int]) -> None:
        from engine.structured.compiler import GrammarCompiler

        self.compiler = GrammarCompiler(tokenizer, VOCAB, eos)
        self.compiler.warm_up().result()

    def compile(self, kind: str, source: str) -> Any:
        from engine.structured.spec import GrammarSpec

        if kind == "json_flexible":
            return self.compiler.compile_sync(GrammarSpec("json_schema", source, "flexible"))
        kind = {"lark": "grammar", "special": "grammar"}.get(kind, kind)
        return self.compiler.compile_sync(GrammarSpec(kind, source))  # type: ignore[arg-type]

    def matcher(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        from engine.structured.compiler import fill_bitmasks

        fill_bitmasks(matchers, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept(token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        import llguidance.torch

        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)  # torch.compile'd


class XGrammar(Library):
    name = "xgrammar"

    def setup(self, tokenizer: Any, eos: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=VOCAB, stop_token_ids=eos
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, kind: str, source: str) -> Any:
        if kind in ("json_schema", "json_flexible"):
            if kind == "json_flexible":
                return self.compiler.compile_json_schema(source, any_whitespace=True)
            return self.compiler.compile_json_schema(
                source, any_whitespace=False, separators=(",", ":")
            )
        if kind == "regex":
            return self.compiler.compile_regex(source)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(source))
            return self.compiler.compile_grammar(f"root ::= {alternatives}")
        return self.compiler.compile_lark(source)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")


LIBRARIES: dict[str, Callable[[], Library]] = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def _seconds(fn: Callable[[], object]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _rss_mib() -> float:
    """Resident memory after a collection and giving freed heap back (Linux)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _tokens(tokenizer: Any, text: str) -> list[int]:
    """The tokenizer's ids of `text`; "\\x00<id> " at the start stands for one token id."""
    ids: list[int] = []
    if text.startswith("\x00"):
        head, _, text = text[1:].partition(" ")
        ids.append(int(head))
    return ids + tokenizer.encode(text, add_special_tokens=False)


def _accepts(lib: Library, compiled: Any, tokens: list[int], eos: int) -> bool:
    """Every token allowed by the mask and consumed, then EOS allowed."""
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    matcher = lib.matcher(compiled)
    for token in tokens:
        lib.fill(matcher, bitmask, 0)
        if not _allowed(bitmask, 0, token) or not lib.consume(matcher, token):
            return False
    lib.fill(matcher, bitmask, 0)
    return _allowed(bitmask, 0, eos)


def features(lib: Library, tokenizer: Any, eos: int) -> dict[str, str]:
    results = {}
    for name, (kind, source), good, bad in FEATURES:
        try:
            compiled = lib.compile(kind, source)
        except Exception as exc:  # a library's refusal is a result here
            results[name] = f"refused: {' '.join(str(exc).split())[:70]}"
            continue
        wrong_refusals = [
            g for g in good if not _accepts(lib, compiled, _tokens(tokenizer, g), eos)
        ]
        wrong_accepts = [b for b in bad if _accepts(lib, compiled, _tokens(tokenizer, b), eos)]
        if not wrong_refusals and not wrong_accepts:
            results[name] = "yes"
        else:
            parts = [f"refuses {s!r}" for s in wrong_refusals]
            parts += [f"accepts {s!r}" for s in wrong_accepts]
            results[name] = "NO: " + ", ".join(parts)
    return results


def _mask_times(lib: Library, compiled: Any, tokenizer: Any) -> list[float]:
    """Seconds of every step's mask while the documents are fed one after another, each to a
    new matcher of `compiled`."""
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    times = []
    for document in DOCUMENTS:
        matcher = lib.matcher(compiled)
        for token in tokenizer.encode(compact(document), add_special_tokens=False):
            seconds, _ = _seconds(lambda m=matcher: lib.fill(m, bitmask, 0))
            times.append(seconds)
            assert _allowed(bitmask, 0, token) and lib.consume(matcher, token)
    return times


def speed(lib: Library, tokenizer: Any, eos: list[int], repeats: int) -> dict[str, float]:
    row: dict[str, float] = {}
    before = _rss_mib()
    row["tokenizer_setup_s"], _ = _seconds(lambda: lib.setup(tokenizer, eos))
    row["tokenizer_memory_mib"] = _rss_mib() - before
    source = json.dumps(SCHEMA)
    row["compile_first_ms"], compiled = _seconds(lambda: lib.compile("json_schema", source))
    row["compile_second_schema_ms"], _ = _seconds(
        lambda: lib.compile("json_schema", json.dumps(SCHEMA_2))
    )
    row["compile_same_again_ms"], _ = _seconds(lambda: lib.compile("json_schema", source))
    row["new_matcher_ms"] = min(_seconds(lambda: lib.matcher(compiled))[0] for _ in range(20))
    for key in ("compile_first_ms", "compile_second_schema_ms", "compile_same_again_ms"):
        row[key] *= 1e3
    row["new_matcher_ms"] *= 1e3

    first = _mask_times(lib, compiled, tokenizer)  # the grammar's first sequences
    later = [t for _ in range(repeats) for t in _mask_times(lib, compiled, tokenizer)]
    row["mask_first_pass_mean_us"] = statistics.fmean(first) * 1e6
    row["mask_first_pass_max_us"] = max(first) * 1e6
    row["mask_mean_us"] = statistics.fmean(later) * 1e6
    row["mask_p50_us"] = statistics.median(later) * 1e6
    row["mask_p99_us"] = sorted(later)[int(0.99 * (len(later) - 1))] * 1e6
    row["mask_max_us"] = max(later) * 1e6

    # 16 sequences of one grammar, each part-way through a different document; the masks of
    # all 16 at once, for 8 steps (each a state not seen before by that sequence).
    tokens = [tokenizer.encode(compact(d), add_special_tokens=False) for d in DOCUMENTS]
    matchers, positions = [], []
    for i in range(ROWS):
        matcher = lib.matcher(compiled)
        doc = tokens[i % len(tokens)]
        positions.append((i * 7) % (len(doc) - 9))
        for token in doc[: positions[-1]]:
            assert lib.consume(matcher, token)
        matchers.append(matcher)
    bitmask = torch.zeros(ROWS, VOCAB // 32, dtype=torch.int32)
    batch_times = []
    for step in range(8):
        batch_times.append(_seconds(lambda: lib.fill_batch(matchers, bitmask))[0])
        for i, matcher in enumerate(matchers):
            assert lib.consume(matcher, tokens[i % len(tokens)][positions[i] + step])
    row["mask_16_rows_ms"] = 1e3 * statistics.median(batch_times)
    lib.fill_batch(matchers, bitmask)

    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    apply_bitmask_rows(expected, bitmask, list(range(ROWS)))
    try:
        times = []
        for _ in range(6):
            work = logits.clone()
            times.append(_seconds(lambda w=work: lib.apply(w, bitmask))[0])
            assert torch.equal(work, expected)
        row["apply_16_rows_library_ms"] = 1e3 * statistics.median(times[1:])
    except Exception as exc:
        print(f"{lib.name}: its apply failed: {str(exc).splitlines()[0][:120]}")
        row["apply_16_rows_library_ms"] = float("nan")
    times = []
    for _ in range(6):
        work = logits.clone()
        times.append(_seconds(lambda w=work: apply_bitmask_rows(w, bitmask, list(range(ROWS))))[0])
    row["apply_16_rows_engine_ms"] = 1e3 * statistics.median(times[1:])
    return {k: round(v, 3) for k, v in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the documents")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the engine thread's sampler; the libraries use their own threads
    loaded = load_model("gemma-3-270m")
    tokenizer = loaded.tokenizer
    eos = sorted(loaded.eos_token_ids)
    versions, speeds, honoured = {}, {}, {}
    for name in args.libraries:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            print(f"{name} is not installed; skipped")
            continue
        lib = LIBRARIES[name]()
        speeds[name] = speed(lib, tokenizer, eos, args.repeats)
        honoured[name] = features(lib, tokenizer, eos[0])

    names = list(speeds)
    if not names:
        raise SystemExit("no library to measure")
    print(f"\n{'measure':<32}" + "".join(f"{n:>16}" for n in names))
    for key in speeds[names[0]]:
        print(f"{key:<32}" + "".join(f"{speeds[n][key]:>16}" for n in names))
    print()
    for feature, *_ in FEATURES:
        print(f"{feature:<45}" + "  |  ".join(f"{n}: {honoured[n][feature]}" for n in names))
    path = write_results(
        "bench_grammar",
        {
            "vocab": VOCAB,
            "rows": ROWS,
            "versions": versions,
            "schema": SCHEMA,
            "speed": speeds,
            "features": honoured,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
