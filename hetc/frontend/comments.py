"""Comments of a .het file: found by a scan of the text, woven into the syntax tree.

The grammar ignores comments (they may appear anywhere), so `hetc fmt` would
lose them; `scan_comments` finds them and `weave_comments` puts each one
where it belongs among the statements, following Note [comments].
"""

from __future__ import annotations

from typing import NamedTuple

from hetc.ir.errors import Span
from hetc.frontend.tree import Block, Comment, Item

__all__ = ["RawComment", "scan_comments", "weave_comments"]

# Note [comments]: lark drops ignored tokens, so comments are collected by a
# scan of the text and woven back in by position. A comment on a line of its
# own becomes an item before the next statement of the innermost block around
# it. A comment after code on the same line is a *trailing* comment: of the
# statement or block that ends on that line before it (`}  # end`), or, on a
# block's first line, of its opening brace (`stage s {  # why`). Lines count
# "\n" only, as lark does.


class RawComment(NamedTuple):
    text: str
    line: int
    column: int
    end_column: int
    code_before: bool


def scan_comments(text: str) -> list[RawComment]:
    """Comments outside strings, with their line and column."""
    found: list[RawComment] = []
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
                found.append(RawComment(body, lineno, i + 1, i + 1 + len(body), bool(line[:i].strip())))
                break
            i += 1
    return found


def weave_comments(items: list[Item], comments: list[RawComment], path: str) -> list[Item]:
    """Put each comment into the item list of the block that contains it."""
    if not comments:
        return items
    return _weave(items, sorted(comments, key=lambda c: (c.line, c.column)), path)


def _comment(c: RawComment, trailing: bool, path: str) -> Comment:
    return Comment(c.text, trailing, Span(path, c.line, c.column, c.line, c.end_column))


def _weave(items: list[Item], comments: list[RawComment], path: str) -> list[Item]:
    """`items` of one block body with `comments` (all within that body) placed among them."""
    out: list[Item] = []
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
