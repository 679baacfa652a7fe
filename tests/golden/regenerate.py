"""Rewrite the golden listings from the current compiler: `.venv/bin/python -m tests.golden.regenerate [NAME ...]`.

Run it after an intended change to lowering, then read `git diff tests/golden`
before committing: the diff is the change in what every rank does.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):   # run as a script: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.golden.cases import CASES, golden_path, render


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.stderr.write(f"unknown golden case(s) {', '.join(unknown)}; known: {', '.join(CASES)}\n")
        return 2
    for name in names or CASES:
        path = golden_path(name)
        text = render(name)
        changed = not path.is_file() or path.read_text() != text
        path.write_text(text)
        sys.stdout.write(f"{'updated' if changed else 'unchanged'} {path.name}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
