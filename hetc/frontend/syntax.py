"""Parse .het text into a small syntax tree with spans.

This is the only module that touches lark. Its output (`File`, `Block`,
`Attr` and the value nodes of `hetc.frontend.tree`, re-exported here) is plain
frozen dataclasses; `hetc.frontend.convert` turns it into the typed Spec and
`hetc.frontend.printer` prints it back. Syntax errors say in words what was expected.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from lark import Lark, Token, Transformer, Tree, v_args
from lark.tree import Meta
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from hetc.frontend.comments import scan_comments, weave_comments
from hetc.ir.errors import Diagnostic, InternalError, Span, SpecError
from hetc.grammar import GRAMMAR_PATH
from hetc.frontend.tree import (Attr, Auto, Block, Comment, File, Index, Item, LayerRange, ListValue, Number,
                              RankRef, String, Use, Value, Word)

__all__ = [
    "Attr",
    "Auto",
    "Block",
    "Comment",
    "File",
    "Index",
    "Item",
    "LayerRange",
    "ListValue",
    "Number",
    "RankRef",
    "String",
    "Use",
    "Value",
    "Word",
    "parse_text",
]


@functools.cache
def _parser() -> Lark:
    return Lark(
        GRAMMAR_PATH.read_text(),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        cache=_cache_file(),
    )


# Note [the parser's cache]: building the grammar's LALR tables takes lark about 70 ms, a tenth of a short
# command (`hetc plan`, `hetc check`); loading them from lark's cache takes 7. The cache is a file in the
# user's cache folder; lark keys its content by a hash of the grammar, the parser's options and lark's and
# Python's versions, and builds the tables anew (and rewrites the file) where it is missing, stale or
# unreadable, so a cache never changes what is parsed. Where the folder cannot be made, nothing is cached.


def _cache_file() -> str | bool:
    """Where lark keeps the parser's tables (Note [the parser's cache]); False: build them every time."""
    try:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hetc"
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):   # RuntimeError: no home folder known
        return False
    return str(folder / "grammar.lark-tables")


def _span(path: str, meta_or_token: Meta | Token) -> Span:
    m = meta_or_token
    if isinstance(m, Token):
        line, column = _known(m.line, m), _known(m.column, m)
        return Span(path, line, column, m.end_line or line, m.end_column or column + 1)
    return Span(path, m.line, m.column, m.end_line, m.end_column)


def _known(position: int | None, tok: Token) -> int:
    """A position of a token the lexer made (lark types them optional: a token built by hand has none)."""
    if position is None:
        raise InternalError(f"the lexer made a token without a position: {tok!r}")
    return position


_ESCAPE = re.compile(r"\\(.)")


def _unquote(text: str) -> str:
    """The value of a string token: `\\x` stands for `x` (so `\\"` is a quote)."""
    return _ESCAPE.sub(r"\1", text[1:-1])


# A rule's children: its tokens (None where an optional one is absent) and the nodes its sub-rules
# returned. The grammar fixes which is where; lark's types cannot say it, so the rules that mix both
# take them as `_Children` and unpack them by position.
_Children = list[Any]


class _ToAst(Transformer[Token, list[Item]]):
    def __init__(self, path: str):
        super().__init__(visit_tokens=False)
        self.path = path

    def _s(self, x: Meta | Token) -> Span:
        return _span(self.path, x)

    @v_args(meta=True)
    def start(self, meta: Meta, items: list[Item]) -> list[Item]:
        return list(items)

    @v_args(meta=True)
    def use(self, meta: Meta, children: list[Token]) -> Use:
        (tok,) = children
        return Use(_unquote(tok), self._s(meta))

    @v_args(meta=True)
    def block(self, meta: Meta, children: _Children) -> Block:
        kind, label, peer, *items = children
        label_spans = tuple(self._s(tok) for tok in (label, peer) if tok is not None)
        return Block(str(kind), self._label(label), self._label(peer), tuple(items), self._s(meta),
                     self._s(kind), label_spans)

    @staticmethod
    def _label(tok: Token | None) -> str | None:
        if tok is None:
            return None
        return _unquote(tok) if tok.type == "STRING" else str(tok)

    @v_args(meta=True)
    def attr(self, meta: Meta, children: _Children) -> Attr:
        key, value = children
        return Attr(str(key), value, self._s(meta), self._s(key))

    @v_args(meta=True)
    def auto(self, meta: Meta, _: list[Token]) -> Auto:
        return Auto(self._s(meta))

    @v_args(meta=True)
    def number(self, meta: Meta, children: list[Token]) -> Number:
        num, unit = children
        spaced = unit is not None and _known(unit.start_pos, unit) > _known(num.end_pos, num)
        return Number(str(num), None if unit is None else str(unit), self._s(meta), spaced)

    @v_args(meta=True)
    def string(self, meta: Meta, children: list[Token]) -> String:
        return String(_unquote(children[0]), self._s(meta))

    @v_args(meta=True)
    def word(self, meta: Meta, children: list[Token]) -> Word:
        return Word(str(children[0]), self._s(meta))

    @v_args(meta=True)
    def layer_range(self, meta: Meta, children: list[Token]) -> LayerRange:
        return LayerRange(str(children[0]), str(children[1]), self._s(meta))

    @v_args(meta=True)
    def rank_ref(self, meta: Meta, children: _Children) -> RankRef:
        group, node, gpu = children
        return RankRef(str(group), node, gpu, self._s(meta))

    def at(self, children: list[Token]) -> Index:
        return Index(int(children[0]), None, False)

    def slice(self, children: list[Token | None]) -> Index:
        lo, hi = children
        return Index(None if lo is None else int(lo), None if hi is None else int(hi), True)

    @v_args(meta=True)
    def list(self, meta: Meta, children: list[Value | None]) -> ListValue:
        return ListValue(tuple(c for c in children if c is not None), self._s(meta))


def parse_text(text: str, path: str) -> File:
    """Parse one file; syntax errors become a located `SpecError`."""
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as err:
        raise SpecError(_syntax_diagnostic(err, text, path)) from None
    _check_depth(tree, path)
    items = _ToAst(path).transform(tree)
    return File(path, tuple(weave_comments(items, scan_comments(text), path)))


MAX_NESTING = 32  # blocks and lists inside each other; real specs need about 4


def _check_depth(tree: Tree[Token], path: str) -> None:
    """Refuse absurd nesting before the recursive passes (transform, convert, print) meet it."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        nests = node.data in ("block", "list")
        if nests and depth == MAX_NESTING:
            raise SpecError.at(_span(path, node.meta), f"blocks and lists are nested more than {MAX_NESTING} "
                                                       "levels deep here")
        stack += [(child, depth + nests) for child in node.children if isinstance(child, Tree)]


_TOKEN_WORDS = {
    "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'", "EQUAL": "'='",
    "COMMA": "','", "SEMICOLON": "';'", "COLON": "':'", "_NL": "a new line", "NAME": "a name",
    "NUMBER": "a number", "INT": "a whole number", "STRING": "a string", "UNIT": "a unit",
    "AUTO": "'auto'", "USE": "'use'", "DIGIT_WORD": "a name", "__ANON_0": "'<->'",
    "__ANON_1": "'..'", "MORETHAN": "'>'", "LESSTHAN": "'<'", "MINUS": "'-'",
    "$END": "the end of the file",
}
_SEPARATORS = {"_NL", "COMMA", "SEMICOLON"}
# What a value may start with; said as "a value" when all of them are expected.
_VALUE_START = {"'['", "'auto'", "a name", "a number", "a string"}


def _describe_expected(expected: set[str]) -> str:
    from hetc.frontend.values import words   # values imports this module

    said = {_TOKEN_WORDS.get(t, _literal_word(t)) for t in expected}
    if _VALUE_START <= said:
        said = (said - _VALUE_START) | {"a value"}
    return f"; expected {words(sorted(said))}" if said else ""


def _literal_word(term: str) -> str:
    pattern = _parser().get_terminal(term).pattern if term in _terminal_names() else None
    if pattern is not None and pattern.type == "str":
        return f"'{pattern.value}'"
    return "a value"   # never a grammar-internal terminal name


@functools.cache
def _terminal_names() -> frozenset[str]:
    return frozenset(t.name for t in _parser().terminals)


def _syntax_diagnostic(err: UnexpectedInput, text: str, path: str) -> Diagnostic:
    if isinstance(err, UnexpectedEOF) or (
        isinstance(err, UnexpectedToken) and err.token.type == "$END"
    ):
        line, col = _end_position(text)
        return Diagnostic(Span(path, line, col, line, col + 1),
                          "unexpected end of input" + _describe_expected(_expected_at_end(err)))
    if isinstance(err, UnexpectedCharacters):
        return _bad_character(err, text, path)
    assert isinstance(err, UnexpectedToken)
    tok = err.token
    expected = set(err.accepts or err.expected)
    missing = _missing_separator(tok, expected, text, path)
    if missing is not None:
        return missing
    shown = "end of line" if tok.type == "_NL" else repr(str(tok))
    line, column = _known(tok.line, tok), _known(tok.column, tok)
    end_col = column + 1 if tok.type == "_NL" else (tok.end_column or column + 1)
    return Diagnostic(Span(path, line, column, line, end_col),
                      f"unexpected {shown}" + _describe_expected(expected) + _lone_auto(text, line, column))


_LONE_AUTO = re.compile(r"(?:^|[{,;])\s*auto\s*$")


def _lone_auto(text: str, line: int, column: int) -> str:
    """`parallel { auto }`: the word the statement before the unexpected token is, where it is `auto` alone,
    gets what to write instead."""
    lines = text.split("\n")
    before = lines[line - 1][: column - 1] if line <= len(lines) else ""
    if not _LONE_AUTO.search(before):
        return ""
    return ("; `auto` alone is no statement: an empty `parallel { }` leaves every choice to the planner, or "
            "write `KEY = auto` for one")


def _expected_at_end(err: UnexpectedEOF | UnexpectedToken) -> set[str]:
    """What the parser wanted when the input ended: an EOF's `expected`, else the token's."""
    if isinstance(err, UnexpectedEOF):
        return {str(t) for t in err.expected}
    return set(err.expected or err.accepts or ())


def _bad_character(err: UnexpectedCharacters, text: str, path: str) -> Diagnostic:
    at = Span(path, err.line, err.column, err.line, err.column + 1)
    pos = _offset(err)
    ch = text[pos] if pos < len(text) else ""
    if ch == '"':
        return Diagnostic(at, "this string is not closed: a string ends with '\"' on the same line")
    what = f"unexpected character {ch!r}" if ch.isprintable() else f"unexpected byte {ch!r}"
    return Diagnostic(at, what + _describe_expected(_accepted_before(text, pos, err.allowed)))


def _offset(err: UnexpectedCharacters) -> int:
    """Where in the text the lexer stopped. lark's base class declares `pos_in_stream = None`, which mypy
    takes for its type; UnexpectedCharacters sets it to the offset."""
    pos: object = err.pos_in_stream
    if not isinstance(pos, int):
        raise InternalError(f"lark's UnexpectedCharacters without an offset: {err!r}")
    return pos


def _accepted_before(text: str, pos: int, fallback: Collection[str] | None) -> set[str]:
    """The tokens the parser accepts at `pos`, from a parse of the text before it.

    The lexer's `allowed` set belongs to a state LALR shares between contexts
    (a block body and a list), so it may name ']' inside a block; re-parsing
    the prefix and asking the parser gives only what is really possible.
    """
    try:
        interactive = _parser().parse_interactive(text[:pos])
        interactive.exhaust_lexer()
        # lark's InteractiveParser.accepts has no annotations (it returns a set of terminal names)
        accepted: set[str] = interactive.accepts()  # type: ignore[no-untyped-call]
        return accepted - {"$END"}
    except UnexpectedInput:
        return set(fallback or ())


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_TRAILING_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)\s*$")


def _missing_separator(tok: Token, expected: set[str], text: str, path: str) -> Diagnostic | None:
    """`a = 4  b = 5` on one line: lark reads `4 b` as a number with unit `b`
    and stumbles on the second '='. Point at `b` and say what is missing."""
    if not expected & _SEPARATORS:
        return None
    line, column = _known(tok.line, tok), _known(tok.column, tok)
    # `arch = llama heads = 4`: a second statement starts at the name (which the lexer may call a unit)
    if tok.type in ("NAME", "UNIT") and _NAME.fullmatch(str(tok)):
        name = str(tok)
        return Diagnostic(Span(path, line, column, line, column + len(name)), _separator_message(name))
    if tok.type != "EQUAL":
        return None
    lines = text.split("\n")
    before = lines[line - 1][: column - 1] if line <= len(lines) else ""
    found = _TRAILING_NAME.search(before)
    if found is None or not before[: found.start()].strip():
        return None
    col = found.start() + 1
    return Diagnostic(Span(path, line, col, line, col + len(found.group(1))),
                      _separator_message(found.group(1)))


def _separator_message(name: str) -> str:
    return f"expected ',', ';' or a new line before '{name}': statements on one line are separated by ',' or ';'"


def _end_position(text: str) -> tuple[int, int]:
    stripped = text.rstrip()
    if not stripped:
        return 1, 1
    lines = stripped.split("\n")
    return len(lines), len(lines[-1]) + 1
