"""Internal invariants hold under `python -O` too: they raise InternalError, they are not bare asserts."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import ROOT

# Modules whose invariants were asserts; each check below breaks one on purpose.
_BROKEN = """
import torch
from torch import nn
from hetc.ir.errors import InternalError
from hetc.runtime.flat import FlatLayout
layout = FlatLayout.of(nn.Linear(3, 2), num_shards=2)
for broken in (lambda: layout.shard_range(2), lambda: layout.views(torch.zeros(1)),
               lambda: FlatLayout.of(nn.Linear(3, 2), num_shards=0)):
    try:
        broken()
    except InternalError as err:
        print("InternalError:", err)
    else:
        print("passed silently")
"""


def test_broken_invariants_raise_under_python_O():
    out = subprocess.run([sys.executable, "-O", "-c", _BROKEN], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert lines == ["InternalError: shard 2 of 2", "InternalError: buffer of 1 for layout of 8",
                     "InternalError: a layout needs a shard, not 0"], out.stdout


def _narrows_only(test: ast.expr) -> bool:
    """`x is not None`, `isinstance(x, T)` or an `and` of them: a narrowing for the type checker."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return all(_narrows_only(v) for v in test.values)
    if isinstance(test, ast.Compare):
        return [type(op) for op in test.ops] == [ast.IsNot] and isinstance(test.comparators[0], ast.Constant) \
            and test.comparators[0].value is None
    return isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"


def _asserts_with_a_message(folder: str) -> list[str]:
    """`assert cond, "why"` in library code: an invariant written as an assert (gone under -O)."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert) and node.msg is not None and not _narrows_only(node.test):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_library_code_states_invariants_as_checks_not_asserts():
    # An assert that only narrows a type for the checker may stay (with or without a reason).
    assert [hit for folder in ("hetc", "passes", "runtime", "grammar") for hit in _asserts_with_a_message(folder)] \
        == []
