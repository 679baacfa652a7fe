"""Sailor's measured Megatron-DeepSpeed runs: `hetc explain` on their imports within 10%.

The plans in ../shared/data/sailor/validation-samples ran for real (1F1B,
TP inside a node, DP all-reduce); `real` is the measured seconds per
iteration. The cost model times them from Sailor's per-layer profiles and
network fits (docs/costmodel.md, "Validation").
"""

from __future__ import annotations

import json

import pytest

from hetc.importers.sailor import explain_plan, imported_plan
from hetc.passes.build import build
from hetc.passes.cost.sources import load_profiles
from tests.conftest import SHARED_DATA

SAILOR = SHARED_DATA / "sailor"
SAMPLES = sorted((SAILOR / "validation-samples").rglob("*.json")) if SAILOR.is_dir() else []
TOLERANCE = 0.10
# Known misses, with why. Each must stay a miss (strict xfail) until the model learns the cause.
KNOWN = {
    "clariden/OPT-350/N4/plan_config_N4_D2.json":
        "predicted 13.6% short: at one sequence per microbatch on GH200, Megatron-DeepSpeed spends "
        "~5 ms per stage and microbatch outside the per-layer times (the engine synchronizes the device "
        "every microbatch); measuring that host-side cost needs the engine on a GPU "
        "(docs/costmodel.md, Validation)",
}


def _ids():
    return [str(p.relative_to(SAILOR / "validation-samples")) for p in SAMPLES]


@pytest.fixture(scope="module")
def profiles():
    if not SAILOR.is_dir():
        pytest.skip(f"Sailor's reference data is not at {SAILOR} (only in the development workspace)")
    return load_profiles([SAILOR])


@pytest.mark.parametrize("sample", SAMPLES, ids=_ids())
def test_predicts_measured_iteration_time(sample, profiles, request):
    name = str(sample.relative_to(SAILOR / "validation-samples"))
    if name in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[name], strict=True))
    real = json.loads(sample.read_text())["real"]
    predicted = explain_plan(str(SAILOR), str(sample), profiles).step_time_s
    error = (predicted - real) / real
    assert abs(error) <= TOLERANCE, \
        f"{name}: predicted {predicted:.4g} s, measured {real:.4g} s ({error:+.1%})"


@pytest.mark.parametrize("sample", SAMPLES, ids=_ids())
def test_closed_form_agrees_with_the_compiled_program(sample, profiles):
    """Issue 32 (2): hetc's own programs for Sailor's plans (deep TP pipelines of up to 128 microbatches a lane),
    lowered, verified and simulated, take the step explain's closed form says, within 10 %."""
    got = build(imported_plan(str(SAILOR), str(sample)), profiles)
    assert got.step_time_s is not None
    closed = got.costs.estimate().step_time_s
    assert abs(closed / got.step_time_s - 1) <= TOLERANCE, \
        f"{sample.name}: closed form {closed:.4g} s, compiled {got.step_time_s:.4g} s"


def test_samples_present(profiles):
    assert len(SAMPLES) >= 4, "the four published validation plans"


def test_the_benchmark_times_every_measured_plan_it_finds(profiles, tmp_path, capsys):
    """benchmarks/sailor_runs.py: plans with a measured `real` are timed; other JSON is passed over."""
    from benchmarks.sailor_runs import main

    runs = tmp_path / "validation"
    for sample in SAMPLES:
        target = runs / sample.relative_to(SAILOR / "validation-samples")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(sample.read_text())
    (runs / "notes.json").write_text('{"not": "a plan"}')
    assert main(["--runs", str(runs), "--data", str(SAILOR), "--no-write"]) == 0
    out = capsys.readouterr().out
    assert f"**{len(SAMPLES)} runs: median |error|" in out
    rows = [line for line in out.splitlines() if line.startswith(("| clariden", "| mit"))]
    assert len(rows) == len(SAMPLES) and "notes.json" not in out
    assert "| clariden/OPT-350/N4/plan_config_N4_D2.json | OPT-350 | 2×2, tp 4 | 1 | 32 | -13.6% |" in rows
    assert main(["--runs", str(tmp_path / "empty"), "--data", str(SAILOR), "--no-write"]) == 2
