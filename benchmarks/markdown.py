"""Replace one `## ` section of docs/benchmarks.md, keeping every other section."""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["BENCHMARKS_MD", "publish", "replace_section"]

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def publish(heading: str, text: str, write: bool) -> int:
    """Print a benchmark's section; with `write`, also put it in docs/benchmarks.md. The exit status."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    if write:
        replace_section(BENCHMARKS_MD, heading, text)
        print(f"updated {BENCHMARKS_MD.name}: {heading}", file=sys.stderr)
    return 0


def replace_section(path: Path, heading: str, text: str) -> None:
    """Put `text` (which starts with `heading`) in place of that section of `path`, or append it."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old) if pattern.search(old) \
        else old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new.rstrip("\n") + "\n")
