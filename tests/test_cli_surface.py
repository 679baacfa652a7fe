"""The CLI surface, pinned: every verb with its options and arguments as argparse defines them.

A change to a verb's flags (a rename, a new default, a removed choice) fails here with the
diff; if it is intended, regenerate with `.venv/bin/python -m tests.test_cli_surface` and
review `git diff tests/cli_surface.txt`. Moving code between modules must leave it as it is.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from hetc.cli import VERBS, build_parser

__all__ = ["render_surface"]

SURFACE_PATH = Path(__file__).with_name("cli_surface.txt")


def _action_line(action: argparse.Action) -> str:
    """One line per option or argument: its names and what argparse does with it."""
    names = ", ".join(action.option_strings) or action.dest
    fields = [f"dest={action.dest}", f"kind={type(action).__name__}", f"nargs={action.nargs!r}",
              f"default={action.default!r}", f"required={action.required}"]
    if action.choices is not None and not isinstance(action.choices, dict):
        fields.append(f"choices={list(action.choices)!r}")
    if action.type is not None:
        fields.append(f"type={getattr(action.type, '__name__', repr(action.type))}")
    if action.metavar is not None:
        fields.append(f"metavar={action.metavar!r}")
    return f"  {names}: {' '.join(fields)}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public listing of its actions
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parser_lines(title: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [title]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines.append(f"  {action.dest}: subcommands {sorted(action.choices)}")
        else:
            lines.append(_action_line(action))
    for name, sub in sorted(_subparsers(parser).items()):
        lines.extend(_parser_lines(f"{title} {name}", sub))
    return lines


def render_surface() -> str:
    """The whole surface as text: the top-level parser, then each verb (and its own subverbs)."""
    parser = build_parser()
    return "\n".join(_parser_lines("hetc", parser)) + "\n"


def test_cli_surface_is_unchanged() -> None:
    expected = SURFACE_PATH.read_text()
    actual = render_surface()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                        "tests/cli_surface.txt", "argparse"))
    assert actual == expected, ("the CLI surface changed; if intended: "
                                f".venv/bin/python -m tests.test_cli_surface\n{diff[:6000]}")


def test_every_verb_is_listed() -> None:
    names = set(_subparsers(build_parser()))
    assert names == {verb.rstrip("_") for verb in VERBS}


if __name__ == "__main__":
    SURFACE_PATH.write_text(render_surface())
    sys.exit(0)
