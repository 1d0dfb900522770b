"""What a request constrains its output to, as a hashable value (the compile cache's key).

No heavy imports here: the HTTP layer builds specs and catches InvalidGrammar without loading
a grammar library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
Whitespace = Literal["compact", "flexible"]


class InvalidGrammar(ValueError):
    """A spec that cannot be compiled; the message says why, for a human (an HTTP 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint.

    kind         source
    json_schema  the schema, as JSON text (an object; its property order is the output's)
    json_object  ignored (any JSON object)
    regex        the pattern; the whole output must match it
    choice       a JSON list of strings; the output is exactly one of them
    grammar      a Lark grammar in llguidance's dialect (a `start` rule; `%json {...}` embeds
                 a JSON schema, `<name>` or `<[id]>` names a special token), or GBNF/EBNF
                 (recognized by `::=`, with a `root` rule), converted to Lark

    `whitespace` applies to the JSON kinds: "compact" allows no whitespace outside strings (items
    separated by "," and keys by ":"), "flexible" allows any JSON whitespace between tokens.
    """

    kind: GrammarKind
    source: str
    whitespace: Whitespace = "compact"

    def __post_init__(self) -> None:
        if self.kind not in get_args(GrammarKind):
            raise InvalidGrammar(f"unknown grammar kind {self.kind!r}")
        if self.whitespace not in get_args(Whitespace):
            raise InvalidGrammar(
                f"whitespace must be 'compact' or 'flexible', not {self.whitespace!r}"
            )
        if not isinstance(self.source, str):
            raise InvalidGrammar("a grammar's source must be a string")

    @classmethod
    def json_schema(cls, schema: Mapping | str, whitespace: Whitespace = "compact") -> GrammarSpec:
        """A spec for a schema given as a mapping (serialized in its key order) or JSON text."""
        source = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return cls("json_schema", source, whitespace)

    @classmethod
    def json_object(cls, whitespace: Whitespace = "compact") -> GrammarSpec:
        return cls("json_object", "", whitespace)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(options)))
