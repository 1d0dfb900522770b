"""Compiling GrammarSpecs, and the per-sequence matchers the engine advances, on llguidance.

llguidance was chosen by measurement (evals/bench_grammar.py, on the embedded model's
262,144-token vocabulary): it honours every JSON Schema keyword it accepts and refuses the others
by name (uniqueItems, not, contains, if/then/else, dependentRequired, propertyNames), where
xgrammar 0.2.9 compiled schemas with uniqueItems, not, allOf, contains, if/then/else,
dependentRequired, maxProperties or patternProperties and then broke them, silently; it compiles
a schema in 2-15 ms with no per-schema pass over the vocabulary (xgrammar: 30-40 ms); and it is a
7.6 MB wheel with no dependencies (xgrammar pulls triton, 1 GB). Its costs: token masks of about
15 us in most states but 2-3 ms inside a short length-bounded string (maxLength, {m,n}), where
its vocabulary slices do not apply (xgrammar: 2 us and 50 us), and about 280 MiB for its
tokenizer data (xgrammar: 40 MiB).

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    compiled = await compiler.compile(GrammarSpec.json_schema(schema))   # or compile_sync
    seq = Sequence(prompt, params, grammar=compiled.matcher())          # one matcher a choice

Compiling runs on the compiler's own worker thread (llguidance releases the GIL meanwhile),
never on the engine thread or the event loop, and so does building llguidance's view of the
tokenizer (about 4 s for 262,144 tokens, once, on the first compile or on warm_up()).
Compiled grammars are cached by spec (LRU); concurrent compiles of one spec share one future;
invalid specs raise InvalidGrammar, and that refusal is cached too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.structured.bitmask import bitmask_words
from engine.structured.spec import GrammarSpec, InvalidGrammar

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

# The longest message of a refusal passed on to the client.
_MAX_MESSAGE = 500


class GrammarMatcher:
    """One sequence's position in its grammar. Used by the engine thread only."""

    __slots__ = ("_matcher", "_words")

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self._words = words  # int32 words of a bitmask row over the model's vocabulary

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (CPU int32, 1 bit a token; the
        grammar's EOS ids are allowed where the grammar may end)."""
        view = _row(bitmask, row, self._words)
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), self._words * 4)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next (without advancing)."""
        return self._matcher.validate_tokens([token_id]) == 1

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher
        is then in an error state, see `error`)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: EOS (any stop token) may come now."""
        return self._matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Complete, and nothing but EOS can follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        """Why the matcher failed (a refused token, a parser limit), or ""."""
        return self._matcher.get_error()


class CompiledGrammar:
    """A compiled spec: a pristine matcher that each sequence gets a copy of."""

    __slots__ = ("_template", "_words", "spec")

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, words: int) -> None:
        self.spec = spec
        self._template = template
        self._words = words

    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of the grammar (a copy: microseconds)."""
        return GrammarMatcher(self._template.deep_copy(), self._words)


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """matchers[j].fill_bitmask(bitmask, j) for every j, on llguidance's thread pool when there
    are several (distinct ones: the pool takes each matcher once)."""
    if len({id(m) for m in matchers}) < len(matchers) or len(matchers) == 1:
        for j, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, j)
        return
    words = matchers[0]._words
    if any(m._words != words for m in matchers):
        raise ValueError("matchers over different vocabularies")
    _row(bitmask, len(matchers) - 1, words)  # checks the shape
    _executor().unsafe_compute_mask_ptr(
        [(m._matcher, j) for j, m in enumerate(matchers)],
        bitmask.data_ptr(),
        words * 4,
        bitmask.shape[0],
    )


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and logits width; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = 256,
    ) -> None:
        """`tokenizer` is a transformers fast tokenizer; `vocab_size` the width of the model's
        logits (ids past the tokenizer's are never allowed); `eos_token_ids` the ids the grammar
        allows once complete (the sampler adds each row's own stop ids)."""
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(set(eos_token_ids))
        self._words = bitmask_words(vocab_size)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar | str] = OrderedDict()
        self._inflight: dict[GrammarSpec, concurrent.futures.Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="grammar-compile"
        )

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled spec, compiled on the worker thread unless cached; raises
        InvalidGrammar. Cancelling the caller does not cancel a compile others wait for."""
        future = self._future(spec)
        if future.done():
            return future.result()
        waiter = asyncio.wrap_future(future)
        # Read by shield's callback even when this caller is gone: no "never retrieved" logs.
        waiter.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(waiter)

    def compile_sync(self, spec: GrammarSpec) -> CompiledGrammar:
        """compile() for synchronous callers (the offline API, tests): blocks until done."""
        return self._future(spec).result()

    def warm_up(self) -> concurrent.futures.Future[None]:
        """Build llguidance's tokenizer data now, on the worker thread, so that the first
        compile does not wait for it; returns at once (the future says when it is done)."""

        def build() -> None:
            self._tokenizer()

        return self._pool.submit(build)

    def close(self) -> None:
        """Stop the worker thread once queued compiles are done."""
        self._pool.shutdown(wait=False)

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    # ------------------------------------------------------------------ internals

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future[CompiledGrammar]:
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"expected a GrammarSpec, not {type(spec).__name__}")
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                done: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
                if isinstance(cached, str):
                    done.set_exception(InvalidGrammar(cached))
                else:
                    done.set_result(cached)
                return done
            future = self._inflight.get(spec)
            if future is None:
                future = self._pool.submit(self._compile_and_cache, spec)
                self._inflight[spec] = future
            return future

    def _compile_and_cache(self, spec: GrammarSpec) -> CompiledGrammar:
        result: CompiledGrammar | str
        try:
            result = self._compile(spec)
        except InvalidGrammar as exc:
            result = str(exc)
        except BaseException:
            with self._lock:
                self._inflight.pop(spec, None)
            raise
        with self._lock:  # in one step, so a caller finds it in flight or cached
            self._inflight.pop(spec, None)
            self._cache[spec] = result
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if isinstance(result, str):
            raise InvalidGrammar(result)
        return result

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        grammar = _llguidance_grammar(spec)
        tokenizer = self._tokenizer()
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidGrammar(_refusal(spec, template.get_error()))
        return CompiledGrammar(spec, template, self._words)


def _llguidance_grammar(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (JSON text); raises InvalidGrammar for what it can tell
    without a tokenizer."""
    from llguidance import LLMatcher

    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_object":
            schema: object = {"type": "object"}
        else:
            try:
                schema = json.loads(spec.source)
            except json.JSONDecodeError as exc:
                raise InvalidGrammar(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidGrammar("the JSON schema must be a JSON object")
        options: JsonCompileOptions = {"whitespace_flexible": spec.whitespace == "flexible"}
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        except ValueError as exc:
            raise InvalidGrammar(_refusal(spec, str(exc))) from None
    elif spec.kind == "regex":
        grammar = LLMatcher.grammar_from_regex(spec.source)
    elif spec.kind == "choice":
        grammar = LLMatcher.grammar_from_lark(_choice_lark(spec.source))
    else:
        grammar = LLMatcher.grammar_from_lark(_lark(spec.source))
    # Errors the grammar shows without a tokenizer, with llguidance's own wording.
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise InvalidGrammar(_refusal(spec, messages[0] if messages else "invalid"))
    return grammar


def _choice_lark(source: str) -> str:
    try:
        options = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidGrammar(f"the choices are not valid JSON: {exc}") from None
    if not isinstance(options, list) or not options:
        raise InvalidGrammar("choice needs a non-empty list of strings")
    if not all(isinstance(option, str) for option in options):
        raise InvalidGrammar("every choice must be a string")
    # Lark string literals take JSON's escapes.
    return "start: " + " | ".join(json.dumps(option) for option in options) + "\n"


def _lark(source: str) -> str:
    if "::=" not in source:
        return source
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(source)
    except Exception as exc:  # the converter raises its own error types, and ValueError
        raise InvalidGrammar(f"invalid GBNF grammar: {_one_line(str(exc))}") from None


_KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def _refusal(spec: GrammarSpec, message: str) -> str:
    return f"invalid {_KIND_NAMES[spec.kind]}: {_one_line(message)}"


def _one_line(message: str) -> str:
    """llguidance's message on one line, without its caret lines, at most _MAX_MESSAGE long."""
    lines = [line.strip() for line in message.splitlines()]
    text = " ".join(line for line in lines if line.strip("^ ")) or "invalid"
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _row(bitmask: torch.Tensor, row: int, words: int) -> torch.Tensor:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError("a bitmask is a 2-D int32 CPU tensor")
    if bitmask.shape[1] != words or not bitmask.is_contiguous() or not 0 <= row < len(bitmask):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} has no row {row} of {words} words")
    return bitmask[row]


_executor_instance: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _executor() -> llguidance.LLExecutor:
    global _executor_instance
    with _executor_lock:
        if _executor_instance is None:
            import llguidance

            _executor_instance = llguidance.LLExecutor()
        return _executor_instance
