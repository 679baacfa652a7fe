"""Mutation tests: the verifier rejects deliberately broken programs, naming rank and instruction.

For each compiled example, 50 seeded random faults — drop a receive, swap
two different collectives of one group on one rank, change a peer, drop a
wait, duplicate a forward, remove an optimizer step, shrink a device's
memory below the rank's peak — and every one must raise VerifyError whose
findings point at real instructions (index in range, text matching) and
name the rank the fault was put into.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re

import pytest

from hetc.passes.cost import CostModel
from hetc.passes.lower.by_class import lower_by_class
from hetc.passes.verify import Backend, VerifyError, verify
from hetc.passes.verify.protocol import check_protocol
from hetc.passes.verify.memory import format_bytes, rank_peaks
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Plan
from hetc.ir.program import COLLECTIVE_TYPES, Forward, Group, Offload, Program, Recv, Send, Step, Tensor, Wait
from tests.conftest import DEMO, ROOT
from tests.golden.cases import GOLDEN_DIR
from tests.plans import DEMO_PLANS, TEST_PLANS, compile_plan, plan_id

EXAMPLES = DEMO_PLANS + TEST_PLANS + [GOLDEN_DIR / "zorse.het", GOLDEN_DIR / "zero3_1f1b.het"]
ALIKE_LANES = ROOT / "tests" / "specs" / "offload8.het"    # 8 ranks in two classes of four
FAULTS_PER_EXAMPLE = 50


@dataclasses.dataclass(frozen=True)
class Mutant:
    fault: str
    rank: int
    program: Program
    pipeline: Pipeline


def _positions(program: Program, kind, on: int | None = None) -> list[tuple[int, int]]:
    """(rank, index) of every instruction of `kind`, on rank `on` only where it is given."""
    ranks = program.ranks if on is None else [program.ranks[on]]
    return [(rp.rank, i) for rp in ranks for i, instr in enumerate(rp.instrs) if isinstance(instr, kind)]


def _edit(program: Program, rank: int, instrs: list) -> Program:
    return program.replace_rank(rank, tuple(instrs))


# Each fault takes (rng, program, pipeline) and, optionally, the rank to put it into (`on`; else a random
# one); it returns (that rank, the faulty program, the pipeline).
def drop_recv(rng, program, pipeline, on=None):
    rank, i = rng.choice(_positions(program, Recv, on))
    instrs = list(program.ranks[rank].instrs)
    handle = instrs.pop(i).handle
    if handle is not None and rng.random() < 0.5:   # and its wait, so only the data is missing
        instrs = [x for x in instrs if not (isinstance(x, Wait) and x.handle == handle)]
    return rank, _edit(program, rank, instrs), pipeline


def _collective_key(instr) -> tuple:
    return (type(instr), instr.what, getattr(instr, "ms", None), getattr(instr, "mb", None))


def swap_collectives(rng, program, pipeline, on=None):
    """Two collectives of one group with different content, on one rank of a group of two or more."""
    sizes = {g.name: len(g.ranks) for g in program.groups}
    pairs = []
    for rp in program.ranks if on is None else [program.ranks[on]]:
        calls = [(i, x) for i, x in enumerate(rp.instrs) if isinstance(x, COLLECTIVE_TYPES) and sizes[x.group] > 1]
        pairs += [(rp.rank, i, j) for a, (i, x) in enumerate(calls) for j, y in calls[a + 1:]
                  if x.group == y.group and _collective_key(x) != _collective_key(y)]
    rank, i, j = rng.choice(pairs)
    instrs = list(program.ranks[rank].instrs)
    instrs[i], instrs[j] = instrs[j], instrs[i]
    return rank, _edit(program, rank, instrs), pipeline


def change_peer(rng, program, pipeline, on=None):
    rank, i = rng.choice(_positions(program, (Send, Recv), on))
    instrs = list(program.ranks[rank].instrs)
    instr = instrs[i]
    old = instr.peer_to if isinstance(instr, Send) else instr.peer_from
    peer = rng.choice([r for r in range(program.world_size) if r not in (rank, old)])
    field = "peer_to" if isinstance(instr, Send) else "peer_from"
    instrs[i] = dataclasses.replace(instr, **{field: peer})
    return rank, _edit(program, rank, instrs), pipeline


def _remove_one(kind):
    def remove(rng, program, pipeline, on=None):
        rank, i = rng.choice(_positions(program, kind, on))
        instrs = list(program.ranks[rank].instrs)
        del instrs[i]
        return rank, _edit(program, rank, instrs), pipeline
    return remove


drop_wait = _remove_one(Wait)
remove_step = _remove_one(Step)


def duplicate_forward(rng, program, pipeline, on=None):
    rank, i = rng.choice(_positions(program, Forward, on))
    instrs = list(program.ranks[rank].instrs)
    instrs.insert(rng.randrange(i + 1, len(instrs) + 1), instrs[i])
    return rank, _edit(program, rank, instrs), pipeline


def _copying_offloads(program: Program, on: int | None = None) -> list[tuple[int, int]]:
    return [(rank, i) for rank, i in _positions(program, Offload, on)
            if program.ranks[rank].instrs[i].what is Tensor.PARAMS and not program.ranks[rank].instrs[i].host_current]


def release_stepped_params(rng, program, pipeline, on=None):
    """The offload after a ministage's step releases its parameters without copying them back (Note [clean
    parameter offload] in passes/lower/offload.py): the host copy would be a step behind."""
    rank, i = rng.choice(_copying_offloads(program, on))
    instrs = list(program.ranks[rank].instrs)
    instrs[i] = dataclasses.replace(instrs[i], host_current=True)
    return rank, _edit(program, rank, instrs), pipeline


def shrink_memory(rng, program, pipeline, peaks, on=None):
    """The rank's device now holds a little (or a lot) less than the rank's peak use."""
    rank = rng.randrange(program.world_size) if on is None else on
    gpu = pipeline.world[rank]
    smaller = dataclasses.replace(gpu.device, memory=peaks[rank].total * rng.uniform(0.5, 0.9999))
    world = tuple(dataclasses.replace(g, device=smaller) if r == rank else g for r, g in enumerate(pipeline.world))
    return rank, program, dataclasses.replace(pipeline, world=world)


FAULTS = {"drop_recv": drop_recv, "swap_collectives": swap_collectives, "change_peer": change_peer,
          "drop_wait": drop_wait, "duplicate_forward": duplicate_forward, "remove_step": remove_step,
          "shrink_memory": shrink_memory, "release_stepped_params": release_stepped_params}


def _applicable(program: Program, on: int | None = None) -> list[str]:
    """The faults that can be put into `program` (into rank `on`, where it is given)."""
    out = ["shrink_memory"]
    out += [fault for fault, kind in (("duplicate_forward", Forward), ("remove_step", Step), ("drop_wait", Wait))
            if _positions(program, kind, on)]
    if _positions(program, Recv, on):
        out += ["drop_recv", "change_peer"]
    if _copying_offloads(program, on):
        out.append("release_stepped_params")
    sizes = {g.name: len(g.ranks) for g in program.groups}
    ranks = program.ranks if on is None else [program.ranks[on]]
    if any(len({_collective_key(x) for x in rp.instrs if isinstance(x, COLLECTIVE_TYPES) and x.group == g}) > 1
           for rp in ranks for g, n in sizes.items() if n > 1):
        out.append("swap_collectives")
    return sorted(out)


def faults_on(rank: int, program: Program, pipeline: Pipeline, peaks, seed: str) -> list[Mutant]:
    """One fault of every kind that applies, each put into rank `rank` (issue 31: a fault in one member of
    a class of alike ranks is found, as one in its representative)."""
    rng = random.Random(seed)
    out = []
    for fault in _applicable(program, rank):
        extra = (peaks,) if fault == "shrink_memory" else ()
        _, faulty, faulty_pipeline = FAULTS[fault](rng, program, pipeline, *extra, on=rank)
        out.append(Mutant(fault, rank, faulty, faulty_pipeline))
    return out


@functools.cache
def _example(path):
    lowered = compile_plan(path)
    costs = CostModel(lowered.plan)
    return lowered, costs, rank_peaks(lowered.program, lowered.pipeline, costs)


def mutants(path, count: int = FAULTS_PER_EXAMPLE) -> list[Mutant]:
    lowered, _, peaks = _example(path)
    rng = random.Random(f"{plan_id(path)}")
    kinds = _applicable(lowered.program)
    out = []
    for k in range(count):
        fault = kinds[k % len(kinds)] if k < len(kinds) else rng.choice(kinds)   # every kind at least once
        extra = (peaks,) if fault == "shrink_memory" else ()
        rank, program, pipeline = FAULTS[fault](rng, lowered.program, lowered.pipeline, *extra)
        out.append(Mutant(fault, rank, program, pipeline))
    return out


def test_enough_examples():
    assert len(EXAMPLES) >= 10
    assert max(compile_plan(p).program.world_size for p in EXAMPLES) >= 16


@pytest.mark.parametrize("path", EXAMPLES, ids=plan_id)
def test_the_unmutated_example_verifies(path):
    lowered, costs, _ = _example(path)
    verify(lowered.program, lowered.plan, costs)


def names_rank(err: VerifyError, rank: int) -> bool:
    """Whether a finding of `err` is on rank `rank` or names it."""
    return any(f.rank == rank or re.search(rf"\brank {rank}\b", f.message) for f in err.findings)


def assert_rejected(mutant: Mutant, plan: Plan, costs: CostModel, case: str) -> VerifyError:
    """The verifier rejects `mutant`, naming its rank and pointing at real instructions."""
    with pytest.raises(VerifyError) as caught:
        verify(mutant.program, dataclasses.replace(plan, pipeline=mutant.pipeline), costs)
    err = caught.value
    assert err.findings, case
    for f in err.findings:
        instrs = mutant.program.ranks[f.rank].instrs
        assert 0 <= f.index < len(instrs), f"{case}: {f}"
        assert f.text == str(instrs[f.index]), f"{case}: {f}"
        assert f"rank {f.rank}, instruction {f.index} `{f.text}`" in str(err), case
    assert names_rank(err, mutant.rank), f"{case}: the error does not name rank {mutant.rank}:\n{err}"
    if mutant.fault == "shrink_memory":
        assert err.check == "memory", case
        assert format_bytes(mutant.pipeline.world[mutant.rank].device.memory) in str(err), case
    return err


@pytest.mark.parametrize("path", EXAMPLES, ids=plan_id)
def test_every_fault_is_rejected_naming_rank_and_instruction(path):
    lowered, costs, _ = _example(path)
    for n, mutant in enumerate(mutants(path)):
        assert_rejected(mutant, lowered.plan, costs, f"{plan_id(path)} fault #{n} ({mutant.fault} on rank {mutant.rank})")


def test_a_fault_in_one_member_of_a_class_is_found():
    """Compile lowers one representative of each class of alike ranks and renames it for the members (Note
    [lowering by class]); every fault kind put into the last member of the largest class is found, as in
    any rank. (benchmarks/verify_scale.py does the same at 16,384 GPUs.)"""
    lowered, costs, peaks = _example(ALIKE_LANES)
    classes = lower_by_class(lowered.plan, costs).classes
    largest = max(classes, key=lambda c: len(c.members))
    member = largest.members[-1][0]
    assert len(largest.members) >= 3 and member != largest.rep
    faults = faults_on(member, lowered.program, lowered.pipeline, peaks, "member")
    assert {m.fault for m in faults} == set(FAULTS)
    for mutant in faults:
        assert_rejected(mutant, lowered.plan, costs, f"{mutant.fault} on rank {member}, a member of {largest.rep}'s class")


def test_every_fault_kind_is_exercised():
    kinds = {m.fault for path in EXAMPLES for m in mutants(path)}
    assert kinds == set(FAULTS)


def test_memory_error_names_the_peak_and_the_capacity():
    lowered, costs, peaks = _example(DEMO / "zero3_offload.het")
    rank = 2
    _, _, pipeline = shrink_memory(random.Random(0), lowered.program, lowered.pipeline, peaks)
    world = tuple(dataclasses.replace(g, device=dataclasses.replace(g.device, memory=peaks[rank].total - 1))
                  if r == rank else g for r, g in enumerate(lowered.pipeline.world))
    with pytest.raises(VerifyError) as caught:
        verify(lowered.program, dataclasses.replace(lowered.plan, pipeline=dataclasses.replace(pipeline, world=world)), costs)
    finding = next(f for f in caught.value.findings if f.rank == rank)
    assert finding.index == peaks[rank].index, "just below the peak, the peak is the first overflow"
    assert f"needs {format_bytes(peaks[rank].total)} at its peak (instruction {peaks[rank].index}:" in \
        finding.message
    assert f"holds {format_bytes(peaks[rank].total - 1)}" in finding.message


@pytest.mark.parametrize("backend", list(Backend))
def test_an_outer_collective_over_buffers_cut_differently_is_a_protocol_error(backend):
    """Hierarchical ZeRO reduces shard i of every node together; a member whose node cut the ministage into
    other pieces (its shard group of another size) would send a buffer of another size, which gloo stops on
    and NCCL does not check. The protocol check names it (passes/validate_plan.py refuses such plans before)."""
    program = compile_plan(DEMO / "hsdp.het").program
    rank = 2                                      # host[1]'s first replica: its shard group is [2, 3]
    shards = tuple(dataclasses.replace(sh, group="alone") for sh in program.ranks[rank].shards)
    ranks = list(program.ranks)
    ranks[rank] = dataclasses.replace(ranks[rank], shards=shards)
    cut = dataclasses.replace(program, ranks=tuple(ranks), groups=(*program.groups, Group("alone", (rank,))))
    assert not check_protocol(program, backend=backend)
    findings = check_protocol(cut, backend=backend)
    assert findings and "buffers of different sizes" in findings[0].message, [str(f) for f in findings]
    assert "1/1" in findings[0].message and "1/2" in findings[0].message
