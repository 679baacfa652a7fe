"""The schedule visualizer: terminal grid, Chrome trace, HTML page in headless Chromium."""

from __future__ import annotations

from hetc.ir.program import Program, RankProgram, parse_instr
from hetc.ir.grid import render_grid, short_text


def _tiny_program() -> Program:
    rank0 = ["load mb=0", "fwd ms=0 mb=0", "send act ms=0 mb=0 to=1 shape=2x32x64", "fwd ms=0 mb=1",
             "send act ms=0 mb=1 to=1 shape=2x32x64 h=3", "wait h=3", "recv grad ms=1 mb=0 from=1 shape=2x32x64",
             "bwd ms=0 mb=0", "step ms=0"]
    rank1 = ["recv act ms=0 mb=0 from=0 shape=2x32x64", "fwd ms=1 mb=0", "bwd ms=1 mb=0",
             "send grad ms=1 mb=0 to=0 shape=2x32x64", "step ms=1"]
    text0 = "rank 0 stage=0 lane=0 tp_rank=0 cp_rank=0\n" + "\n".join(rank0)
    text1 = "rank 1 stage=1 lane=0 tp_rank=0 cp_rank=0\n" + "\n".join(rank1)
    return Program((RankProgram.from_text(text0), RankProgram.from_text(text1)), ())


def test_grid_has_a_column_per_rank_and_a_row_per_instruction():
    lines = render_grid(_tiny_program()).splitlines()
    assert "rank 0 s0/l0" in lines[0] and "rank 1 s1/l0" in lines[0]
    assert len(lines) == 1 + 9
    assert lines[1].split()[:2] == ["step", "0:"] and "recv act ms=0 mb=0 from=0" in lines[1]
    assert "shape=" not in "\n".join(lines)  # shortened cells
    assert "ERROR" not in "\n".join(lines)


def test_grid_marks_focus_with_context_and_gaps():
    text = render_grid(_tiny_program(), focus={0: 6, 1: 2}, context=1)
    lines = text.splitlines()
    marked = [line for line in lines if "<-- ERROR HERE" in line]
    assert len(marked) == 2
    assert "> recv grad ms=1 mb=0 from=1" in marked[1] and marked[1].endswith("(rank 0)")
    assert "> bwd ms=1 mb=0" in marked[0]
    shown = [line.split()[1] for line in lines[1:] if line.startswith("step")]
    assert shown == ["1:", "2:", "3:", "5:", "6:", "7:"]
    assert lines[1] == "..." and lines[-1] == "..."
    # all markers line up in one column
    assert len({line.index("<--") for line in marked}) == 1


def test_grid_focus_past_the_end_and_only_focus_columns():
    text = render_grid(_tiny_program(), focus={1: 5}, context=2)
    assert "rank 0" not in text
    assert "> (end of program)" in text and "ERROR HERE" in text and "(rank" not in text


def test_short_text_drops_what_is_implied_and_cuts_long_instructions():
    assert short_text(parse_instr("reduce_scatter grads ms=4 group=dp.s1.p0 h=10")) == \
        "reduce_scatter ms=4 group=dp.s1.p0 h=10"
    assert short_text(parse_instr("recv act ms=2 mb=0 from=0 shape=2x32x64 h=3")) == "recv act ms=2 mb=0 from=0 h=3"
    instr = parse_instr("all_reduce grads ms=12 group=stage12_lanes_with_a_long_name_indeed h=7")
    assert len(short_text(instr)) == 40 and short_text(instr).endswith("~")
    assert short_text(instr, width=200) == str(instr)


# ---------------------------------------------------------------- inputs

import dataclasses
import html.parser
import json
import re
from pathlib import Path

import pytest

from hetc.cli import main as hetc_main
from hetc.compiler import compile_spec
from hetc.plandir import read_program
from hetc.ir.timeline import Event, EventKind, Flow, MemorySample, RankInfo, Stream, Timeline
from hetc.viz.chrome import chrome_trace
from hetc.viz.encode import KIND_ORDER, STREAM_ORDER, decode_text, encode_timeline, tokens_per_s
from hetc.tools.headless import dump_dom, find_chromium, screenshot
from hetc.viz.page import render_page

ROOT = Path(__file__).resolve().parent.parent
DEMO_SPEC = ROOT / "specs" / "demo" / "hetero.het"                  # lanes 1, 2, 1; microbatches 3 and 1
HETERO_64_SPEC = ROOT / "tests" / "specs" / "viz" / "hetero64.het"     # 8 stages x 8 lanes, T4 / A100 / H100
PLAN_1024_SPEC = ROOT / "benchmarks" / "specs" / "viz1024_zorse.het"  # 8 stages x 128 lanes, Zorse + offload


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """The demo's heterogeneous plan, as `hetc compile` writes it."""
    out = tmp_path_factory.mktemp("demo") / "plan"
    assert hetc_main(["compile", str(DEMO_SPEC), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def demo(demo_dir) -> tuple:
    """The compiled demo's programs and its predicted timeline."""
    return read_program(demo_dir), Timeline.from_json((demo_dir / "timeline.json").read_text())


def _measured(timeline: Timeline, slowdown: float = 1.25) -> Timeline:
    """The same step as if measured: every event later and longer."""
    events = [Event(e.rank, e.index, e.text, e.kind, e.stream, e.start * slowdown, e.end * slowdown)
              for e in timeline.events]
    return Timeline("measured", timeline.ranks, tuple(events), timeline.flows, timeline.memory,
                    timeline.step_time * slowdown, timeline.plan)


def test_compiled_demo_timeline_is_sane(demo):
    program, timeline = demo
    assert {e.rank for e in timeline.events} == {r.rank for r in timeline.ranks} == {0, 1, 2, 3}
    assert all(e.text == str(program.ranks[e.rank].instrs[e.index]) for e in timeline.events)
    sends = sum(1 for rp in program.ranks for i in rp.instrs if i.OP == "send")
    assert len(timeline.flows) == sends
    assert {m.rank for m in timeline.memory} == {0, 1, 2, 3}
    assert all(0 < timeline.bubble_fraction(r.rank) < 1 for r in timeline.ranks)


# ---------------------------------------------------------------- encoding


def test_encoding_decodes_back_to_the_events(demo):
    _, timeline = demo
    data = encode_timeline(timeline)
    ev, unit = data["events"], data["unit"]
    got, texts, at = {}, [], 0
    for template in ev["template"]:     # each event's numbers follow the previous event's
        parts = data["templates"][template]
        texts.append(decode_text(parts, ev["numbers"][at:at + len(parts) - 1]))
        at += len(parts) - 1
    assert at == len(ev["numbers"])
    ranks = data["ranks"]["rank"]
    for pos, rank in enumerate(ranks):
        for i in range(ev["offsets"][pos], ev["offsets"][pos + 1]):
            got[rank, ev["index"][i]] = (texts[i], KIND_ORDER[ev["kind"][i]],
                                         STREAM_ORDER[ev["stream"][i]], ev["start"][i] * unit,
                                         (ev["start"][i] + ev["dur"][i]) * unit)
    assert len(got) == len(timeline.events)
    for e in timeline.events:
        text, kind, stream, start, end = got[e.rank, e.index]
        assert (text, kind, stream) == (e.text, e.kind, e.stream)
        assert start == pytest.approx(e.start, abs=unit) and end == pytest.approx(e.end, abs=2 * unit)
    flat = data["flows"]
    assert len(flat) == 3 * len(timeline.flows)
    for k in range(0, len(flat), 3):   # each flow joins a send to a receive
        assert texts[flat[k]].startswith("send") and texts[flat[k + 1]].startswith("recv")
    assert data["ranks"]["bubble"] == [round(timeline.bubble_fraction(r), 4) for r in ranks]
    assert tokens_per_s(timeline) == pytest.approx(8 * 32 / timeline.step_time)   # global batch x seq


@pytest.mark.parametrize("text", ["fwd ms=3 mb=17", "all_gather params ms=0 group=dp.s0.p0 h=4",
                                  "send act ms=1 mb=0 to=2 shape=8x4096x8192 h=12", "step ms=0", "wait h=007",
                                  "x=12345678901234567890 y=0 z=00"])
def test_text_templates_round_trip(text):
    from hetc.viz.encode import _split_numbers
    parts, numbers = _split_numbers(text)
    assert decode_text(list(parts), numbers) == text
    assert all(str(n) in text for n in numbers)


def test_bubble_fractions_match_the_per_rank_form(demo):
    _, timeline = demo
    assert timeline.bubble_fractions() == {r.rank: pytest.approx(timeline.bubble_fraction(r.rank))
                                           for r in timeline.ranks}


# ---------------------------------------------------------------- Chrome trace


def _assert_valid_trace(trace: dict) -> None:
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid"} <= e.keys(), e
    by_track: dict = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for track, spans in by_track.items():     # durations nest: no partial overlap on one thread
        open_ends: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-9:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-9, f"partial overlap on {track} at {start}"
            open_ends.append(end)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == finishes.keys()
    for flow_id, s in starts.items():         # each arrow leaves from inside a slice of its thread
        assert any(a - 1e-9 <= s["ts"] <= b + 1e-9 for a, b in by_track[s["pid"], s["tid"]])
        f = finishes[flow_id]
        assert f["bp"] == "e" and any(a - 1e-9 <= f["ts"] <= b + 1e-9 for a, b in by_track[f["pid"], f["tid"]])


def test_chrome_trace_of_the_demo_validates(demo):
    program, timeline = demo
    trace = json.loads(json.dumps(chrome_trace([timeline])))   # what a file holds
    _assert_valid_trace(trace)
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[2] == "rank 2 · cpu host[1, 0] · stage 1 lane 1"
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(1, "compute"), (1, "p2p"), (1, "collective")} <= threads
    slices = {(e["pid"], e["args"]["index"]): e["name"] for e in events if e["ph"] == "X"}
    assert slices == {(e.rank, e.index): str(program.ranks[e.rank].instrs[e.index]) for e in timeline.events}
    assert sum(e["ph"] == "s" for e in events) == len(timeline.flows)
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == len(timeline.memory) > 0 and all("bytes" in c["args"] for c in counters)


def test_chrome_trace_packs_overlapping_events_into_nesting_threads():
    ranks = (RankInfo(0, 0, 0, "cpu", "host[0]", 4e9), RankInfo(1, 1, 0, "cpu", "host[1]", 4e9))
    overlapping = (Event(0, 0, "send act ms=0 mb=0 to=1 shape=2 h=1", EventKind.SEND, Stream.P2P, 0.0, 2.0),
                   Event(0, 1, "send act ms=0 mb=1 to=1 shape=2 h=2", EventKind.SEND, Stream.P2P, 1.0, 3.0),
                   Event(0, 2, "fwd ms=0 mb=0", EventKind.FORWARD, Stream.COMPUTE, 0.0, 1.0),
                   Event(1, 0, "recv act ms=0 mb=1 from=0 shape=2", EventKind.RECV, Stream.P2P, 0.5, 3.0))
    timeline = Timeline("measured", ranks, overlapping, (Flow(0, 1, 1, 0, 8.0),), (MemorySample(0, 0.0, 1.0),), 3.0)
    trace = chrome_trace([timeline])
    _assert_valid_trace(trace)
    p2p_tids = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["cat"] == "send"}
    assert len(p2p_tids) == 2
    thread_names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == 0}
    assert {"p2p", "p2p #2", "compute"} <= thread_names


def test_chrome_trace_of_a_comparison_keeps_both_apart(demo):
    _, timeline = demo
    trace = chrome_trace([timeline, _measured(timeline)])
    _assert_valid_trace(trace)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len(names) == 8 and names[0].startswith("predicted rank 0") and names[4].startswith("measured rank 0")


# ---------------------------------------------------------------- command line


def test_cli_text_grid(demo_dir, capsys):
    capsys.readouterr()
    assert hetc_main(["viz", str(demo_dir), "--text"]) == 0
    lines = capsys.readouterr().out.splitlines()
    program = read_program(demo_dir)
    assert lines[0].split() == [w for rp in program.ranks for w in ("rank", str(rp.rank), f"s{rp.stage}/l{rp.lane}")]
    assert len(lines) == 1 + max(len(rp.instrs) for rp in program.ranks)
    first = {rp.rank: short_text(rp.instrs[0]) for rp in program.ranks}
    assert all(text in lines[1] for text in first.values())
    assert hetc_main(["viz", str(demo_dir), "--text", "--ranks", "0,2-3"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 s0/l0" in out and "rank 2 s1/l1" in out and "rank 3 s2/l0" in out and "rank 1 " not in out
    assert out.count("\nstep ") == max(len(program.ranks[r].instrs) for r in (0, 2, 3))


def test_cli_page_and_chrome_trace(demo_dir, tmp_path, capsys):
    page, trace = tmp_path / "demo.html", tmp_path / "demo.trace.json"
    assert hetc_main(["viz", str(demo_dir), "-o", str(page), "--chrome-trace", str(trace)]) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "predicted" in text
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=["']?https?:""", text)   # nothing fetched
    _assert_valid_trace(json.loads(trace.read_text()))
    assert "wrote" in capsys.readouterr().out


def test_side_panel_lists_each_plan_fact_once(demo):
    _, timeline = demo
    assert ("ranks", "4") in timeline.plan   # compile's plan facts count the ranks themselves
    text = render_page([timeline])
    assert text.count("<dt>ranks</dt>") == 1 and text.count("<dt>schedule</dt>") == 1
    bare = dataclasses.replace(timeline, plan=(("schedule", "1f1b"), ("schedule", "gpipe")))
    text = render_page([bare])   # facts without a rank count get one; a repeated key shows its first value
    assert "<dt>ranks</dt><dd>4</dd>" in text and text.count("<dt>schedule</dt>") == 1 and "<dd>gpipe</dd>" not in text


def test_cli_measured_and_compare(demo, demo_dir, tmp_path):
    _, timeline = demo
    measured = tmp_path / "trace.json"
    measured.write_text(_measured(timeline).to_json())
    only = tmp_path / "measured.html"
    assert hetc_main(["viz", str(demo_dir), "--trace", str(measured), "-o", str(only)]) == 0
    data = _page_data(only.read_text())
    assert [v["source"] for v in data["views"]] == ["measured"]
    both = tmp_path / "compare.html"
    assert hetc_main(["viz", str(demo_dir), "--trace", str(measured), "--compare", "-o", str(both)]) == 0
    text = both.read_text()
    assert [v["source"] for v in _page_data(text)["views"]] == ["predicted", "measured"]
    assert "measured +25.0% vs predicted" in text
    # a directory without a prediction still draws the measured trace
    bare = tmp_path / "bare"
    bare.mkdir()
    assert hetc_main(["viz", str(bare), "--trace", str(measured), "-o", str(tmp_path / "bare.html")]) == 0


def test_cli_user_errors_exit_2(demo_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [([str(bare), "-o", str(tmp_path / "x.html")], "has no timeline.json"),
             ([str(demo_dir), "--compare", "-o", str(tmp_path / "x.html")], "--compare needs"),
             ([str(demo_dir), "--trace", str(bad)], "not JSON"),
             # the trace is not drawn by --text alone, which prints the programs
             ([str(demo_dir), "--trace", str(bad), "--text"], "--trace goes with a drawing of the timeline"),
             ([str(demo_dir), "--trace", str(bare), "-o", str(tmp_path / "x.html")],
              f"the timeline '{bare}' is a directory, not a regular file"),
             ([str(tmp_path / "missing")], "no such directory"),
             ([str(bare), "--text"], "no programs/rank-*.txt"),
             ([str(demo_dir), "--text", "--ranks", "0,x"], "--ranks"),
             ([str(demo_dir), "--text", "--ranks", "9"], "no rank 9"),
             # bounded before the range is spelt out (it was a MemoryError), and a list that names no rank
             ([str(demo_dir), "--text", "--ranks", "0-99999999999"], "no rank 99999999999 in a program of"),
             ([str(demo_dir), "--text", "--ranks", ","], "--ranks ',' names no rank")]
    for argv, message in cases:
        assert hetc_main(["viz", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize(("where", "value", "message"), [
    (("events", 3, 1), {"a": 1}, "events[3].index: expected int, got dict"),
    (("events", 3, 2), 7, "events[3].text: expected str, got int"),
    (("events", 3, 3), "fwd", "events[3].kind: 'fwd' is not one of forward, backward"),
    (("events", 3), [0, 1], "events[3]: expected 7 fields (rank, index, text, kind, stream, start, end)"),
    (("ranks", 0, "capacity"), "80 GB", "ranks[0].capacity: expected float, got str"),
    (("flows",), None, "flows: expected a list, got NoneType"),
    (("classes", 0, "compute"), True, "classes[0].compute: expected float, got bool"),
])
def test_a_timeline_of_the_wrong_shape_is_named_where(demo_dir, tmp_path, capsys, where, value, message):
    """A timeline.json edited or written by something else: the first value of the wrong type is named by
    its place, exit 2, not a traceback from deep in the page's encoder."""
    obj = json.loads((demo_dir / "timeline.json").read_text())
    parent = obj
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    assert hetc_main(["viz", str(demo_dir), "--trace", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    assert message in capsys.readouterr().err


def _page_data(text: str) -> dict:
    match = re.search(r'<script id="hetc-data" type="application/json">(.*?)</script>', text, re.DOTALL)
    assert match
    return json.loads(match.group(1))


# ---------------------------------------------------------------- the page in headless Chromium


@pytest.fixture(scope="module")
def chromium() -> str:
    """Headless Chromium from PATH, else skip: tests never install software (`make test` provisions it)."""
    path = find_chromium()
    if path is None:
        pytest.skip("no headless Chromium on PATH (`make test` installs Debian's `chromium` where it runs as "
                    "root with apt-get; elsewhere install chromium or google-chrome to run the page tests)")
    return path


class _Index(html.parser.HTMLParser):
    """The page's DOM index: rank rows (ol.rank-row) and their blocks (li.block with the text in <code>)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self.blocks: list[dict] = []
        self.body: dict = {}
        self._in_code = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "body":
            self.body = a
        elif tag == "ol" and "rank-row" in classes:
            self.rows.append(a)
        elif tag == "li" and "block" in classes:
            self.blocks.append({**a, "view": self.rows[-1]["data-view"], "rank": int(self.rows[-1]["data-rank"]),
                                "text": ""})
        elif tag == "code" and self.blocks and not self.blocks[-1]["text"]:
            self._in_code = True

    def handle_endtag(self, tag):
        self._in_code = self._in_code and tag != "code"

    def handle_data(self, data):
        if self._in_code:
            self.blocks[-1]["text"] += data


def _open(chromium: str, page: Path, fragment: str = "") -> _Index:
    dump = dump_dom(page, chromium=chromium, fragment=fragment)
    index = _Index()
    index.feed(dump.html)
    assert "data-error" not in index.body, index.body.get("data-error")
    assert index.body.get("data-ready") == "1", "the page's script did not finish"
    return index


def _assert_everything_in_dom(index: _Index, timeline: Timeline) -> None:
    rows = {int(r["data-rank"]): r for r in index.rows if r["data-view"] == timeline.source}
    assert rows.keys() == {r.rank for r in timeline.ranks}
    peaks: dict[int, float] = {}
    for m in timeline.memory:
        peaks[m.rank] = max(peaks.get(m.rank, 0.0), m.nbytes)
    for info in timeline.ranks:
        row = rows[info.rank]
        assert (int(row["data-stage"]), int(row["data-lane"]), row["data-device"]) == (info.stage, info.lane,
                                                                                        info.device)
        # the curve the page draws for the rank, against its capacity
        assert (float(row["data-mem-peak"]), float(row["data-capacity"])) == \
            (round(peaks.get(info.rank, 0.0)), round(info.capacity))
    bubbles = timeline.bubble_fractions()
    assert all(float(rows[r]["data-bubble"]) == pytest.approx(b, abs=1e-4) for r, b in bubbles.items())
    blocks = {(b["rank"], int(b["data-index"])): b for b in index.blocks if b["view"] == timeline.source}
    assert len(blocks) == len(timeline.events)
    for e in timeline.events:
        b = blocks[e.rank, e.index]
        assert (b["text"], b["data-kind"], b["data-stream"]) == (e.text, e.kind.value, e.stream.value)
        assert float(b["data-start"]) == pytest.approx(e.start, abs=1e-6 * timeline.step_time + 1e-9)


def test_demo_page_in_chromium(chromium, demo, demo_dir, tmp_path):
    _, timeline = demo
    page = tmp_path / "demo.html"
    assert hetc_main(["viz", str(demo_dir), "-o", str(page), "--title", "demo schedule"]) == 0
    _assert_everything_in_dom(_open(chromium, page), timeline)
    png = screenshot(page, tmp_path / "demo.png", chromium=chromium, fragment="mem=peak")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_64_rank_heterogeneous_page_in_chromium(chromium, tmp_path):
    timeline = compile_spec(HETERO_64_SPEC).timeline
    assert len(timeline.ranks) == 64 and {r.device for r in timeline.ranks} == {"T4", "A100-40", "H100"}
    page = tmp_path / "hetero64.html"
    page.write_text(render_page([timeline], "64 ranks"))
    _assert_everything_in_dom(_open(chromium, page), timeline)
    screenshot(page, tmp_path / "hetero64.png", chromium=chromium, fragment="compact")
    assert (tmp_path / "hetero64.png").stat().st_size > 20_000


def test_comparison_page_and_deep_link_in_chromium(chromium, demo, tmp_path):
    _, timeline = demo
    measured = _measured(timeline)
    page = tmp_path / "compare.html"
    page.write_text(render_page([timeline, measured]))
    forward = next(e for e in timeline.events if e.rank == 2 and e.kind is EventKind.FORWARD)
    index = _open(chromium, page, fragment=f"rank=2&index={forward.index}&view=measured")
    _assert_everything_in_dom(index, timeline)
    _assert_everything_in_dom(index, measured)
    shown = [r for r in index.rows if "hidden" not in r]   # the deep link lists rank 2 in both views
    assert {(r["data-view"], r["data-rank"]) for r in shown} == {("predicted", "2"), ("measured", "2")}
    current = [b for b in index.blocks if "current" in b["class"].split()]
    assert [(b["view"], b["rank"], b["data-index"]) for b in current] == [("measured", 2, str(forward.index))]
    screenshot(page, tmp_path / "compare.png", chromium=chromium, fragment=f"rank=2&index={forward.index}&q=mb%3D2")


@pytest.mark.slow
def test_1024_rank_page_is_small_and_complete(chromium, tmp_path):
    timeline = compile_spec(PLAN_1024_SPEC).timeline
    assert len(timeline.ranks) == 1024 and len(timeline.memory) > 1024
    page = tmp_path / "big.html"
    page.write_text(render_page([timeline]))
    size_mb = page.stat().st_size / 1e6
    assert size_mb < 20, f"{size_mb:.1f} MB"
    dump = dump_dom(page, chromium=chromium)
    body = re.search(r"<body([^>]*)>", dump.html).group(1)
    assert 'data-ready="1"' in body and "data-error" not in body
    # counted by pattern: the page's own script holds these tags too, with ${...} in place of numbers
    assert len(re.findall(r'<ol class="rank-row"[^>]*? data-rank="\d+"', dump.html)) == 1024
    assert len(re.findall(r'<li class="block" data-index="\d+"', dump.html)) == len(timeline.events)
    # the page measures its own opening time (data-open-ms); how long it takes is benchmarks/viz_page.py's
    # figure (docs/benchmarks.md), not an assertion here
    assert re.search(r'data-open-ms="[0-9.]+"', body), body


# The page's layout constants (templates/model.js) locate rank 0's compute track for the probe below.
_LABEL_W, _STAGE_H, _PART_PAD, _COMPUTE_H = 190, 22, 4, 18
_PROBE = """<script>
function probe() {
  if (document.body.dataset.ready !== "1") { setTimeout(probe, 10); return; }
  const canvas = document.getElementById("lanes"), box = canvas.getBoundingClientRect(), span = SPAN_S;
  const t0 = 0, t1 = 1.02 * span;   // the initial view (draw.js STATE)
  const x = box.left + LABEL_W + (T_MID - t0) / (t1 - t0) * (canvas.clientWidth - LABEL_W), y = box.top + Y_MID;
  const at = {clientX: x, clientY: y, bubbles: true};
  canvas.dispatchEvent(new MouseEvent("mousemove", at));
  const tip = document.getElementById("tip");
  document.body.dataset.probeTip = tip.hidden ? "" : tip.textContent;
  canvas.dispatchEvent(new MouseEvent("mousedown", at));
  canvas.dispatchEvent(new MouseEvent("mouseup", at));
  document.body.dataset.probeSelected = document.getElementById("details").textContent;
  document.getElementById("scroller").dispatchEvent(new WheelEvent("wheel", {...at, deltaY: -300, ctrlKey: true}));
  for (const key of ["w", "a", "d", "s", "0"]) window.dispatchEvent(new KeyboardEvent("keydown", {key: key}));
  const search = document.getElementById("search");
  search.value = "mb=1";
  search.dispatchEvent(new Event("input"));
  document.getElementById("compact").click();
  canvas.dispatchEvent(new MouseEvent("mousemove", {...at, clientY: box.top + 30}));
  document.body.dataset.probeDone = "1";
}
probe();
</script></body>"""


def test_hover_click_zoom_and_search_in_chromium(chromium, demo, tmp_path):
    """Synthetic mouse, wheel and key events on the real page: the tooltip and the selection name the block."""
    _, timeline = demo
    forward = min((e for e in timeline.events if e.rank == 0 and e.kind is EventKind.FORWARD), key=lambda e: e.start)
    probe = (_PROBE.replace("SPAN_S", repr(timeline.step_time)).replace("T_MID", repr((forward.start + forward.end) / 2))
             .replace("LABEL_W", str(_LABEL_W)).replace("Y_MID", str(_STAGE_H + _PART_PAD + _COMPUTE_H // 2)))
    page = tmp_path / "probe.html"
    page.write_text(render_page([timeline]).replace("</body>", probe))
    index = _open(chromium, page)
    assert index.body.get("data-probe-done") == "1"
    assert forward.text in index.body["data-probe-tip"] and "rank 0" in index.body["data-probe-tip"]
    assert index.body["data-probe-selected"].startswith(forward.text)
    assert [b["data-index"] for b in index.blocks if "current" in b["class"].split()] == [str(forward.index)]
