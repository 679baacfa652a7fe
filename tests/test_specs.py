"""Every bundled spec checks, and `hetc fmt` is idempotent on each."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hetc.cli import main
from hetc.ir.errors import Sources
from hetc.compiler import load_checked
from hetc.frontend.load import parse_file
from hetc.frontend.printer import format_file
from hetc.frontend.syntax import parse_text
from tests.conftest import SPECS, all_spec_files

SPEC_FILES = all_spec_files()


def test_there_are_specs():
    assert len(SPEC_FILES) >= 6


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_spec_checks(path):
    load_checked(path)


@pytest.fixture(scope="module")
def scratch_specs(tmp_path_factory) -> Path:
    """A copy of specs/, so that a formatted spec sits where its relative `use`s and data paths resolve."""
    root = tmp_path_factory.mktemp("fmt") / "specs"
    shutil.copytree(SPECS, root)
    return root


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_fmt_is_idempotent_and_keeps_the_spec(path, scratch_specs):
    once = format_file(parse_file(path, Sources()))
    twice = format_file(parse_text(once, str(path)))
    assert once == twice
    copy = scratch_specs / path.relative_to(SPECS)
    copy.write_text(once)
    assert load_checked(copy)[0].spec == load_checked(path)[0].spec


def test_cli_check_exit_codes(tmp_path, capsys):
    assert main(["check", str(SPEC_FILES[0])]) == 0
    bad = tmp_path / "bad.het"
    bad.write_text("model m {\n  layers = -1\n}\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:12: error: 'layers' must be positive, got -1" in err
