"""Memory curves in predicted timelines: the verifier's memory walk, placed at the simulated times."""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

from hetc.compiler import compile_spec
from hetc.passes.verify.memory import rank_levels, rank_peaks
from hetc.ir.timeline import EventKind, MemorySample, Timeline

ROOT = Path(__file__).resolve().parent.parent
PLANS = [ROOT / "specs" / "demo" / name for name in ("hetero.het", "zb.het", "zero3_offload.het", "offload_act.het")]
PLANS += [ROOT / "tests" / "specs" / "zorse16.het", ROOT / "tests" / "specs" / "viz" / "hetero64.het"]
COMPUTE = {EventKind.FORWARD, EventKind.BACKWARD, EventKind.BACKWARD_INPUT, EventKind.BACKWARD_WEIGHT,
           EventKind.OPTIMIZER}


def _curves(timeline: Timeline) -> dict[int, list[MemorySample]]:
    curves: dict[int, list[MemorySample]] = defaultdict(list)
    for m in timeline.memory:
        curves[m.rank].append(m)
    return curves


@pytest.mark.parametrize("spec", PLANS, ids=lambda p: p.stem)
def test_every_rank_has_a_memory_curve_whose_peak_is_the_verifiers(spec):
    compiled = compile_spec(spec)
    timeline = compiled.timeline
    curves = _curves(Timeline.from_json(timeline.to_json()))   # as timeline.json carries it
    assert curves.keys() == {r.rank for r in timeline.ranks}
    starts = {(e.rank, e.index): e for e in timeline.events if e.kind in COMPUTE}
    placed = 0
    for peak in rank_peaks(compiled.program, compiled.pipeline, compiled.costs):
        curve = curves[peak.rank]
        assert max(m.nbytes for m in curve) == peak.total
        times = [m.time for m in curve]
        assert times == sorted(times) and 0 <= times[0] and times[-1] <= timeline.step_time
        assert all(a.nbytes != b.nbytes for a, b in itertools.pairwise(curve))   # one sample per change
        # the level first reaches the peak when the peak's instruction is issued
        event = starts.get((peak.rank, peak.index))
        if event is not None:
            assert next(m.time for m in curve if m.nbytes == peak.total) == event.start
            placed += 1
    assert placed > 0, "no rank peaks at a compute op: the test of the sample times checked nothing"


def test_levels_are_the_walk_the_memory_check_makes():
    compiled = compile_spec(PLANS[2])   # ZeRO-3 with parameter offload: gathers, frees, prefetches
    program = compiled.program
    levels = rank_levels(program, compiled.pipeline, compiled.costs)
    peaks = rank_peaks(program, compiled.pipeline, compiled.costs)
    for rp, rank_level, peak in zip(program.ranks, levels, peaks, strict=True):
        assert len(rank_level) == len(rp.instrs) + 1
        assert max(rank_level) == peak.total and rank_level.index(peak.total) == peak.index
        assert rank_level[-1] < peak.total   # gradients and gathered parameters are given back by the end
    # the samples are the levels where they change, at each instruction's issue time
    curve = _curves(compiled.timeline)[0]
    changes = [level for k, level in enumerate(levels[0]) if k == 0 or level != levels[0][k - 1]]
    assert [m.nbytes for m in curve] == changes
