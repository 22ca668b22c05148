"""The condition language of `pepsi-stage-if`: parsed once at load, evaluated per message.

    IF = sender ~ "@example\\.org$" and not state.seen
    IF = properties.kind in ["order", "refund"] or subject == "urgent"

A condition compares message metadata (`FIELDS`, `properties.KEY…`,
`state.KEY…`) with literals: `==`, `!=`, `~`/`matches` (regex search),
`!~`, `in`, `not in`, `<`, `<=`, `>`, `>=`, combined with `and`, `or`,
`not` and parentheses; a field alone is true when set and not empty, zero
or false. Nothing is `eval`ed. This module: the tree, parsing (pure, raises
only ValueError: one line, with the column) and rendering; `evaluation`
evaluates a tree against a message (pure, never raises).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

FIELDS = frozenset({
    "stage", "message_id", "sender", "recipients", "origin_user", "origin_peer",
    "header_from", "subject", "content_type", "correlation_id", "sender_key",
    "properties", "state",
})  # fmt: skip
PATH_FIELDS = ("properties", "state")  # the ones `.KEY` may follow
KEYWORDS = frozenset({"and", "or", "not", "in", "matches", "true", "false", "null"})
MAX_DEPTH = 32  # nested `not` and parentheses: a parse bounded on any input
MAX_LENGTH = 4096

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<number>-?\d+(?:\.\d+)?(?![\w.]))
    | (?P<word>[A-Za-z_]\w*(?:\.[\w-]+)*)
    | (?P<op>==|!=|!~|<=|>=|[<>~()\[\],])
    | (?P<quote>["'])
    )""",
    re.VERBOSE,
)
_BACKSLASH = re.compile(r'\\(?=[\\"]|$)')
_COMPARE = ("==", "!=", "~", "!~", "<", "<=", ">", ">=", "in", "not in")


# --------------------------------------------------------------------------
# The tree. Frozen and comparable, so a StageConfig holding one stays so.


@dataclass(frozen=True)
class Const:
    value: Any  # str, int, float, bool, None, or a tuple of those (a list literal)


@dataclass(frozen=True)
class Field:
    name: str  # one of FIELDS
    path: tuple[str, ...] = ()  # properties.a.b -> ("a", "b")


Operand = Const | Field


@dataclass(frozen=True)
class Compare:
    op: str  # one of _COMPARE
    left: Operand
    right: Operand
    pattern: re.Pattern[str] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Truthy:
    operand: Operand


@dataclass(frozen=True)
class Not:
    operand: Condition


@dataclass(frozen=True)
class And:
    operands: tuple[Condition, ...]


@dataclass(frozen=True)
class Or:
    operands: tuple[Condition, ...]


Condition = Compare | Truthy | Not | And | Or


# --------------------------------------------------------------------------
# Parsing.


class _Tok:
    """One token (a plain class: the parser's own, not worth a dataclass at import)."""

    __slots__ = ("column", "kind", "text", "value")

    def __init__(self, kind: str, text: str, value: Any, column: int) -> None:
        self.kind = kind  # number, word, op, string, end
        self.text = text
        self.value = value
        self.column = column


def _tokens(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            toks.append(_Tok("end", "", None, pos + 1))
            return toks
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"column {pos + 1}: unexpected {text[pos]!r}")
        start = match.start(match.lastgroup or 0)
        kind = match.lastgroup or ""
        if kind == "quote":
            string, pos = _string(text, start)
            toks.append(_Tok("string", text[start:pos], string, start + 1))
            continue
        word = match.group(kind)
        value: Any = word
        if kind == "number":
            number = float(word) if "." in word else int(word)
            if abs(number) == float("inf"):
                raise ValueError(f"column {start + 1}: number too large")
            value = number
        toks.append(_Tok(kind, word, value, start + 1))
        pos = match.end()


def _string(text: str, start: int) -> tuple[str, int]:
    """A quoted string from `start`; a backslash escapes only a quote or a backslash."""
    quote, pos = text[start], start + 1
    out: list[str] = []
    while pos < len(text):
        char = text[pos]
        if char == quote:
            return "".join(out), pos + 1
        if char == "\\" and pos + 1 < len(text) and text[pos + 1] in (quote, "\\"):
            out.append(text[pos + 1])
            pos += 2
            continue
        out.append(char)
        pos += 1
    raise ValueError(f"column {start + 1}: string not closed (missing {quote})")


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.at = 0
        self.depth = 0

    @property
    def tok(self) -> _Tok:
        return self.toks[self.at]

    def word(self, *words: str) -> bool:
        tok = self.tok
        return tok.kind == "word" and tok.text.lower() in words

    def fail(self, expected: str) -> ValueError:
        tok = self.tok
        found = "the end" if tok.kind == "end" else repr(tok.text)
        return ValueError(f"column {tok.column}: expected {expected}, got {found}")

    def parse(self) -> Condition:
        cond = self.disjunction()
        if self.tok.kind != "end":
            raise self.fail("and, or, or the end")
        return cond

    def disjunction(self) -> Condition:
        items = [self.conjunction()]
        while self.word("or"):
            self.at += 1
            items.append(self.conjunction())
        return items[0] if len(items) == 1 else Or(tuple(items))

    def conjunction(self) -> Condition:
        items = [self.negation()]
        while self.word("and"):
            self.at += 1
            items.append(self.negation())
        return items[0] if len(items) == 1 else And(tuple(items))

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ValueError(f"column {self.tok.column}: nested more than {MAX_DEPTH} deep")

    def negation(self) -> Condition:
        if self.word("not"):
            self.at += 1
            self.nest()
            inner = self.negation()
            self.depth -= 1
            return Not(inner)
        if self.tok.kind == "op" and self.tok.text == "(":
            self.at += 1
            self.nest()
            inner = self.disjunction()
            self.depth -= 1
            if not (self.tok.kind == "op" and self.tok.text == ")"):
                raise self.fail("')'")
            self.at += 1
            return inner
        return self.comparison()

    def comparison(self) -> Condition:
        left = self.operand()
        op = self.operator()
        if op is None:
            return Truthy(left)
        column = self.tok.column
        right = self.operand()
        if op in ("~", "!~"):
            if not (isinstance(right, Const) and isinstance(right.value, str)):
                raise ValueError(f"column {column}: {op} takes a quoted regular expression")
            return Compare(op, left, right, _regex(right.value, column))
        return Compare(op, left, right)

    def operator(self) -> str | None:
        tok = self.tok
        if tok.kind == "op" and tok.text in _COMPARE:
            self.at += 1
            return tok.text
        if self.word("in"):
            self.at += 1
            return "in"
        if self.word("matches"):
            self.at += 1
            return "~"
        if self.word("not") and self.toks[self.at + 1].text.lower() == "in":
            self.at += 2
            return "not in"
        return None

    def operand(self) -> Operand:
        tok = self.tok
        if tok.kind in ("string", "number"):
            self.at += 1
            return Const(tok.value)
        if tok.kind == "op" and tok.text == "[":
            return Const(self.list_literal())
        if tok.kind == "word":
            lowered = tok.text.lower()
            if lowered in ("true", "false", "null"):
                self.at += 1
                return Const({"true": True, "false": False, "null": None}[lowered])
            if lowered not in KEYWORDS:
                self.at += 1
                return _field(tok)
        raise self.fail("a field, a string, a number, true, false, null or [a list]")

    def list_literal(self) -> tuple[Any, ...]:
        self.at += 1  # [
        items: list[Any] = []
        while not (self.tok.kind == "op" and self.tok.text == "]"):
            if items:
                if not (self.tok.kind == "op" and self.tok.text == ","):
                    raise self.fail("',' or ']'")
                self.at += 1
            item = self.operand()
            if not isinstance(item, Const) or isinstance(item.value, tuple):
                column = self.toks[self.at - 1].column
                raise ValueError(f"column {column}: a list holds literals")  # noqa: TRY004
            items.append(item.value)
        self.at += 1  # ]
        return tuple(items)


def _field(tok: _Tok) -> Field:
    name, *path = tok.text.split(".")
    if name not in FIELDS:
        known = ", ".join(sorted(FIELDS))
        raise ValueError(f"column {tok.column}: unknown field {name!r} (known: {known})")
    if path and name not in PATH_FIELDS:
        raise ValueError(f"column {tok.column}: {name} has no .{path[0]}")
    return Field(name, tuple(path))


def _regex(source: str, column: int) -> re.Pattern[str]:
    try:
        return re.compile(source)
    except (re.error, OverflowError, RecursionError, ValueError) as exc:
        raise ValueError(f"column {column}: bad regular expression: {exc}") from None


def parse_condition(text: str) -> Condition:
    """The condition `text` says; ValueError (one line, with a column) if it says none."""
    if len(text) > MAX_LENGTH:
        raise ValueError(f"longer than {MAX_LENGTH} characters")
    if not text.strip():
        raise ValueError("must not be empty")
    return _Parser(text).parse()


# --------------------------------------------------------------------------
# Rendering (what `pepsi config check` prints; parses back to the same tree).


def render(cond: Condition) -> str:
    match cond:
        case Compare(op=op, left=left, right=right):
            return f"{_render_operand(left)} {op} {_render_operand(right)}"
        case Truthy(operand=operand):
            return _render_operand(operand)
        case Not(operand=inner):
            return f"not {_grouped(inner)}"
        case And(operands=items):
            return " and ".join(_grouped(item) for item in items)
        case Or(operands=items):
            return " or ".join(_grouped(item) for item in items)


def _grouped(cond: Condition) -> str:
    return f"({render(cond)})" if isinstance(cond, And | Or) else render(cond)


def _render_operand(operand: Operand) -> str:
    if isinstance(operand, Field):
        return ".".join((operand.name, *operand.path))
    return _render_value(operand.value)


def _render_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_render_value(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str):
        # A backslash needs doubling only before a backslash, a quote or the end.
        return '"' + _BACKSLASH.sub(r"\\\\", value).replace('"', '\\"') + '"'
    text = repr(value)
    if "e" not in text:
        return text
    from decimal import Decimal  # noqa: PLC0415  # rare: a float repr'd with an exponent

    return format(Decimal(text), "f")
