"""Parse .het text into a small syntax tree with spans.

This is the only module that touches lark. Its output (`File`, `Block`,
`Attr` and the value nodes) is plain frozen dataclasses; `hetc.convert`
turns it into the typed Spec and `hetc.printer` prints it back.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from hetc.errors import Diagnostic, Span, SpecError
from hetc.grammar import GRAMMAR_PATH

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


@dataclass(frozen=True, slots=True)
class Auto:
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Number:
    text: str
    unit: str | None
    span: Span = field(compare=False)

    @property
    def value(self) -> float:
        return float(self.text)

    def is_int(self) -> bool:
        return self.text.lstrip("+-").isdigit()


@dataclass(frozen=True, slots=True)
class String:
    value: str
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Word:
    name: str
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class LayerRange:
    first: str
    last: str
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Index:
    """`i` (start=i, stop=None, is_slice=False) or `a:b` (either side optional)."""

    start: int | None
    stop: int | None
    is_slice: bool


@dataclass(frozen=True, slots=True)
class RankRef:
    group: str
    node: Index
    gpu: Index | None
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class ListValue:
    items: tuple[Value, ...]
    span: Span = field(compare=False)


Value = Auto | Number | String | Word | LayerRange | RankRef | ListValue


@dataclass(frozen=True, slots=True)
class Comment:
    """A comment, kept so `hetc fmt` does not lose it."""

    text: str
    trailing: bool
    span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Attr:
    key: str
    value: Value
    span: Span = field(compare=False)
    key_span: Span = field(compare=False)


@dataclass(frozen=True, slots=True)
class Block:
    kind: str
    label: str | None
    peer: str | None
    items: tuple[Item, ...]
    span: Span = field(compare=False)
    kind_span: Span = field(compare=False)
    label_spans: tuple[Span, ...] = field(default=(), compare=False)  # of label, then peer

    @property
    def head_span(self) -> Span:
        return self.kind_span


@dataclass(frozen=True, slots=True)
class Use:
    path: str
    span: Span = field(compare=False)


Item = Attr | Block | Use | Comment


@dataclass(frozen=True, slots=True)
class File:
    path: str
    items: tuple[Item, ...]


# Note [comments]: lark drops ignored tokens, so comments are collected by a
# scan of the text and woven back in by position. A comment on a line of its
# own becomes an item before the next statement of the innermost block around
# it. A comment after code on the same line is a *trailing* comment: of the
# statement or block that ends on that line before it (`}  # end`), or, on a
# block's first line, of its opening brace (`stage s {  # why`). Lines count
# "\n" only, as lark does.

@functools.cache
def _parser() -> Lark:
    return Lark(
        GRAMMAR_PATH.read_text(),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
    )


def _span(path: str, meta_or_token) -> Span:
    m = meta_or_token
    if isinstance(m, _RawComment):
        return Span(path, m.line, m.column, m.line, m.end_column)
    if isinstance(m, Token):
        return Span(path, m.line, m.column, m.end_line or m.line, m.end_column or m.column + 1)
    return Span(path, m.line, m.column, m.end_line, m.end_column)


_ESCAPE = re.compile(r"\\(.)")


def _unquote(text: str) -> str:
    """The value of a string token: `\\x` stands for `x` (so `\\"` is a quote)."""
    return _ESCAPE.sub(r"\1", text[1:-1])


class _ToAst(Transformer):
    def __init__(self, path: str):
        super().__init__(visit_tokens=False)
        self.path = path

    def _s(self, x) -> Span:
        return _span(self.path, x)

    @v_args(meta=True)
    def start(self, meta, items):
        return list(items)

    @v_args(meta=True)
    def use(self, meta, children):
        (tok,) = children
        return Use(_unquote(tok), self._s(meta))

    @v_args(meta=True)
    def block(self, meta, children):
        kind, label, peer, *items = children
        label_spans = tuple(self._s(tok) for tok in (label, peer) if tok is not None)
        return Block(str(kind), self._label(label), self._label(peer), tuple(items), self._s(meta),
                     self._s(kind), label_spans)

    @staticmethod
    def _label(tok) -> str | None:
        if tok is None:
            return None
        return _unquote(tok) if tok.type == "STRING" else str(tok)

    @v_args(meta=True)
    def attr(self, meta, children):
        key, value = children
        return Attr(str(key), value, self._s(meta), self._s(key))

    @v_args(meta=True)
    def auto(self, meta, _):
        return Auto(self._s(meta))

    @v_args(meta=True)
    def number(self, meta, children):
        num, unit = children
        return Number(str(num), None if unit is None else str(unit), self._s(meta))

    @v_args(meta=True)
    def string(self, meta, children):
        return String(_unquote(children[0]), self._s(meta))

    @v_args(meta=True)
    def word(self, meta, children):
        return Word(str(children[0]), self._s(meta))

    @v_args(meta=True)
    def layer_range(self, meta, children):
        return LayerRange(str(children[0]), str(children[1]), self._s(meta))

    @v_args(meta=True)
    def rank_ref(self, meta, children):
        group, node, gpu = children
        return RankRef(str(group), node, gpu, self._s(meta))

    def at(self, children):
        return Index(int(children[0]), None, False)

    def slice(self, children):
        lo, hi = children
        return Index(None if lo is None else int(lo), None if hi is None else int(hi), True)

    @v_args(meta=True)
    def list(self, meta, children):
        return ListValue(tuple(c for c in children if c is not None), self._s(meta))


def parse_text(text: str, path: str) -> File:
    """Parse one file; syntax errors become a located `SpecError`."""
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as err:
        raise SpecError(_syntax_diagnostic(err, text, path)) from None
    _check_depth(tree, path)
    items = _ToAst(path).transform(tree)
    return File(path, tuple(_weave_comments(items, _scan_comments(text), path)))


MAX_NESTING = 32  # blocks and lists inside each other; real specs need about 4


def _check_depth(tree: Tree, path: str) -> None:
    """Refuse absurd nesting before the recursive passes (transform, convert, print) meet it."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        nests = node.data in ("block", "list")
        if nests and depth == MAX_NESTING:
            raise SpecError.at(_span(path, node.meta), f"blocks and lists are nested more than {MAX_NESTING} "
                                                       "levels deep here")
        stack += [(child, depth + nests) for child in node.children if isinstance(child, Tree)]


class _RawComment(NamedTuple):
    text: str
    line: int
    column: int
    end_column: int
    code_before: bool


def _scan_comments(text: str) -> list[_RawComment]:
    """Comments outside strings, with their line and column."""
    found: list[_RawComment] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        in_string = False
        i = 0
        while i < len(line):
            ch = line[i]
            if in_string:
                if ch == "\\":
                    i += 1
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch == "#" or line.startswith("//", i):
                body = line[i:].rstrip()
                found.append(_RawComment(body, lineno, i + 1, i + 1 + len(body), bool(line[:i].strip())))
                break
            i += 1
    return found


def _weave_comments(items: list, comments: list[_RawComment], path: str) -> list:
    """Put each comment into the item list of the block that contains it."""
    if not comments:
        return items
    return _weave(items, sorted(comments, key=lambda c: (c.line, c.column)), path)


def _comment(c: _RawComment, trailing: bool, path: str) -> Comment:
    return Comment(c.text, trailing, _span(path, c))


def _weave(items, comments: list[_RawComment], path: str) -> list:
    """`items` of one block body with `comments` (all within that body) placed among them."""
    out: list = []
    rest = list(comments)
    for n, item in enumerate(items):
        span = item.span
        out += [_comment(c, c.code_before, path) for c in rest if c.line < span.line]
        mine = [c for c in rest if span.line <= c.line <= span.end_line]
        rest = [c for c in rest if c.line > span.end_line]
        after = [c for c in mine if c.line == span.end_line and c.column >= span.end_col]
        within = [c for c in mine if c not in after]
        following = items[n + 1] if n + 1 < len(items) else None
        if following is not None and following.span.line == span.end_line:
            rest, after = after + rest, []  # `a = 1; b = 2  # c` belongs to b
        if isinstance(item, Block):
            body = _weave(list(item.items), within, path)
            out.append(Block(item.kind, item.label, item.peer, tuple(body), item.span, item.kind_span,
                             item.label_spans))
        else:  # a statement spread over lines (a long list): keep its comments next to it
            out += [_comment(c, False, path) for c in within if not c.code_before]
            out.append(item)
            after = [c for c in within if c.code_before] + after
        out += [_comment(c, True, path) for c in after]
    out += [_comment(c, c.code_before, path) for c in rest]  # code before: an empty block's head
    return out


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
    words = {_TOKEN_WORDS.get(t, _literal_word(t)) for t in expected}
    if _VALUE_START <= words:
        words = (words - _VALUE_START) | {"a value"}
    words = sorted(words)
    if not words:
        return ""
    if len(words) == 1:
        return f"; expected {words[0]}"
    return "; expected " + ", ".join(words[:-1]) + " or " + words[-1]


def _literal_word(term: str) -> str:
    pattern = _parser().get_terminal(term).pattern if term in _terminal_names() else None
    if pattern is not None and pattern.type == "str":
        return f"'{pattern.value}'"
    return term.lower()


@functools.cache
def _terminal_names() -> frozenset[str]:
    return frozenset(t.name for t in _parser().terminals)


def _syntax_diagnostic(err: UnexpectedInput, text: str, path: str) -> Diagnostic:
    if isinstance(err, UnexpectedEOF) or (
        isinstance(err, UnexpectedToken) and err.token.type == "$END"
    ):
        line, col = _end_position(text)
        expected = getattr(err, "expected", None) or getattr(err, "accepts", set())
        return Diagnostic(Span(path, line, col, line, col + 1),
                          "unexpected end of input" + _describe_expected(set(expected)))
    if isinstance(err, UnexpectedCharacters):
        return _bad_character(err, text, path)
    assert isinstance(err, UnexpectedToken)
    tok = err.token
    expected = set(err.accepts or err.expected)
    missing = _missing_separator(tok, expected, text, path)
    if missing is not None:
        return missing
    shown = "end of line" if tok.type == "_NL" else repr(str(tok))
    end_col = tok.column + 1 if tok.type == "_NL" else (tok.end_column or tok.column + 1)
    return Diagnostic(Span(path, tok.line, tok.column, tok.line, end_col),
                      f"unexpected {shown}" + _describe_expected(expected))


def _bad_character(err: UnexpectedCharacters, text: str, path: str) -> Diagnostic:
    at = Span(path, err.line, err.column, err.line, err.column + 1)
    ch = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
    if ch == '"':
        return Diagnostic(at, "this string is not closed: a string ends with '\"' on the same line")
    what = f"unexpected character {ch!r}" if ch.isprintable() else f"unexpected byte {ch!r}"
    return Diagnostic(at, what + _describe_expected(_accepted_before(text, err.pos_in_stream, err.allowed)))


def _accepted_before(text: str, pos: int, fallback) -> set[str]:
    """The tokens the parser accepts at `pos`, from a parse of the text before it.

    The lexer's `allowed` set belongs to a state LALR shares between contexts
    (a block body and a list), so it may name ']' inside a block; re-parsing
    the prefix and asking the parser gives only what is really possible.
    """
    try:
        interactive = _parser().parse_interactive(text[:pos])
        interactive.exhaust_lexer()
        return set(interactive.accepts()) - {"$END"}
    except UnexpectedInput:
        return set(fallback or ())


_TRAILING_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)\s*$")


def _missing_separator(tok: Token, expected: set[str], text: str, path: str) -> Diagnostic | None:
    """`a = 4  b = 5` on one line: lark reads `4 b` as a number with unit `b`
    and stumbles on the second '='. Point at `b` and say what is missing."""
    if tok.type != "EQUAL" or not expected & _SEPARATORS:
        return None
    lines = text.split("\n")
    before = lines[tok.line - 1][: tok.column - 1] if tok.line <= len(lines) else ""
    found = _TRAILING_NAME.search(before)
    if found is None or not before[: found.start()].strip():
        return None
    col = found.start() + 1
    return Diagnostic(Span(path, tok.line, col, tok.line, col + len(found.group(1))),
                      f"expected ',', ';' or a new line before '{found.group(1)}': "
                      "statements on one line are separated by ',' or ';'")


def _end_position(text: str) -> tuple[int, int]:
    stripped = text.rstrip()
    if not stripped:
        return 1, 1
    lines = stripped.split("\n")
    return len(lines), len(lines[-1]) + 1
