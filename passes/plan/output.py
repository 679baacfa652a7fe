"""The planned spec as text: the main file with its `parallel` block replaced.

The main file keeps its `use` lines, comments and blocks; only the
`parallel` block (and, if the planner chose it, `micro_batch` in the main
file's `train` block) change. Written to another folder, relative `use`
paths are rewritten to still reach the files they imported.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TypeGuard

from hetc.frontend import syntax
from hetc.ir.errors import NO_SPAN, Diagnostic, InternalError, Span, SpecError
from hetc.frontend.load import BUNDLED_SPECS, LoadedSpec
from hetc.frontend.printer import format_items, spec_to_items
from hetc.ir.plan import Plan
from hetc.ir.spec import Spec

__all__ = ["planned_text"]


def planned_text(loaded: LoadedSpec, planned: Plan | None, out: Path | None = None, note: str = "") -> str:
    """The main file of `loaded`, with `planned`'s parallel plan (and micro-batch size), as .het text.

    `planned` None: the main file as it is (canonically formatted), for a plan with nothing to fill.
    """
    items = list(syntax.parse_text(loaded.path.read_text(), str(loaded.path)).items)
    if planned is not None:
        items = _replaced(loaded, items, planned, note)
    if out is not None:
        items = [_moved_use(item, loaded.path, out) if isinstance(item, syntax.Use) else item for item in items]
    return format_items(items)


def _replaced(loaded: LoadedSpec, items: list[syntax.Item], planned: Plan, note: str) -> list[syntax.Item]:
    where = next((i for i, item in enumerate(items) if _is_block(item, "parallel")), None)
    span = planned.parallel.span    # the planner fills the parallel block the spec wrote, where it wrote it
    if where is None and span == Span.file_start(loaded.path):
        # the file has no parallel block (hetc/frontend/load.py, with_plan_to_fill): the plan goes last
        where = len(items)
        items.append(syntax.Comment("", False, NO_SPAN))    # a slot, the block below takes it
    if where is None:
        raise SpecError([Diagnostic(span, f"the plan is written in {span.file}, not in {loaded.path}: "
                                    "plan that file")])
    (block,) = spec_to_items(Spec(parallel=planned.parallel))
    if not isinstance(block, syntax.Block):   # a parallel plan prints as its block, never as shorthand
        raise InternalError(f"the plan printed as {block!r}, not as a parallel block")
    if note:
        block = replace(block, items=(syntax.Comment(f"# {note}", False, NO_SPAN), *block.items))
    items[where] = block
    written = loaded.spec.train.micro_batch if loaded.spec.train is not None else None
    if planned.train.micro_batch != written:
        items = [_with_micro_batch(item, planned.train.micro_batch) if _is_block(item, "train") else item
                 for item in items]
    return items


def _is_block(item: syntax.Item, kind: str) -> TypeGuard[syntax.Block]:
    return isinstance(item, syntax.Block) and item.kind == kind


def _with_micro_batch(block: syntax.Block, micro_batch: int) -> syntax.Block:
    value = syntax.Number(str(micro_batch), None, NO_SPAN)
    attr = syntax.Attr("micro_batch", value, NO_SPAN, NO_SPAN)
    items = list(block.items)
    at = next((i for i, it in enumerate(items) if isinstance(it, syntax.Attr) and it.key == "global_batch"), -1)
    items.insert(at + 1, attr)
    return replace(block, items=tuple(items))


def _moved_use(use: syntax.Use, main: Path, out: Path) -> syntax.Use:
    """The same import seen from `out`'s folder (absolute paths and bundled imports stay as written)."""
    local = main.parent / use.path
    if Path(use.path).is_absolute() or not local.exists():
        return use  # absolute, or found in the bundled specs/ folder from anywhere
    moved = os.path.relpath(local.resolve(), out.resolve().parent)
    bundled = BUNDLED_SPECS / use.path
    if bundled.exists() and bundled.resolve() == local.resolve() and not (out.parent / use.path).exists():
        return use  # the bundled catalog: `use "catalog.het"` works from every folder
    return replace(use, path=moved)
