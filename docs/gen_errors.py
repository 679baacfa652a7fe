"""Generate docs/errors.md from the invalid-spec tests in tests/invalid/.

Every case there is a small spec with one or more mistakes; this script runs
`hetc check` on each, exactly as a user would, and writes the spec and the
output side by side, grouped by kind of mistake. The messages in the page
are therefore the messages hetc prints, and a test keeps the page current.

    python docs/gen_errors.py          # rewrite docs/errors.md
    python docs/gen_errors.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script, beside gen_language.py
from gen_language import write_or_check

from hetc.cli import main as hetc_main

__all__ = ["ERRORS_MD", "INVALID", "main", "render"]

DOCS = Path(__file__).resolve().parent
ERRORS_MD = DOCS / "errors.md"
INVALID = DOCS.parent / "tests" / "invalid"
SHOW_SOURCE_UP_TO = 16  # lines; longer cases link to their file instead

# Case-name prefix -> section title, in page order.
SECTIONS = {
    "syntax": "Syntax",
    "file": "Files",
    "import": "Imports",
    "unknown": "Unknown names",
    "duplicate": "Duplicate definitions",
    "value": "Values of the wrong kind",
    "key": "Values of the wrong kind",
    "block": "Values of the wrong kind",
    "label": "Block names",
    "size": "Sizes and bounds",
    "unit": "Units",
    "model": "Model shape and tensor/context parallelism",
    "batch": "Batch arithmetic",
    "zero": "ZeRO",
    "rank": "Rank sets",
    "layers": "Layers and stages",
    "lane": "Lanes and microbatch routing",
    "fit": "Memory",
    "data": "Training and evaluation data",
    "eval": "Training and evaluation data",
    "multi": "Several errors at once",
}
OTHER = "Other rules"

INTRO = """\
# Errors

`hetc check SPEC` (and every verb that reads a spec) reports mistakes the way
compilers do: `FILE:LINE:COL: error: message`, then the source line and a
caret under the offending text, and `note:` lines pointing at related places
("first defined here"). It reports every independent error it finds, then a
count, and exits with status 2. A syntax error stops the reading of its file
(later mistakes in it are not guessed at); other errors are collected
together, and errors that would only echo another one (the GPUs left over
by an unknown node group, the gap left by an unknown layer name) are not
repeated. Anything else that goes wrong is a bug in hetc: it says so and
exits with status 1 (`hetc --debug` shows the traceback).

Below, every error with an example. Each example is a test case in
`tests/invalid/`, shown with what `hetc check` prints for it (this page is
generated from them by `python docs/gen_errors.py`). The cases import two
small helpers: `_job.het` (the device catalog, a 4-layer model `tiny`, a
cluster `lab` of two nodes of four A100-80 (`a100`) and two nodes of two T4
(`t4`), and a train block with a global batch of 16 and micro batch of 2) and
`_model.het` (catalog, cluster and train, no model). A case's first lines,
its description and expected errors, are left out of the listing; line
numbers count from the top of the file.
"""


def _case_doc(text: str) -> str:
    first = text.split("\n", 1)[0]
    return first[2:].strip() if first.startswith("# ") else "(undocumented)"


def _shown_source(data: bytes) -> str:
    """The case without its header: the doc line and the `# expect:` lines."""
    text = _printable(data.decode("utf-8", errors="backslashreplace"))
    lines = text.split("\n")[1:]
    while lines and lines[0].startswith("# expect:"):
        lines.pop(0)
    return "\n".join(lines).rstrip("\n")


def check_output(case: Path) -> str:
    """What `hetc check CASE` prints, run from tests/invalid/ like a user would."""
    err = io.StringIO()
    here = os.getcwd()
    os.chdir(INVALID)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = hetc_main(["check", case.name])
    finally:
        os.chdir(here)
    return _printable(err.getvalue().rstrip("\n")) + f"\n(exit status {code})"


def _printable(text: str) -> str:
    """Control characters (a NUL byte in a case) as escapes, so the page stays text."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _section_of(case: Path) -> str:
    return SECTIONS.get(case.stem.split("_", 1)[0], OTHER)


def render() -> str:
    cases = sorted(p for p in INVALID.glob("*.het") if not p.name.startswith("_"))
    order = list(dict.fromkeys([*SECTIONS.values(), OTHER]))
    by_section: dict[str, list[Path]] = {title: [] for title in order}
    for case in cases:
        by_section[_section_of(case)].append(case)
    out = [INTRO]
    out.append("## Contents\n")
    out += [f"- [{t}](#{t.lower().replace(' ', '-').replace('/', '')}) ({len(c)})"
            for t, c in by_section.items() if c]
    for title, members in by_section.items():
        if members:
            out.append(f"\n## {title}\n")
            out += [_case_section(case) for case in members]
    return "\n".join(out).rstrip("\n") + "\n"


def _case_section(case: Path) -> str:
    data = case.read_bytes()
    doc = _case_doc(data.decode("utf-8", errors="replace"))
    source = _shown_source(data)
    parts = [f"### {doc}\n", f"`tests/invalid/{case.name}`\n"]
    if source.count("\n") < SHOW_SOURCE_UP_TO:
        parts.append(f"```het\n{source}\n```\n")
    parts.append(f"```text\n{check_output(case)}\n```\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    return write_or_check(ERRORS_MD, render(), argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
