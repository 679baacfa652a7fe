"""The schedule page: one self-contained HTML file drawn from one or two Timelines.

Everything is inline (CSS, JS, data): the page opens from a file, offline.
The canvas draws only the rows in view, so thousands of ranks stay fast;
the DOM index (see templates/listing.js) makes every rank row and every
instruction block reachable from the DOM for tests, search and listings.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from importlib import resources

import jinja2
import markupsafe

from hetc.ir.jsontypes import JsonObject
from hetc.viz.classgap import ClassGap
from hetc.ir.timeline import EventKind, Timeline
from hetc.viz.encode import KIND_ORDER, STREAM_ORDER, encode_timeline, stage_summaries, tokens_per_s

__all__ = ["KIND_COLORS", "LEGEND", "render_page"]

log = logging.getLogger(__name__)

# One color per kind of work, the same in the legend, the canvas and the docs.
KIND_COLORS: dict[EventKind, str] = {
    EventKind.FORWARD: "#4c78a8", EventKind.BACKWARD: "#f58518", EventKind.BACKWARD_INPUT: "#f58518",
    EventKind.BACKWARD_WEIGHT: "#e3b52c", EventKind.OPTIMIZER: "#9d5fb0", EventKind.LOAD: "#9ecae9",
    EventKind.SEND: "#7b6f66", EventKind.RECV: "#a89d94", EventKind.COLLECTIVE: "#d6524f",
    EventKind.OFFLOAD: "#3a9e96", EventKind.PREFETCH: "#72c0b7", EventKind.FREE: "#c7a9d6",
    EventKind.WAIT: "#b9c0c8",
}
LEGEND: tuple[tuple[str, str], ...] = (
    ("forward", KIND_COLORS[EventKind.FORWARD]), ("backward", KIND_COLORS[EventKind.BACKWARD]),
    ("weight grad", KIND_COLORS[EventKind.BACKWARD_WEIGHT]), ("optimizer", KIND_COLORS[EventKind.OPTIMIZER]),
    ("offload", KIND_COLORS[EventKind.OFFLOAD]), ("prefetch", KIND_COLORS[EventKind.PREFETCH]),
    ("send", KIND_COLORS[EventKind.SEND]), ("recv", KIND_COLORS[EventKind.RECV]),
    ("collective", KIND_COLORS[EventKind.COLLECTIVE]), ("load", KIND_COLORS[EventKind.LOAD]),
    ("free", KIND_COLORS[EventKind.FREE]), ("wait", KIND_COLORS[EventKind.WAIT]),
)

_ENV = jinja2.Environment(loader=jinja2.PackageLoader("hetc.viz", "templates"),
                          autoescape=jinja2.select_autoescape(["html.j2"]), keep_trailing_newline=True)


def _format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


_ENV.filters["bytes"] = _format_bytes
# the script's parts, in order; inlined verbatim (not rendered: JS braces are not jinja's)
_SCRIPTS = ("model.js", "draw.js", "interact.js", "listing.js", "main.js")


def _asset(name: str) -> markupsafe.Markup:
    text = (resources.files("hetc.viz") / "templates" / name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():
        raise AssertionError(f"{name} would end its inline element early")
    return markupsafe.Markup(text)


def _script_json(obj: JsonObject) -> str:
    """JSON safe inside <script>: no '</script>' or '<!--' can end or confuse the element."""
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c")


def _view_summary(timeline: Timeline) -> dict[str, str]:
    tps = tokens_per_s(timeline)
    return {"source": timeline.source, "step_time_text": _format_seconds(timeline.step_time),
            "tokens_text": f"{tps:,.0f}" if tps else ""}


def _delta_text(timelines: Sequence[Timeline]) -> str:
    if len(timelines) < 2 or timelines[0].step_time <= 0:
        return ""
    first, second = timelines[0], timelines[1]
    change = (second.step_time - first.step_time) / first.step_time
    return f"{second.source} {'+' if change >= 0 else ''}{100 * change:.1f}% vs {first.source}"


def _plan_facts(timelines: Sequence[Timeline]) -> list[tuple[str, str]]:
    """The side panel's plan facts: the first timeline's, each key once, and the rank count if they lack it."""
    facts: dict[str, str] = {}
    for key, value in timelines[0].plan:
        facts.setdefault(key, value)    # the first value of a key wins
    facts.setdefault("ranks", str(len({r.rank for t in timelines for r in t.ranks})))
    return list(facts.items())


def _gap_rows(gaps: Sequence[ClassGap]) -> list[dict[str, str]]:
    return [{"name": g.time_class, "predicted": _format_seconds(g.predicted_s), "measured": _format_seconds(g.measured_s),
             "ratio": f"×{g.ratio:.2f}" if g.ratio is not None else "-"} for g in gaps]


def render_page(timelines: Sequence[Timeline], title: str = "hetc schedule", gaps: Sequence[ClassGap] = ()) -> str:
    """The HTML page for one timeline, or two side by side (predicted first, then measured).

    `gaps` (with two timelines): the time per class, predicted against measured (hetc/viz/classgap.py).
    """
    if not 1 <= len(timelines) <= 2:
        raise ValueError(f"the page shows one or two timelines, not {len(timelines)}")
    data: JsonObject = {"kinds": [k.value for k in KIND_ORDER], "streams": [s.value for s in STREAM_ORDER],
            "colors": {k.value: c for k, c in KIND_COLORS.items()},
            "views": [encode_timeline(t) for t in timelines]}
    first = timelines[0]
    html = _ENV.get_template("page.html.j2").render(
        title=title, views=[_view_summary(t) for t in timelines], delta_text=_delta_text(timelines),
        plan=_plan_facts(timelines), stages=stage_summaries(first), gaps=_gap_rows(gaps), legend=LEGEND, css=_asset("viz.css"),
        script=markupsafe.Markup("\n").join(_asset(name) for name in _SCRIPTS), data_json=markupsafe.Markup(_script_json(data)),
    )
    log.info("rendered %d timeline(s), %d events, %.1f MB", len(timelines),
             sum(len(t.events) for t in timelines), len(html) / 1e6)
    return html
