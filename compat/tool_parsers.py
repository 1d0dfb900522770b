"""Tool calls in generated text, per model family, whole and streamed.

Two families, chosen from the checkpoint (`parser_for`):

- Gemma 3 ("pythonic", the format compat.chat_template asks for): the whole output is a Python
  list of keyword-argument calls, `[get_weather(city="Paris", days=3), now()]`; the values are
  Python literals (JSON's true/false/null too) and become JSON arguments. Small Gemma models
  like to wrap it in a fence, so an output that ends with a ```tool_code / ```tool_call /
  ```python / ```py / ``` block holding such a list, or one bare call (`f(a=1)`,
  `print(f(a=1))`), is read as calls too, the text before the block being the content.
- Gemma 4 (native): `<|tool_call>call:name{key:value,...}<tool_call|>`, possibly several; keys
  are bare, strings are delimited by the special token `<|"|>`, and values nest as `{...}` and
  `[...]` with bare numbers, true, false and null. The text before the first call is the
  content; what follows the calls (`<|tool_response>`, whitespace) is dropped. The special
  tokens must be in the decoded text: decode without skipping special tokens.

`parse(text)` never raises: text that does not parse as calls is content, as it was written.
A streaming parser (`streaming_parser()`) returns, per `feed(delta)`, the content that cannot
be part of a call at once (`ContentDelta`, a str) and each call whole once it is complete
(`ToolCallDelta`, the first and only delta of that call), holding back text that may still be
a call; `finish()` releases what is held. Their concatenation equals `parse`: the same content,
the same calls. Whitespace before a call is dropped (content is right-stripped before it), so
a stream holds trailing whitespace until text follows it.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from compat.tools import ToolCall, new_tool_call_id


class ContentDelta(str):
    """Content a streaming parser released: the text itself (a str), also as `.text`."""

    __slots__ = ()

    @property
    def text(self) -> str:
        return str(self)


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a call, in the shape of a chunk's `delta.tool_calls[i]`: a call's first delta
    has its id and name (these parsers send every call whole, in its first delta)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


StreamPiece = ContentDelta | ToolCallDelta


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


class StreamingToolParser(ABC):
    """Text deltas in; content deltas and call deltas out."""

    @abstractmethod
    def feed(self, delta: str) -> list[StreamPiece]: ...

    @abstractmethod
    def finish(self) -> list[StreamPiece]: ...


class ToolParser(ABC):
    """One model family's tool-call format. `tool_names`, when given, are the request's
    functions: the pythonic format then reads a call to any other name as plain text (a code
    sample is no call), and accepts names with dashes."""

    family: ClassVar[str]
    # Whether calls are written with special tokens, which the detokenizer must then keep.
    uses_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, tool_names: Iterable[str] | None = None) -> ParsedOutput: ...

    @abstractmethod
    def streaming_parser(self, tool_names: Iterable[str] | None = None) -> StreamingToolParser: ...


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    return ToolCallDelta(index, call.id, call.name, call.arguments)


def _rstrip_to(text: str, end: int, floor: int) -> int:
    """`end` moved back over whitespace, not below `floor`."""
    while end > floor and text[end - 1].isspace():
        end -= 1
    return end


# --- Gemma 3: pythonic -------------------------------------------------------------------------

_FENCE = "```"
_FENCE_TAGS = ("tool_code", "tool_call", "python", "py", "")
_NAME = r"[A-Za-z_][\w.-]*"
# A call's beginning, still being written (`[`, `[get_wea`) or opened (`[get_weather(`).
_LIST_TYPING = re.compile(rf"\[\s*(?:{_NAME}\s*)?")
_LIST_OPENED = re.compile(rf"\[\s*{_NAME}\s*\(")
_BODY_TYPING = re.compile(rf"\[?\s*(?:{_NAME}\s*)?")
_BODY_OPENED = re.compile(rf"\[?\s*{_NAME}\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """A Python (or JSON-spelled) literal as a JSON value."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _NotLiteral
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral
            result[key.value] = _literal(item)
        return result
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral


def _pythonic_calls(source: str, names: frozenset[str] | None, bare: bool) -> list[ToolCall] | None:
    """The calls of `[f(a=1), g()]` (or, when `bare`, of `f(a=1)` / `print(f(a=1))`); None
    when `source` is anything else."""
    placeholders: dict[str, str] = {}
    if names:  # names with dashes are no Python identifiers: stand-ins while parsing
        for i, name in enumerate(sorted(n for n in names if "-" in n)):
            placeholder = f"__tool_{i}__"
            source = re.sub(rf"(?<![\w-]){re.escape(name)}(?=\s*\()", placeholder, source)
            placeholders[placeholder] = name
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if isinstance(node, ast.List):
        items = node.elts
    elif bare and isinstance(node, ast.Call):
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "print"
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Call)
        ):
            node = node.args[0]
        items = [node]
    else:
        return None
    calls = []
    for item in items:
        if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name)) or item.args:
            return None
        name = placeholders.get(item.func.id, item.func.id)
        if names is not None and name not in names:
            return None
        arguments = {}
        for keyword in item.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _literal(keyword.value)
            except (_NotLiteral, RecursionError):
                return None
        calls.append(ToolCall(name, _json(arguments)))
    return calls or None


def _fenced_calls(
    text: str, names: frozenset[str] | None
) -> tuple[str | None, list[ToolCall]] | None:
    """(content, calls) when `text` ends with a fenced block of calls, else None."""
    t = text.rstrip()
    if not t.endswith(_FENCE):
        return None
    closing = len(t) - len(_FENCE)
    opener = t.rfind(_FENCE, 0, closing)
    if opener < 0:
        return None
    newline = t.find("\n", opener + len(_FENCE), closing)
    if newline < 0 or t[opener + len(_FENCE) : newline].strip() not in _FENCE_TAGS:
        return None
    calls = _pythonic_calls(t[newline + 1 : closing], names, bare=True)
    if calls is None:
        return None
    return t[:opener].rstrip() or None, calls


def _parse_pythonic(text: str, names: frozenset[str] | None) -> ParsedOutput:
    stripped = text.strip()
    if stripped.startswith("["):
        calls = _pythonic_calls(stripped, names, bare=False)
        if calls is not None:
            return ParsedOutput(None, calls)
    fenced = _fenced_calls(text, names)
    if fenced is not None:
        return ParsedOutput(*fenced)
    return ParsedOutput(text, [])


def _fence_may_hold_calls(s: str, names: frozenset[str] | None) -> bool:
    """Whether `s` (from a backtick on) may still become a final fenced block of calls."""
    if not s.startswith(_FENCE):
        return _FENCE.startswith(s)
    newline = s.find("\n", len(_FENCE))
    if newline < 0:
        header = s[len(_FENCE) :].rstrip(" \t\r")
        return any(tag.startswith(header) for tag in _FENCE_TAGS)
    if s[len(_FENCE) : newline].strip() not in _FENCE_TAGS:
        return False
    body = s[newline + 1 :]
    closing = body.find(_FENCE)
    if closing < 0:
        start = body.lstrip()
        return bool(_BODY_TYPING.fullmatch(start) or _BODY_OPENED.match(start))
    if body[closing + len(_FENCE) :].strip():
        return False  # text after the block: it is not the last thing written
    return _holds_calls(body[:closing], names)


@functools.lru_cache(maxsize=16)
def _holds_calls(source: str, names: frozenset[str] | None) -> bool:
    """Whether a closed block holds calls (asked again while whitespace follows it)."""
    return _pythonic_calls(source, names, bare=True) is not None


class _PythonicStream(StreamingToolParser):
    def __init__(self, names: frozenset[str] | None) -> None:
        self.names = names
        self.text = ""
        self.emitted = 0  # text[:emitted] went out as content
        self.done = False

    def _held_from(self) -> int:
        """Where the text that may still be (or precede) a call begins."""
        text, start = self.text, self.emitted
        if start == 0:
            lead = text.lstrip()
            if not lead or (
                lead[0] == "[" and (_LIST_TYPING.fullmatch(lead) or _LIST_OPENED.match(lead))
            ):
                return 0
        tick = text.find("`", start)
        while tick >= 0:
            if _fence_may_hold_calls(text[tick:], self.names):
                return _rstrip_to(text, tick, start)
            tick = text.find("`", tick + 1)
        return _rstrip_to(text, len(text), start)

    def feed(self, delta: str) -> list[StreamPiece]:
        if self.done or not delta:
            return []
        self.text += delta
        held = self._held_from()
        if held <= self.emitted:
            return []
        piece = ContentDelta(self.text[self.emitted : held])
        self.emitted = held
        return [piece]

    def finish(self) -> list[StreamPiece]:
        if self.done:
            return []
        self.done = True
        parsed = _parse_pythonic(self.text, self.names)
        sent = self.text[: self.emitted]
        if not parsed.tool_calls:
            rest = self.text[self.emitted :]
            return [ContentDelta(rest)] if rest else []
        pieces: list[StreamPiece] = []
        content = parsed.content or ""
        if content.startswith(sent) and len(content) > len(sent):
            pieces.append(ContentDelta(content[len(sent) :]))
        pieces += [_call_delta(i, call) for i, call in enumerate(parsed.tool_calls)]
        return pieces


class PythonicToolParser(ToolParser):
    """Gemma 3: `[f(a=1), g(b="x")]`, bare or in a ```tool_code fence."""

    family = "gemma3_pythonic"

    def parse(self, text: str, tool_names: Iterable[str] | None = None) -> ParsedOutput:
        names = None if tool_names is None else frozenset(tool_names)
        try:
            return _parse_pythonic(text, names)
        except Exception:  # never fail a response over its parsing
            return ParsedOutput(text, [])

    def streaming_parser(self, tool_names: Iterable[str] | None = None) -> StreamingToolParser:
        return _PythonicStream(None if tool_names is None else frozenset(tool_names))


# --- Gemma 4: native ---------------------------------------------------------------------------

GEMMA4_CALL_START = "<|tool_call>"
GEMMA4_CALL_END = "<tool_call|>"
GEMMA4_STRING = '<|"|>'
_G4_CALL = re.compile(r"\s*call:([\w.\-]+)\s*(\{.*\})\s*", re.DOTALL)
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?")
_BARE_CONSTANTS: dict[str, Any] = {
    "true": True,
    "false": False,
    "null": None,
    "none": None,
    "None": None,
    "True": True,
    "False": False,
}


class _Malformed(Exception):
    pass


class _Gemma4Reader:
    """Gemma 4's argument syntax (a JSON-like object with bare keys and <|"|> strings)."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def _skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def _peek(self) -> str:
        self._skip()
        return self.s[self.i] if self.i < len(self.s) else ""

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            raise _Malformed
        self.i += 1

    def _string(self) -> str:
        start = self.i + len(GEMMA4_STRING)
        end = self.s.find(GEMMA4_STRING, start)
        if end < 0:
            raise _Malformed
        self.i = end + len(GEMMA4_STRING)
        return self.s[start:end]

    def _bare(self, stops: str) -> str:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] not in stops:
            if self.s.startswith(GEMMA4_STRING, self.i):
                raise _Malformed
            self.i += 1
        token = self.s[start : self.i].strip()
        if not token:
            raise _Malformed
        return token

    def value(self) -> Any:
        char = self._peek()
        if self.s.startswith(GEMMA4_STRING, self.i):
            return self._string()
        if char == "{":
            return self.object()
        if char == "[":
            return self._array()
        token = self._bare(",}]")
        if token in _BARE_CONSTANTS:
            return _BARE_CONSTANTS[token]
        if _INT.fullmatch(token):
            return int(token)
        if _FLOAT.fullmatch(token):
            return float(token)
        return token  # a string written without its delimiters

    def _key(self) -> str:
        self._skip()
        if self.s.startswith(GEMMA4_STRING, self.i):
            return self._string()
        return self._bare(":,{}[]")

    def object(self) -> dict[str, Any]:
        self._expect("{")
        result: dict[str, Any] = {}
        while self._peek() != "}":
            key = self._key()
            self._expect(":")
            result[key] = self.value()
            if self._peek() == ",":
                self.i += 1
            elif self._peek() != "}":
                raise _Malformed
        self.i += 1
        return result

    def _array(self) -> list[Any]:
        self._expect("[")
        items = []
        while self._peek() != "]":
            items.append(self.value())
            if self._peek() == ",":
                self.i += 1
            elif self._peek() != "]":
                raise _Malformed
        self.i += 1
        return items


def parse_gemma4_arguments(text: str) -> dict[str, Any]:
    """`{location:<|"|>Paris<|"|>,days:3}` as a dict; ValueError when it is not one."""
    reader = _Gemma4Reader(text)
    try:
        result = reader.object()
        if reader._peek():
            raise _Malformed
    except (_Malformed, RecursionError):
        raise ValueError("not a Gemma 4 argument object") from None
    return result


def _gemma4_call(block: str) -> ToolCall | None:
    """The call in the text between <|tool_call> and <tool_call|>, or None."""
    match = _G4_CALL.fullmatch(block)
    if match is None:
        return None
    try:
        arguments = parse_gemma4_arguments(match[2])
    except ValueError:
        return None
    return ToolCall(match[1], _json(arguments))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _parse_gemma4(text: str) -> ParsedOutput:
    calls: list[ToolCall] = []
    first = -1
    pos = 0
    while (start := text.find(GEMMA4_CALL_START, pos)) >= 0:
        end = text.find(GEMMA4_CALL_END, start + len(GEMMA4_CALL_START))
        if end < 0:
            break
        call = _gemma4_call(text[start + len(GEMMA4_CALL_START) : end])
        if call is not None:
            if not calls:
                first = start
            calls.append(call)
        pos = end + len(GEMMA4_CALL_END)
    if not calls:
        return ParsedOutput(text, [])
    return ParsedOutput(text[:first].rstrip() or None, calls)


class _Gemma4Stream(StreamingToolParser):
    def __init__(self) -> None:
        self.text = ""
        self.emitted = 0  # content: text[:emitted] went out
        self.pos = 0  # where the next call is looked for
        self.calls = 0
        self.done = False

    def _advance(self) -> list[StreamPiece]:
        pieces: list[StreamPiece] = []
        text = self.text
        while True:
            start = text.find(GEMMA4_CALL_START, self.pos)
            end = -1 if start < 0 else text.find(GEMMA4_CALL_END, start + len(GEMMA4_CALL_START))
            if end < 0:
                if not self.calls:  # content, up to what may begin a call
                    held = (
                        start
                        if start >= 0
                        else len(text) - _partial_suffix(text, GEMMA4_CALL_START)
                    )
                    held = _rstrip_to(text, held, self.emitted)
                    if held > self.emitted:
                        pieces.append(ContentDelta(text[self.emitted : held]))
                        self.emitted = held
                return pieces
            call = _gemma4_call(text[start + len(GEMMA4_CALL_START) : end])
            self.pos = end + len(GEMMA4_CALL_END)
            if call is not None:
                if not self.calls:  # the content before the first call
                    held = _rstrip_to(text, start, self.emitted)
                    if held > self.emitted:
                        pieces.append(ContentDelta(text[self.emitted : held]))
                    self.emitted = held
                pieces.append(_call_delta(self.calls, call))
                self.calls += 1
            elif not self.calls:  # a malformed block before any call: content
                pieces.append(ContentDelta(text[self.emitted : self.pos]))
                self.emitted = self.pos

    def feed(self, delta: str) -> list[StreamPiece]:
        if self.done or not delta:
            return []
        self.text += delta
        return self._advance()

    def finish(self) -> list[StreamPiece]:
        if self.done:
            return []
        self.done = True
        if self.calls or self.emitted == len(self.text):
            return []
        return [ContentDelta(self.text[self.emitted :])]


class Gemma4ToolParser(ToolParser):
    """Gemma 4: `<|tool_call>call:name{key:<|"|>text<|"|>,n:1}<tool_call|>`."""

    family = "gemma4"
    uses_special_tokens = True

    def parse(self, text: str, tool_names: Iterable[str] | None = None) -> ParsedOutput:
        try:
            return _parse_gemma4(text)
        except Exception:  # never fail a response over its parsing
            return ParsedOutput(text, [])

    def streaming_parser(self, tool_names: Iterable[str] | None = None) -> StreamingToolParser:
        return _Gemma4Stream()


# --- choosing the family -----------------------------------------------------------------------

_FAMILIES: dict[str, type[ToolParser]] = {
    "gemma4": Gemma4ToolParser,
    "gemma3": PythonicToolParser,
    "gemma3_pythonic": PythonicToolParser,
    "pythonic": PythonicToolParser,
}


def _model_type(obj: object) -> str | None:
    for candidate in (obj, getattr(obj, "config", None)):
        value = getattr(candidate, "model_type", None)
        if isinstance(value, str):
            return value
    return None


def _has_token(tokenizer: object, token: str) -> bool:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if callable(get_vocab):
        try:
            return token in get_vocab()
        except Exception:
            return False
    return False


def parser_for(tokenizer_or_family: object) -> ToolParser:
    """The tool-call format of a checkpoint: Gemma 4's native one when its tokenizer has the
    `<|tool_call>` token (or its model type is a gemma4 one), else Gemma 3's pythonic one.
    Also takes a family name: "gemma4", "gemma3" / "pythonic", or a model type."""
    source = tokenizer_or_family
    if isinstance(source, str):
        if source in _FAMILIES:
            return _FAMILIES[source]()
        return Gemma4ToolParser() if source.startswith("gemma4") else PythonicToolParser()
    model_type = _model_type(source)
    if (model_type or "").startswith("gemma4") or _has_token(source, GEMMA4_CALL_START):
        return Gemma4ToolParser()
    return PythonicToolParser()


__all__ = [
    "GEMMA4_CALL_END",
    "GEMMA4_CALL_START",
    "GEMMA4_STRING",
    "ContentDelta",
    "Gemma4ToolParser",
    "ParsedOutput",
    "PythonicToolParser",
    "StreamPiece",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "new_tool_call_id",
    "parse_gemma4_arguments",
    "parser_for",
]
