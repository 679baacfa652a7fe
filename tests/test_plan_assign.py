"""The assignment model: CP-SAT from a complete hint is never worse than it, and dropping dominated options
keeps the model's optimum (Note [dominated options] in passes/plan/assign.py)."""

from __future__ import annotations

import itertools
import math
import random
from typing import cast

import pytest

from hetc.passes.plan.candidate_view import ResolvedStage
from hetc.passes.plan.stage_option import LaneClass
from hetc.passes.plan.assign import _undominated, assign_cpsat, assign_fast, cpsat_model, model_objective
from hetc.passes.plan.candidate import Knobs
from hetc.passes.plan.routing import bottleneck
from hetc.passes.plan.tables import Option, StageTable

UNITS = 8
MICROBATCHES = 12
LANES = ((1,), (2, 3))   # two lane classes per stage: one lane, then two


def _option(rng: random.Random, layers: int, zero: int) -> Option:
    classes = tuple(LaneClass(lanes, layers * rng.uniform(0.5, 1.5), rng.choice((MICROBATCHES, 4, 6)))
                    for lanes in LANES)
    work = bottleneck(MICROBATCHES, [(len(c.lanes), c.cycle, c.cap) for c in classes])
    return Option(layers, Knobs(zero=zero), classes, rng.uniform(0, 1), rng.uniform(0, 2), rng.uniform(0, 1),
                  False, work)


def _tables(seed: int, stages: int = 3) -> list[StageTable]:
    rng = random.Random(seed)
    return [StageTable(s, cast(ResolvedStage, None),
                       [_option(rng, n, zero) for n in range(1, UNITS - stages + 2) for zero in range(3)])
            for s in range(stages)]


def _best_by_enumeration(tables: list[StageTable]) -> float:
    """The model's optimum by brute force: every choice of one placeable option per stage covering UNITS."""
    placeable = [[o for o in t.options if o.work is not None] for t in tables]
    return min(model_objective(choice) for choice in itertools.product(*placeable)
               if sum(o.layers for o in choice) == UNITS)


@pytest.mark.parametrize("seed", range(4))
def test_cpsat_is_never_worse_than_its_hint_and_finds_the_optimum(seed):
    tables = _tables(seed)
    hint = assign_fast(tables, UNITS, MICROBATCHES)
    assert hint is not None
    got = assign_cpsat(tables, UNITS, MICROBATCHES, hint, work_limit=5.0)
    assert got is not None and sum(o.layers for o in got.options) == UNITS
    assert got.objective <= hint.objective * (1 + 1e-9)
    # the model works in integer ticks of 1/200000 of the hint's objective: the optimum up to them
    assert got.objective <= _best_by_enumeration(tables) * (1 + 1e-4)


def test_a_dominated_option_leaves_the_model_but_the_hints_stay():
    rng = random.Random(7)
    good = _option(rng, 3, 0)
    worse = Option(3, Knobs(zero=1), tuple(LaneClass(c.lanes, c.cycle * 2, c.cap) for c in good.classes),
                   good.fill + 1, good.tail, good.drain, False, good.work)
    other = _option(rng, 4, 0)   # another layer count is never compared
    opts = [(0.0, good), (0.0, worse), (0.0, other)]
    assert [o for _, o in _undominated(opts, set())] == [good, other]
    assert [o for _, o in _undominated(opts, {id(worse)})] == [good, worse, other]
    twin = Option(3, Knobs(zero=2), good.classes, good.fill, good.tail, good.drain, False, good.work)
    assert [o for _, o in _undominated([(0.0, good), (0.0, twin)], set())] == [good]   # the first of equals


@pytest.mark.parametrize("seed", range(3))
def test_the_model_is_the_one_ortools_python_front_builds(seed):
    """Note [CP-SAT without cp_model.py]: passes/plan/cpsat.py builds, from the same calls, the very proto
    cp_model.CpModel builds (lockstep options included), so CP-SAT gives the same answer."""
    cp_model = pytest.importorskip("ortools.sat.python.cp_model")
    tables = _tables(seed)
    lockstep = tables[1].options[0]
    tables[1].options[0] = Option(lockstep.layers, lockstep.knobs, lockstep.classes, lockstep.fill, lockstep.tail,
                                  lockstep.drain, True, lockstep.work)
    hint = assign_fast(tables, UNITS, MICROBATCHES)
    assert hint is not None
    per_stage = [[(o.placed_work, o) for o in t.options if o.work is not None] for t in tables]

    def ticks(seconds: float) -> int:
        return math.ceil(seconds * 1000)

    ours, _ = cpsat_model(per_stage, UNITS, MICROBATCHES, hint, ticks)
    theirs, _ = cpsat_model(per_stage, UNITS, MICROBATCHES, hint, ticks, new_model=cp_model.CpModel)
    text = str(ours.model_proto)
    assert "enforcement_literal" in text and "solution_hint" in text and "objective" in text
    assert text == str(theirs.proto)
