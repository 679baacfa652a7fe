"""Every bundled spec checks, and `hetc fmt` is idempotent on each."""

from __future__ import annotations

import pytest

from hetc.cli import main
from hetc.errors import Sources
from hetc.frontend import load_checked
from hetc.load import parse_file
from hetc.printer import format_file
from hetc.syntax import parse_text
from tests.conftest import all_spec_files

SPEC_FILES = all_spec_files()


def test_there_are_specs():
    assert len(SPEC_FILES) >= 6


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_spec_checks(path):
    load_checked(path)


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_fmt_is_idempotent_and_keeps_the_spec(path, tmp_path):
    once = format_file(parse_file(path, Sources()))
    twice = format_file(parse_text(once, str(path)))
    assert once == twice
    copy = path.parent / f".fmt-test-{path.name}"
    try:
        copy.write_text(once)
        assert load_checked(copy)[0].spec == load_checked(path)[0].spec
    finally:
        copy.unlink()


def test_cli_check_exit_codes(tmp_path, capsys):
    assert main(["check", str(SPEC_FILES[0])]) == 0
    bad = tmp_path / "bad.het"
    bad.write_text("model m {\n  layers = -1\n}\n")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:12: error: 'layers' must be positive, got -1" in err
