"""Lowering by class gives every rank the program lowering rank by rank gives (issue 31, Done-when "Exactness").

`lower_by_class` (what `hetc compile` runs, passes/build.py) lowers one
representative per class of alike ranks and renames it for the others
(Note [lowering by class] in passes/lower/classes.py); `lower` builds every
rank. For every spec under specs/ and tests/specs/ that is a whole plan (or
a plan with `auto`: specs/'s as the agreement family plans them, once a
session, tests/planned.py; the others narrowly), a sample of the random agreement
family (tests/random_jobs.py: planned jobs, and deep explicit pipelines
of long alike lanes) and small plans made to tell classes apart, the two
listings agree line for line.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import get_args

import pytest

from hetc.compiler import load_checked
from hetc.ir.errors import SpecError
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.lower.by_class import ClassLowering, lower_by_class
from hetc.passes.lower.substitute import RENAMED_FIELDS, SHARD_GROUPS
from hetc.passes.plan.planner import plan_spec
from hetc.ir.plan import Plan
from hetc.ir.program import Instr, Program, Shard
from tests.conftest import DEMO, ROOT, all_spec_files
from tests.planned import NARROW, PlanCache, Planned
from tests.planned import SPECS as AGREEMENT_SPECS
from tests.random_jobs import deep_job

SPEC_FILES = [p for p in all_spec_files() + sorted((ROOT / "tests" / "specs").rglob("*.het"))
              if p.name not in ("job.het", "moe_job.het", "tied_job.het", "catalog.het")]
# a sample of the agreement family (tests/planned.py plans seeds 0-99 with max_gpus=8) and of its deep plans:
# two lanes a stage in 13 (1f1b), 18 and 21 (interleaved), 26, so that their classes have members
JOB_SEEDS = (0, 1, 7, 27, 39, 64, 69, 81, 97)
DEEP_SEEDS = (0, 4, 13, 18, 21, 26)


def _plan(path: Path) -> Plan | None:
    """`path`'s whole plan (planned narrowly where it has `auto`); None for a file that is no whole job."""
    try:
        loaded, checked = load_checked(path, require_complete=True)
    except SpecError:
        return None    # a part other specs import (a cluster, a model), or a case of tests/invalid
    explicit = checked.explicit()
    if explicit is not None:
        return explicit
    try:
        return plan_spec(loaded.spec, None, loaded.path.parent, limits=NARROW).plan
    except SpecError:
        return None    # nothing fits: the planner says so (tests/test_plan_agreement.py)


def _both_ways(plan: Plan) -> tuple[Program, ClassLowering]:
    per_rank = lower(plan, costs=CostModel(plan))
    by_class = lower_by_class(plan, CostModel(plan))
    return per_rank, by_class


def _assert_same(per_rank: Program, by_class: ClassLowering) -> None:
    _assert_same_programs(per_rank, by_class.program)
    assert sorted(r for c in by_class.classes for r in (c.rep, *(m for m, _ in c.members))) == \
        list(range(per_rank.world_size))


def _assert_same_programs(per_rank: Program, got: Program) -> None:
    assert got.groups == per_rank.groups
    assert [rp.rank for rp in got.ranks] == [rp.rank for rp in per_rank.ranks]
    for want, have in zip(per_rank.ranks, got.ranks, strict=True):
        if have != want:   # (the same objects print the same listing; the listings say where they differ)
            assert have.to_text() == want.to_text(), f"rank {want.rank} differs from its lowering by itself"
            assert have == want, f"rank {want.rank}: the same listing from different instructions"


def _shared(got: Planned | None) -> Plan | None:
    return None if got is None else got.result.plan


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_spec_lowers_by_class_as_rank_by_rank(path: Path, plan_cache: PlanCache):
    """specs/'s jobs as tests/test_plan_agreement.py plans and compiles them (tests/planned.py: once a session);
    the rest of the files as `_plan` reads them."""
    if path in AGREEMENT_SPECS:   # the programs the session compiled (lowered by class) against rank by rank
        got = plan_cache.spec(path)
        if got is None:
            pytest.skip("nothing fits")
        _assert_same_programs(lower(got.result.plan, costs=CostModel(got.result.plan)), got.built.program)
        return
    plan = _plan(path)
    if plan is None:
        pytest.skip("not a whole job, or nothing fits")
    _assert_same(*_both_ways(plan))


@pytest.mark.parametrize("family, seed", [("job", s) for s in JOB_SEEDS] + [("deep", s) for s in DEEP_SEEDS],
                         ids=lambda v: str(v))
def test_random_and_deep_jobs_lower_by_class_as_rank_by_rank(family: str, seed: int, tmp_path: Path,
                                                             plan_cache: PlanCache):
    if family == "job":      # planned as the agreement family plans it
        plan = _shared(plan_cache.job(seed))
    else:
        path = tmp_path / "job.het"
        path.write_text(deep_job(random.Random(seed)))
        plan = _plan(path)
    if plan is None:
        assert family == "job", "a deep job always fits"
        pytest.skip("nothing fits")
    _assert_same(*_both_ways(plan))


def _tp_lanes(tmp_path: Path, counts: str) -> Plan:
    """The demo job on one stage of two lanes of two tensor-parallel ranks, `counts` microbatches each."""
    path = tmp_path / "lanes.het"
    path.write_text(f'use "{(DEMO / "job.het").as_posix()}"\n\nparallel {{\n  stage all {{\n'
                    f"    layers = embed..head\n    ranks = host\n    lanes = 2\n    tp = 2\n"
                    f"    microbatches = [{counts}]\n  }}\n}}\n")
    plan = _plan(path)
    assert plan is not None
    return plan


def _classes(lowered: ClassLowering) -> list[tuple[int, ...]]:
    return sorted((c.rep, *(m for m, _ in c.members)) for c in lowered.classes)


def test_lanes_alike_share_a_class_and_lanes_of_other_counts_do_not(tmp_path: Path):
    """Two lanes of two microbatches each: a rank and its namesake in the other lane share a class; with
    three and one microbatches (what the class key must tell apart) every rank is a class of its own."""
    assert _classes(lower_by_class(_tp_lanes(tmp_path, "2, 2"))) == \
        [(0, 2), (1, 3)]
    per_rank, uneven = _both_ways(_tp_lanes(tmp_path, "3, 1"))
    assert _classes(uneven) == [(0,), (1,), (2,), (3,)]
    _assert_same(per_rank, uneven)


def test_the_renaming_knows_every_field_of_every_instruction():
    """A field added to an instruction (or a group to a shard) must be renamed or kept on purpose
    (passes/lower/substitute.py), not dropped by a constructor that does not know it."""
    kinds = set(get_args(Instr))
    assert set(RENAMED_FIELDS) == kinds
    for kind in kinds:
        assert RENAMED_FIELDS[kind] == tuple(f.name for f in dataclasses.fields(kind)), kind.__name__
    names = {f.name for f in dataclasses.fields(Shard) if "str" in str(f.type)}
    assert names == set(SHARD_GROUPS)


_TWO_STAGES = """use "{catalog}"

model m {{
  arch = llama
  layers = 2
  hidden = 256
  heads = 4
  kv_heads = 4
  ffn = 1024
  vocab = 1000
  seq = 512
  dtype = bf16
}}

cluster two {{
  node a {{
    device = H100
    count = 1
    gpus = 2
    region = east
  }}
  node b {{
    device = H100
    count = 1
    gpus = 1
    region = east
  }}
  node c {{
    device = {device}
    count = 1
    gpus = 1
    region = {region}
  }}
{link}}}

train {{
  global_batch = 8
  micro_batch = 1
}}

parallel {{
  schedule = 1f1b
  stage s0 {{
    layers = embed..block0
    ranks = {first}
    lanes = 2
    microbatches = [4, 4]
  }}
  stage s1 {{
    layers = block1..head
    ranks = {second}
    lanes = 2
    microbatches = [4, 4]
  }}
}}
"""


ALIKE = ("H100", "east", "a", "[b[0, 0], c[0, 0]]")


@pytest.mark.parametrize(("plan", "classes"), [
    (ALIKE, [(0, 1), (2, 3)]),                                        # each stage's two lanes are one class
    (("A100-80", *ALIKE[1:]), [(0,), (1,), (2,), (3,)]),              # s1's second lane computes at another speed
    (("H100", "west", *ALIKE[2:]), [(0,), (1,), (2,), (3,)]),         # s1's second border crosses a slow link
    (("H100", "east", "[a[0, 1], b[0, 0]]", "[c[0, 0], a[0, 0]]"),    # s0 lane 0 (rank 1) sends up to rank 3,
     [(0,), (1,), (2,), (3,)]),                                       # lane 1 (rank 2) down to rank 0
], ids=["alike", "device", "link", "rank-order"])
def test_lanes_that_differ_are_classes_apart(plan: tuple[str, str, str, str], classes: list, tmp_path: Path):
    """Two stages of two lanes, each the other's peer: where a lane of s1 computes at another speed, sits
    behind a slow link, or ranks of the two stages do not keep their order, the lanes of each stage are
    classes apart (their programs may come out the same, but the key cannot know that)."""
    device, region, first, second = plan
    link = "  link east <-> west {\n    bandwidth = 1 GB/s\n    latency = 10 ms\n  }\n" if region == "west" else ""
    path = tmp_path / "two.het"
    path.write_text(_TWO_STAGES.format(catalog=(ROOT / "specs" / "catalog.het").as_posix(), device=device,
                                       region=region, link=link, first=first, second=second))
    explicit = _plan(path)
    assert explicit is not None
    per_rank, by_class = _both_ways(explicit)
    assert _classes(by_class) == classes
    _assert_same(per_rank, by_class)
