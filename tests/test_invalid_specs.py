"""Every spec under tests/invalid/ fails with exactly the errors it expects.

Each case states its errors in comments, one per line, in the order the CLI
prints them (by file, line and column):

    # expect: 4:12: 'layers' must be positive, got -1
    # expect: _other.het:2:1: import cycle: a.het -> _other.het -> a.het

`LINE:COL: message` is located in the case's own file; a leading `FILE:`
names another file, relative to tests/invalid/. Files whose names start
with `_` are shared helpers that the cases import, not cases themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hetc.cli import main
from hetc.ir.errors import SpecError
from hetc.compiler import load_checked

INVALID = Path(__file__).resolve().parent / "invalid"
CASES = sorted(p for p in INVALID.glob("*.het") if not p.name.startswith("_"))
HELPERS = sorted(p for p in INVALID.glob("_*.het"))
_EXPECT = re.compile(r"^# expect: (.*)$", re.MULTILINE)


def expected_errors(case: Path) -> list[str]:
    return _EXPECT.findall(case.read_text(encoding="utf-8", errors="replace"))


def actual_errors(case: Path) -> list[str]:
    """Load and validate `case` from inside tests/invalid/ as `hetc check` does, as `LINE:COL: message` lines."""
    try:
        load_checked(case.name, require_fit=True)
    except SpecError as err:
        return [_located(d.span, d.message, case.name) for d in err.diagnostics]
    return []


def _located(span, message: str, own_file: str) -> str:
    where = f"{span.line}:{span.col}" if span.file == own_file else f"{span.file}:{span.line}:{span.col}"
    return f"{where}: {message}"


def test_there_are_enough_cases():
    assert len(CASES) >= 70


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_invalid_spec(case: Path, monkeypatch):
    expected = expected_errors(case)
    assert expected, f"{case.name} states no '# expect:' line"
    monkeypatch.chdir(INVALID)
    assert actual_errors(case) == expected


def test_every_helper_is_used():
    text = "\n".join(c.read_text(errors="replace") for c in CASES + HELPERS)
    unused = [h.name for h in HELPERS if f'"{h.name}"' not in text]
    assert not unused


def test_cli_prints_every_error_with_source_and_caret(monkeypatch, capsys):
    monkeypatch.chdir(INVALID)
    assert main(["check", "multi_model_errors.het"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "multi_model_errors.het:7:12: error: 'layers' must be positive, got 0"
    assert lines[1] == "      layers = 0"
    assert lines[2] == " " * (4 + 11) + "^"  # four spaces of indent, then column 12
    assert lines[3].startswith("multi_model_errors.het:8:12: error: 'hidden' expects a whole number")
    assert lines[5] == " " * (4 + 11) + "^~~~~~"  # under "64 GiB"
    assert lines[-1] == "3 errors"


def test_cli_names_a_note_where_the_first_definition_is(monkeypatch, capsys):
    monkeypatch.chdir(INVALID)
    assert main(["check", "duplicate_model_imported.het"]) == 2
    err = capsys.readouterr().err
    assert "duplicate_model_imported.het:4:1: error: duplicate 'model' block in the spec" in err
    assert "_job.het:5:1: note: first defined here" in err
