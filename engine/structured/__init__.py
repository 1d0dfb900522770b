"""Grammar-constrained decoding: JSON schemas, regexes, choices and grammars as token masks.

    spec = GrammarSpec.json_schema(schema)                  # engine.structured.spec
    compiled = await engine.grammars.compile(spec)          # InvalidGrammar if it cannot be
    seq = Sequence(prompt, params, grammar=compiled.matcher())

The sampler masks each constrained row to what its grammar allows (engine.sampler, step 5);
the engine advances the matcher with every sampled token and ends the sequence when the
grammar is complete (engine.llm_engine.LLMEngine._advance_grammar).
"""

from engine.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarMatcher
from engine.structured.spec import GrammarSpec, InvalidGrammar

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "GrammarSpec", "InvalidGrammar"]
