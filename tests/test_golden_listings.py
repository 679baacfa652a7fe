"""Golden listings: a small compiled program per schedule kind, compared exactly.

A failure shows the diff; if the change is intended, regenerate with
`.venv/bin/python -m tests.golden.regenerate` and review `git diff tests/golden`.
"""

from __future__ import annotations

import difflib

import pytest

from hetc.passes.verify import verify
from hetc.ir.program import Program, RankProgram
from hetc.ir.spec import ScheduleKind
from tests.golden.cases import CASES, GOLDEN_DIR, golden_path, render
from tests.plans import compile_plan


def test_every_schedule_kind_has_a_golden_listing():
    kinds = {compile_plan(spec, schedule).pipeline.schedule for spec, schedule in CASES.values()}
    assert kinds == set(ScheduleKind)


def test_no_stray_golden_files():
    assert {p.stem for p in GOLDEN_DIR.glob("*.txt")} == set(CASES)


@pytest.mark.parametrize("name", CASES)
def test_golden_listing(name):
    path = golden_path(name)
    assert path.is_file(), f"missing {path}; create it with: .venv/bin/python -m tests.golden.regenerate {name}"
    expected, actual = path.read_text(), render(name)
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            f"{path.name} (checked in)", f"{path.name} (compiled now)", n=2))
        pytest.fail(f"the compiled listing of '{name}' changed; if intended, run "
                    f".venv/bin/python -m tests.golden.regenerate {name}\n{diff[:6000]}")


@pytest.mark.parametrize("name", CASES)
def test_golden_listing_reads_back_and_verifies(name):
    """The checked-in text is a valid program on its own: it parses and the verifier accepts it."""
    spec, schedule = CASES[name]
    lowered = compile_plan(spec, schedule)
    groups_text, *rank_texts = golden_path(name).read_text().split("\nrank ")
    groups = Program.parse_groups(groups_text)
    ranks = tuple(RankProgram.from_text("rank " + text) for text in rank_texts)
    program = Program(ranks, groups)
    assert program == lowered.program
    verify(program, lowered.plan)
