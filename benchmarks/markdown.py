"""Replace one `## ` section of docs/benchmarks.md, keeping every other section."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["replace_section"]


def replace_section(path: Path, heading: str, text: str) -> None:
    """Put `text` (which starts with `heading`) in place of that section of `path`, or append it."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old) if pattern.search(old) \
        else old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new.rstrip("\n") + "\n")
