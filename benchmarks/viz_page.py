"""How big a 1024-rank schedule page is and how fast it opens; writes docs/benchmarks.md "Visualizer".

    .venv/bin/python benchmarks/viz_page.py [--runs 3] [--no-write]

The plans are synthetic (tests/vizgen.py: 16 stages x 64 lanes, 1F1B with
ZeRO-1 collectives) until `hetc compile` predicts timelines of that size.
Times inside the page come from body[data-paint-ms] and body[data-open-ms].
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetc.viz.headless import dump_dom, find_chromium  # noqa: E402
from hetc.viz.page import render_page  # noqa: E402
from tests.vizgen import scaled_plan, simulate, synth_program  # noqa: E402

BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
HEADING = "## Visualizer"


# (microbatches per lane) of the two 1024-rank plans: a typical step, and a long one
PER_LANE = (8, 32)


def _body_seconds(body: str, name: str) -> float:
    return float(re.search(rf'data-{name}-ms="([0-9.]+)"', body).group(1)) / 1e3


def measure(per_lane: int, runs: int) -> dict:
    plan = scaled_plan(num_stages=16, num_lanes=64, per_lane=per_lane)
    timeline = simulate(plan, synth_program(plan))
    started = time.perf_counter()
    html = render_page([timeline], "1024 ranks")
    render_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "big.html"
        page.write_text(html)
        samples = []
        for _ in range(runs):
            dump = dump_dom(page, timeout=600)
            body = re.search(r"<body([^>]*)>", dump.html).group(1)
            samples.append({"paint_s": _body_seconds(body, "paint"), "open_s": _body_seconds(body, "open"),
                            "wall_s": dump.seconds})
    median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    return {"ranks": len(timeline.ranks), "per_lane": per_lane, "events": len(timeline.events),
            "flows": len(timeline.flows), "mb": len(html.encode()) / 1e6, "render_s": render_s, **median}


def section(results: list[dict], runs: int) -> str:
    rows = "\n".join(
        f"| {m['ranks']} ranks, {m['per_lane']} microbatches/lane | {m['events']:,} | {m['flows']:,} | "
        f"{m['mb']:.1f} MB | {m['render_s']:.2f} s | {m['paint_s']:.2f} s | {m['open_s']:.2f} s | {m['wall_s']:.1f} s |"
        for m in results)
    return f"""{HEADING}

`benchmarks/viz_page.py`: synthetic 1F1B plans of 16 stages x 64 lanes with ZeRO-1
collectives (tests/vizgen.py), rendered by `hetc viz` and opened in headless
Chromium; median of {runs} runs on 2 shared CPU cores.

- *render*: Python builds the self-contained page;
- *drawn*: in the page, from navigation start to the visible rows painted (usable);
- *open*: in the page, from navigation start until the DOM index of every block is built;
- *headless run*: the whole Chromium process (start, load, scripts, serialising the
  whole DOM for `--dump-dom`, exit): an upper bound, dominated by the dump.

| plan | events | arrows | page | render | drawn | open | headless run |
|---|---|---|---|---|---|---|---|
{rows}
"""


def write_section(text: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the Visualizer section of docs/benchmarks.md (or add it), keeping every other section."""
    old = path.read_text() if path.is_file() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text + "\n", old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args()
    if find_chromium() is None:
        print("needs chromium (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    text = section([measure(per_lane, args.runs) for per_lane in PER_LANE], args.runs)
    print(text)
    if not args.no_write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
