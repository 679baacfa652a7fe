"""Measured profiles reach every verb that predicts time, the same way (hetc/commands/profileargs.py).

The profile is hand-written in `hetc profile`'s format (docs/costmodel.md)
for the demo model on the demo cluster's `cpu` device, so the tests need no
profiling run; `other.json` measures another model shape and is reported as
unused with that reason.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from hetc.cli import main
from hetc.passes.cost.sources.hetc_profile import FORMAT, VERSION
from hetc.plandir import PROFILE_ENV, PROFILES_FILE, fingerprint
from hetc.ir.timeline import Timeline
from hetc.ir.units import to_base
from hetc.viz.page import _format_seconds
from tests.conftest import DEMO

DEMO_BLOCK_PARAMS = 46208   # one block of specs/demo/job.het's model (hidden 64, ffn 176, 4 heads, 2 kv)


def _profile(hidden: int = 64, block_params: int = DEMO_BLOCK_PARAMS, scale: float = 1.0) -> dict:
    layers = [{"layer": name, "tp": 1, "seq": 32, "micro_batch": b, "forward_s": scale * f * b,
               "backward_s": scale * 2 * f * b}
              for name, f in (("embed", 1e-4), ("block", 1e-3), ("head", 3e-4)) for b in (1, 2)]
    return {"format": FORMAT, "version": VERSION, "device": {"kind": "cpu"}, "dtype": "fp32",
            "model": {"hidden": hidden, "block_params": block_params}, "layers": layers,
            "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 65536, "seconds": 5e-4}],
            "p2p": [{"bytes": 65536, "seconds": 1e-3}],
            "copy": [{"direction": "copy", "bytes": 1 << 20, "seconds": 1e-4}]}


@pytest.fixture
def profiles(tmp_path):
    good, other = tmp_path / "cpu.json", tmp_path / "other.json"
    good.write_text(json.dumps(_profile()))
    other.write_text(json.dumps(_profile(hidden=128, block_params=4 * DEMO_BLOCK_PARAMS)))
    return good, other


def _json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def _compiled_step(tmp_path, spec: str, *extra: str) -> float:
    out = tmp_path / f"c_{spec}"
    assert main(["compile", str(DEMO / f"{spec}.het"), "-o", str(out), *extra]) == 0
    return json.loads((out / "summary.json").read_text())["step_time_s"]


# explain's and plan's estimate is the analytic model (passes/cost/estimate.py); compile's step is the
# simulator's. Both count the ZeRO collectives where lowering puts them (Note [zero cycle] in
# passes/cost/schedule.py); `SLOW_COMM` plans run with collectives and messages 40x and 10x slower than in
# `_profile`, so that the step is bound by its collectives (each microbatch's reduce-scatter counted once).
AGREE = ["single", "dp", "zero1", "tp2", "pp"]
SLOW_COMM = ["zero2", "zero3", "hsdp"]


def _slow_comm() -> dict:
    out = _profile()
    out["collectives"][0]["seconds"] *= 40
    out["p2p"][0]["seconds"] *= 10
    return out


@pytest.mark.parametrize("spec", AGREE + SLOW_COMM)
def test_explain_compile_and_plan_agree_with_the_same_profiles(spec, profiles, tmp_path, capsys):
    good = profiles[0]
    if spec in SLOW_COMM:
        good.write_text(json.dumps(_slow_comm()))
    path = str(DEMO / f"{spec}.het")
    explained = _json(capsys, "explain", path, "--json", "--profile", str(good))["step_time_s"]
    planned = _json(capsys, "plan", path, "--json", "--profile", str(good))["step_time_s"]
    compiled = _compiled_step(tmp_path, spec, "--profile", str(good))
    capsys.readouterr()
    assert compiled != pytest.approx(_compiled_step(tmp_path, spec), rel=0.01)   # the profile changed it
    assert planned == pytest.approx(explained, rel=0.01)
    assert compiled == pytest.approx(explained, rel=0.01)


def test_compile_uses_a_profile_records_it_and_reports_the_unused_one(profiles, tmp_path, capsys):
    good, other = profiles
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out), "--profile", str(good),
                 "--profile", str(other)]) == 0
    printed = capsys.readouterr().out
    assert f"layer times from: {good}" in printed
    assert f"unused profile {other}: measures another model shape (hidden 128" in printed
    record = json.loads((out / PROFILES_FILE).read_text())
    assert record["profiles"] == [{"path": str(good.resolve()), "sha256": fingerprint(good)},
                                  {"path": str(other.resolve()), "sha256": fingerprint(other)}]
    assert [u["profile"] for u in record["unused_profiles"]] == [str(other)]


def test_hetc_profiles_is_read_like_the_flag(profiles, tmp_path, monkeypatch, capsys):
    good, other = profiles
    with_flag = _compiled_step(tmp_path, "pp", "--profile", str(good), "--profile", str(other))
    monkeypatch.setenv(PROFILE_ENV, os.pathsep.join([str(good), str(other)]))
    assert _compiled_step(tmp_path, "pp") == with_flag
    capsys.readouterr()
    explained = _json(capsys, "explain", str(DEMO / "pp.het"), "--json")
    assert any(str(good) in s for srcs in explained["sources"].values() for s in srcs)
    assert [u["profile"] for u in explained["unused_profiles"]] == [str(other)]


def test_plan_and_explain_use_the_profile_and_report_the_unused_one(profiles, capsys):
    good, other = profiles
    for verb in ("plan", "explain"):
        got = _json(capsys, verb, str(DEMO / "pp.het"), "--json", "--profile", str(good), "--profile", str(other))
        assert all(str(good) in s for srcs in got["sources"].values() for s in srcs), verb
        assert [(u["profile"], u["reason"].split(" (")[0]) for u in got["unused_profiles"]] == \
            [(str(other), "measures another model shape")], verb


def test_viz_predicts_again_with_other_profiles_and_says_so(profiles, tmp_path, capsys):
    good, other = profiles
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    recorded = Timeline.from_json((out / "timeline.json").read_text()).step_time
    page = tmp_path / "page.html"
    capsys.readouterr()
    assert main(["viz", str(out), "-o", str(page), "--profile", str(good), "--profile", str(other)]) == 0
    err = capsys.readouterr().err
    assert f"predicted again with {good}, {other}" in err and f"layer times from: {good}" in err
    assert f"unused profile {other}: measures another model shape" in err
    value, unit = re.search(r"\(([0-9.]+) (s|ms|us)/step\)", err).groups()
    again = to_base(float(value), unit)[1]
    assert again != pytest.approx(recorded, rel=0.01)
    # the page draws the new prediction, to more digits than the line printed it with
    html = page.read_text()
    half_digit = 0.5 * 10 ** -len(value.partition(".")[2])
    drawn = [float(x) for x in re.findall(rf"([0-9]+\.[0-9]+) {unit}\b", html)]
    assert any(abs(x - float(value)) <= half_digit + 1e-9 for x in drawn), (value, drawn)
    assert _format_seconds(recorded) not in html


def test_viz_compare_says_when_the_recorded_profile_changed_or_is_gone(profiles, tmp_path, capsys):
    good, _ = profiles
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out), "--profile", str(good)]) == 0
    trace = out / "timeline.json"      # any timeline stands in for the measured one here
    argv = ["viz", str(out), "--compare", "--trace", str(trace), "--text"]
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"made with {good.resolve()}" in captured.err and "warning" not in captured.err
    assert "compute" in captured.out and "most off" not in captured.out       # a timeline against itself
    good.write_text(json.dumps(_profile(scale=2.0)))
    assert main(argv) == 0
    assert f"warning: {good.resolve()} has changed since the prediction was made" in capsys.readouterr().err
    good.unlink()
    assert main(argv) == 0
    assert f"warning: {good.resolve()} is missing" in capsys.readouterr().err
