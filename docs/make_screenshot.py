"""Screenshot a plan's schedule page for the README: `python docs/make_screenshot.py DIR`.

DIR is a plan directory with a timeline.json (`hetc compile SPEC -o DIR`) or a
timeline .json file. The page is rendered exactly as `hetc viz` renders it and
photographed by headless Chromium (Debian: `apt-get install chromium`).

    .venv/bin/hetc compile specs/demo/pp.het -o /tmp/demo-plan
    .venv/bin/python docs/make_screenshot.py /tmp/demo-plan      # -> docs/img/demo-schedule.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hetc.cli import main as hetc_main
from hetc.tools.headless import screenshot

DEFAULT_PNG = Path(__file__).resolve().parent / "img" / "demo-schedule.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="plan directory (or timeline .json)")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_PNG, help=f"PNG to write (default {DEFAULT_PNG})")
    parser.add_argument("--size", default="1600x640", help="window size WIDTHxHEIGHT in CSS pixels")
    parser.add_argument("--fragment", default="", help="the page's deep link, e.g. 'rank=2&index=5' or 'compact'")
    parser.add_argument("--title", default="demo schedule")
    args = parser.parse_args(argv)
    width, _, height = args.size.partition("x")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "schedule.html"
        code = hetc_main(["viz", args.dir, "-o", str(page), "--title", args.title])
        if code:
            return code
        screenshot(page, args.out, size=(int(width), int(height)), fragment=args.fragment)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
