"""How big a 1024-rank schedule page is and how fast it opens; writes docs/benchmarks.md "Visualizer".

    .venv/bin/python benchmarks/viz_page.py [--runs 3] [--no-write]

The plans are real: benchmarks/specs/viz1024_*.het (8 stages x 128 lanes
of H100 and A100 nodes, 1F1B with ZeRO-1, and Zorse with ZeRO-3 and
offload), compiled by `hetc compile`'s passes; their predicted timelines
(with each rank's memory curve) are rendered as `hetc viz` renders them and
opened in headless Chromium. Times inside the page come from
body[data-paint-ms] and body[data-open-ms].
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

from benchmarks.markdown import publish
from hetc.compiler import compile_spec
from hetc.tools.headless import dump_dom, find_chromium
from hetc.viz.page import render_page

HEADING = "## Visualizer"
PLANS = {"1F1B, ZeRO-1": ROOT / "benchmarks" / "specs" / "viz1024_1f1b.het",
         "Zorse, ZeRO-3, offload": ROOT / "benchmarks" / "specs" / "viz1024_zorse.het"}


def _body_seconds(body: str, name: str) -> float:
    return float(re.search(rf'data-{name}-ms="([0-9.]+)"', body).group(1)) / 1e3


def _open(page: Path, runs: int) -> dict:
    """Median paint, open and whole-browser times of `runs` headless loads."""
    samples = []
    for _ in range(runs):
        dump = dump_dom(page, timeout=600)
        body = re.search(r"<body([^>]*)>", dump.html).group(1)
        if 'data-ready="1"' not in body or "data-error" in body:
            raise SystemExit(f"the page did not open cleanly: <body{body}>")
        samples.append({"paint_s": _body_seconds(body, "paint"), "open_s": _body_seconds(body, "open"),
                        "wall_s": dump.seconds})
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def measure(name: str, spec: Path, runs: int) -> dict:
    compiled = compile_spec(spec)
    timeline = compiled.timeline
    started = time.perf_counter()
    html = render_page([timeline], f"1024 ranks, {name}")
    render_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "big.html"
        page.write_text(html)
        opened = _open(page, runs)
    return {"plan": name, "ranks": len(timeline.ranks), "microbatches": compiled.pipeline.num_microbatches,
            "events": len(timeline.events), "flows": len(timeline.flows), "memory": len(timeline.memory),
            "mb": len(html.encode()) / 1e6, "render_s": render_s, **opened}


def section(results: list[dict], runs: int) -> str:
    rows = "\n".join(
        f"| {m['ranks']} ranks, {m['plan']}, {m['microbatches']:,} microbatches | {m['events']:,} | "
        f"{m['flows']:,} | {m['memory']:,} | {m['mb']:.1f} MB | {m['render_s']:.2f} s | {m['paint_s']:.2f} s | "
        f"{m['open_s']:.2f} s | {m['wall_s']:.1f} s |" for m in results)
    return f"""{HEADING}

`benchmarks/viz_page.py`: the plans of `benchmarks/specs/viz1024_*.het` (a 7 B Llama in
8 stages x 128 lanes on H100 and A100-80 nodes), compiled, their predicted timelines
(each rank's memory curve included) rendered by `hetc viz` and opened in headless
Chromium; median of {runs} runs on 2 shared CPU cores.

- *render*: Python builds the self-contained page;
- *drawn*: in the page, from navigation start to the visible rows painted (usable);
- *open*: in the page, from navigation start until the DOM index of every block is built;
- *headless run*: the whole Chromium process (start, load, scripts, serialising the
  whole DOM for `--dump-dom`, exit): an upper bound, dominated by the dump.

| plan | events | arrows | memory samples | page | render | drawn | open | headless run |
|---|---|---|---|---|---|---|---|---|
{rows}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args()
    if find_chromium() is None:
        print("needs chromium (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    text = section([measure(name, spec, args.runs) for name, spec in PLANS.items()], args.runs)
    return publish(HEADING, text, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
