"""The check by lane position (Note [checking one lane position] in passes/verify/positions.py) is the full check.

Random tp-2 plans (tests/random_plans.py: pipelines, uneven lanes, every schedule, ZeRO 0-3, offload,
clipping): lowering builds each lane position as a copy of position 0 (the Note's first claim), lowering
position 0 alone builds what the full lowering builds there, and the check of position 0 says what
`verify` says of every rank. Then faults put into position 0 and copied to every position (the programs
the Note's second claim speaks of): the check of position 0 rejects exactly those `verify` rejects.
tests/test_plan_agreement.py asks the same of the agreement family's plans (`assert_copies_position_0`).
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from hetc.compiler import load_checked
from hetc.ir.errors import SpecError
from hetc.ir.groups import split_direction, with_direction
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.verify import VerifyError, verify
from hetc.passes.verify.memory import rank_peaks
from hetc.passes.verify.positions import LanePositions, lane_positions, part_passes, position_program
from hetc.ir.pipeline import Pipeline
from hetc.ir.program import Instr, Program, RankProgram, Recv, Send, Shard
from tests.random_plans import random_plan
from tests.test_verifier_mutations import FAULTS

SEEDS = range(24)
MUTANTS_PER_PLAN = 12


@functools.cache
def _plan(seed: int, folder: str):
    path = f"{folder}/plan{seed}.het"
    with open(path, "w") as f:
        f.write(random_plan(random.Random(seed), tp=2))
    try:
        _, checked = load_checked(path, require_complete=True)
    except SpecError:
        return None
    plan = checked.explicit()
    costs = CostModel(plan)
    return plan, costs, lower(plan, costs=costs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("positions"))


def _verifies(program: Program, plan, costs) -> bool:
    try:
        verify(program, plan, costs)
    except VerifyError:
        return False
    return True


# ---------------------------------------------------------------- copies of position 0


def _group_images(program: Program, image: dict[int, int]) -> dict[str, str]:
    """Each group name as position p names it: a group inside position 0 becomes the group of its members'
    images (with the same per-microbatch copy); one across positions stays."""
    by_members = {}
    for g in program.groups:
        base, direction = split_direction(g.name)
        if direction is None:
            assert g.ranks not in by_members, f"two groups of members {g.ranks}"
            by_members[g.ranks] = base
    out = {}
    for g in program.groups:
        base, direction = split_direction(g.name)
        members = next(h.ranks for h in program.groups if h.name == base)
        if all(r in image for r in members):
            base = by_members[tuple(sorted(image[r] for r in members))]
        out[g.name] = base if direction is None else with_direction(base, direction)
    return out


def _renamed(instr: Instr, image: dict[int, int], groups: dict[str, str], shift: int) -> Instr:
    """`instr` at another position: peers and groups by their images, a border piece's tokens `shift` on (part
    0 of the tp parts of Note [scatter-gather borders] becomes the position's part)."""
    if isinstance(instr, (Send, Recv)):
        seq = None if instr.seq is None else (instr.seq[0] + shift, instr.seq[1] + shift)
        if isinstance(instr, Send):
            return dataclasses.replace(instr, peer_to=image.get(instr.peer_to, -1), seq=seq)
        return dataclasses.replace(instr, peer_from=image.get(instr.peer_from, -1), seq=seq)
    group = getattr(instr, "group", None)
    return instr if group is None else dataclasses.replace(instr, group=groups[group])


def _renamed_shard(shard: Shard, groups: dict[str, str]) -> Shard:
    names = {f: groups[v] for f in ("group", "outer", "tp_group", "cp_group", "ep_group", "expert_group")
             if (v := getattr(shard, f)) is not None}
    return dataclasses.replace(shard, **names)


def copies(part: Program, positions: LanePositions, pipeline: Pipeline, groups: tuple, seq: int) -> Program:
    """Every rank's program, each position's a copy of position 0's (`part`, in the order of `positions.firsts`):
    the program the Note's second claim speaks of (`seq`: the model's sequence length)."""
    lanes = {lane.ranks[0]: lane for stage in pipeline.stages for lane in stage.lanes}
    ranks: dict[int, RankProgram] = {}
    whole = Program(part.ranks, groups)
    for pos in range(positions.width):
        image = {r: lanes[r].ranks[pos] for r in positions.firsts}
        names = _group_images(whole, image)
        for rp in part.ranks:
            ranks[image[rp.rank]] = RankProgram(image[rp.rank], rp.stage, rp.lane, pos, rp.cp_rank,
                                                tuple(_renamed_shard(s, names) for s in rp.shards),
                                                tuple(_renamed(i, image, names, pos * seq // positions.width) for i in rp.instrs))
    return Program(tuple(ranks[r] for r in range(len(ranks))), groups)


def assert_copies_position_0(program: Program, plan, costs) -> bool:
    """Where the plan's lane positions copy position 0 (`lane_positions`), assert that `program` (every rank's,
    verified) is those copies and that the check of position 0 passes it; False where they do not."""
    positions = lane_positions(plan.pipeline, plan.model.seq)
    if positions is None:
        return False
    part = Program(tuple(program.ranks[r] for r in positions.firsts), program.groups)
    assert copies(part, positions, plan.pipeline, program.groups, plan.model.seq) == program
    assert part_passes(part, positions, plan, costs)
    return True


def test_random_tp_plans_lower_as_copies_of_position_0(folder):
    checked = 0
    for seed in SEEDS:
        got = _plan(seed, folder)
        if got is None:
            continue
        plan, costs, program = got
        pipeline = plan.pipeline
        positions = lane_positions(pipeline, plan.model.seq)
        if positions is None:   # hierarchical ZeRO: not of the Note's shape
            assert any(s.zero.shard.value == "node" for s in pipeline.stages), seed
            continue
        assert copies(lower(plan, costs=costs, ranks=positions.firsts), positions, pipeline,
                      program.groups, plan.model.seq) == program, seed
        fits = _verifies(program, plan, costs)
        part = Program(tuple(program.ranks[r] for r in positions.firsts), program.groups)
        assert part_passes(part, positions, plan, costs) == fits, seed
        checked += 1
    assert checked >= len(SEEDS) // 3


# ---------------------------------------------------------------- faults in position 0, copied


def _back(mutant: Program, positions: LanePositions, groups: tuple) -> Program:
    """`position_program`'s renumbering undone: rank i is `positions.firsts[i]` again."""
    first = positions.firsts

    def instr(x: Instr) -> Instr:
        if isinstance(x, Send):
            return dataclasses.replace(x, peer_to=first[x.peer_to])
        if isinstance(x, Recv):
            return dataclasses.replace(x, peer_from=first[x.peer_from])
        return x
    return Program(tuple(dataclasses.replace(rp, rank=first[i], instrs=tuple(map(instr, rp.instrs)))
                         for i, rp in enumerate(mutant.ranks)), groups)


def _shrunk(rng: random.Random, pipeline: Pipeline, program: Program, costs) -> Pipeline:
    """One lane's devices hold a little (or a lot) less than its ranks' peak."""
    lane = rng.choice([lane for stage in pipeline.stages for lane in stage.lanes])
    peak = max(p.total for p in rank_peaks(program, pipeline, costs) if p.rank in lane.ranks)
    smaller = dataclasses.replace(pipeline.world[lane.ranks[0]].device, memory=peak * rng.uniform(0.5, 0.9999))
    return dataclasses.replace(pipeline, world=tuple(dataclasses.replace(g, device=smaller) if r in lane.ranks else g
                                                     for r, g in enumerate(pipeline.world)))


def test_faults_copied_to_every_position_are_rejected_by_the_check_of_position_0(folder):
    rng = random.Random(0)
    kinds = sorted(k for k in FAULTS if k != "shrink_memory") + ["shrink_memory"]
    seen = {"rejected": 0, "accepted": 0}
    for seed in SEEDS[:8]:
        got = _plan(seed, folder)
        positions = got and lane_positions(got[0].pipeline, got[0].model.seq)
        if not positions:
            continue
        plan, costs, program = got
        pipeline = plan.pipeline
        part = Program(tuple(program.ranks[r] for r in positions.firsts), program.groups)
        reduced = position_program(part, positions)
        for k in range(MUTANTS_PER_PLAN):
            fault = kinds[k % len(kinds)]
            mutant_pipeline, mutant = pipeline, part
            if fault == "shrink_memory":
                mutant_pipeline = _shrunk(rng, pipeline, program, costs)
            else:
                try:
                    _, changed, _ = FAULTS[fault](rng, reduced, pipeline)
                except IndexError:   # nothing of that kind at position 0
                    continue
                mutant = _back(changed, positions, program.groups)
            whole = copies(mutant, positions, mutant_pipeline, program.groups, plan.model.seq)
            mutant_plan = dataclasses.replace(plan, pipeline=mutant_pipeline)
            fits = _verifies(whole, mutant_plan, costs)
            assert part_passes(mutant, positions, mutant_plan, costs) == fits, (seed, fault)
            seen["accepted" if fits else "rejected"] += 1
    assert seen["rejected"] >= 30, seen
