"""A steps x ranks grid of a Program, for terminals and verifier errors.

Columns are ranks, rows are instruction indices, cells are the instruction
text shortened to fit. With `focus` (rank -> instruction index) only those
ranks are shown, only `context` rows either side of each focus, and the
focus cell is marked, in the style of torch.distributed.pipelining's
`_format_pipeline_order` (`<-- ERROR HERE`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hetc.ir.program import Instr, Program, RankProgram

__all__ = ["MAX_CELL", "render_grid", "short_text"]

MAX_CELL = 40          # widest cell, in characters
_MARK = "> "           # prefix of a focus cell
_GAP = "..."           # a row standing for skipped rows


def short_text(instr: Instr, width: int = MAX_CELL) -> str:
    """The instruction's text without what a reader needs least, cut to `width`.

    Dropped: the tensor shape (the longest, least telling part of a send or
    receive line) and a tensor word that the op allows only one of
    (`all_gather params`, `reduce_scatter grads`): nothing is lost.
    """
    words = str(instr).split()
    if len(instr.WHAT) == 1:
        words.pop(1)
    text = " ".join(w for w in words if not w.startswith("shape="))
    return text if len(text) <= width else text[: width - 1] + "~"


def render_grid(program: Program, focus: dict[int, int] | None = None, context: int = 4,
                *, ranks: Sequence[int] | None = None) -> str:
    """The grid as text (no trailing newline).

    `ranks` restricts the columns when there is no focus; with a focus the
    columns are the focus ranks. Rows are every instruction index, or, with
    a focus, the indices within `context` of any focus index.
    """
    columns = _columns(program, focus, ranks)
    rows = _rows(columns, focus, context)
    cells = [[_cell(rp, i, focus) for rp in columns] if i is not None else [""] * len(columns)
             for i in rows]
    headers = [f"rank {rp.rank} s{rp.stage}/l{rp.lane}" for rp in columns]
    widths = [max([len(h)] + [len(row[c]) for row in cells]) for c, h in enumerate(headers)]
    labels = [f"step {i:>{_digits(columns)}}:" if i is not None else _GAP for i in rows]
    label_width = max([len(label) for label in labels] + [len("step")])
    lines = [(" " * label_width + "  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths))).rstrip()]
    for label, index, row in zip(labels, rows, cells):
        line = label.ljust(label_width) + "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths))
        # padded to full width first, so that every marker lines up at the right
        lines.append((line + _error_note(index, columns, focus)).rstrip())
    return "\n".join(lines)


def _columns(program: Program, focus: dict[int, int] | None,
             ranks: Sequence[int] | None) -> list[RankProgram]:
    by_rank = {rp.rank: rp for rp in program.ranks}
    wanted: Iterable[int] = sorted(focus) if focus else (ranks if ranks is not None else sorted(by_rank))
    missing = [r for r in wanted if r not in by_rank]
    if missing:
        raise ValueError(f"no rank {missing[0]} in a program of {len(by_rank)} ranks")
    return [by_rank[r] for r in wanted]


def _rows(columns: list[RankProgram], focus: dict[int, int] | None, context: int) -> list[int | None]:
    """Instruction indices to show in order; None marks a gap of skipped rows."""
    length = max((len(rp.instrs) for rp in columns), default=0)
    if not focus:
        return list(range(length))
    shown: set[int] = set()
    for index in focus.values():
        shown.update(range(max(0, index - context), min(max(length, index + 1), index + context + 1)))
    rows: list[int | None] = []
    for i in sorted(shown):
        gap = (rows[-1] is not None and i != rows[-1] + 1) if rows else i > 0
        if gap:
            rows.append(None)
        rows.append(i)
    if rows and rows[-1] is not None and rows[-1] < length - 1:
        rows.append(None)
    return rows


def _cell(rp: RankProgram, index: int, focus: dict[int, int] | None) -> str:
    text = short_text(rp.instrs[index]) if index < len(rp.instrs) else ""
    if focus and focus.get(rp.rank) == index:
        return _MARK + (text or "(end of program)")
    return text


def _error_note(index: int | None, columns: list[RankProgram], focus: dict[int, int] | None) -> str:
    if not focus or index is None:
        return ""
    hit = [rp.rank for rp in columns if focus.get(rp.rank) == index]
    if not hit:
        return ""
    return "  <-- ERROR HERE" + (f" (rank {', '.join(map(str, hit))})" if len(columns) > 1 else "")


def _digits(columns: list[RankProgram]) -> int:
    return len(str(max((len(rp.instrs) for rp in columns), default=1)))
