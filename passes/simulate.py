"""Predict one step's timeline by running the programs against the cost model.

Note [timeline model]: the verifier's blocking machine (passes/verify/
machine.py, Note [blocking rules]) runs the programs with the cost model as
its clock, so the simulator and the verifier share every blocking rule and
verified programs always simulate to the end. Compute (forward, backward,
optimizer step) occupies the rank's thread for the cost model's duration.
Asynchronous work runs beside it: a message moves once both its send and
its receive are posted, taking the link's time; a collective starts when
the last member posts it; host copies queue on the rank's copy stream.
`wait` holds the issuing thread until the work is done, and a blocking
instruction is its own wait. The step ends when the last rank finishes.
The compute of a ministage with tensor/context/expert parallelism runs its
collectives inside (Note [compute collectives] in hetc/ir/program.py): it
starts when the last rank of its groups reaches it and takes the slowest
one's time, which the cost model's `compute_time` gives with the TP/CP
communication included.

Note [memory samples]: the memory check's walk (`rank_levels`) gives each
rank's bytes in use while each instruction runs; the simulator knows when
the rank issued each one. A sample goes where the level changes, at the
issue time of the instruction that changes it, and one more at the rank's
end for the use after its last instruction. The curve is then a step
function whose maximum is the verifier's peak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

from hetc.passes.cost.model import CostModel
from hetc.passes.verify import Backend, plan_backend
from hetc.passes.verify.machine import Machine, Op
from hetc.passes.verify.memory import Sizes, rank_levels
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Plan
from hetc.ir.program import (COLLECTIVE_OF, COLLECTIVE_TYPES, PHASE_OF, AllGather, AllReduce, AllToAll, ComputeInstr,
                          Free, Instr, Load, Offload, Prefetch, Program, ReduceScatter, Send, Shard, Step, Tensor)
from hetc.ir.spec import DTYPE_BYTES
from hetc.ir.timeline import Event, Flow, MemorySample, RankInfo, Timeline, class_times, classify

__all__ = ["SimulationError", "simulate", "timed_machine"]

class SimulationError(RuntimeError):
    """The programs cannot be run to the end (they should have failed verification)."""


class _Costs:
    """The cost model as the blocking machine's `Clock` (Note [timeline model])."""

    def __init__(self, program: Program, costs: CostModel):
        self.costs = costs
        self.delta = DTYPE_BYTES[costs.model.dtype]
        self.members = {g.name: g.ranks for g in program.groups}
        self.shards = {rp.rank: {s.ms: s for s in rp.shards} for rp in program.ranks}

    # ------------------------------------------------------------ Clock

    def local(self, rank: int, instr: Instr) -> float:
        if isinstance(instr, Step):
            return self.costs.optimizer_time(rank, self._opt_numel(rank, instr.ms))
        if isinstance(instr, (Load, Free)):
            return 0.0
        op = cast(ComputeInstr, instr)
        return self.costs.op_time(rank, op.ms, PHASE_OF[type(op)], op.unit)

    def copy(self, rank: int, instr: Instr) -> float:
        return self.costs.copy_time(rank, self._copy_bytes(rank, instr))

    def p2p(self, send: Op, recv: Op) -> float:
        return self.costs.message_time(send.rank, recv.rank, self.message_bytes(send))

    def collective(self, ops: list[Op]) -> float:
        op = ops[0]
        assert isinstance(op.instr, COLLECTIVE_TYPES)
        members = self.members[op.instr.group]
        return self.costs.collective_time(COLLECTIVE_OF[type(op.instr)], members,
                                          self._collective_bytes(op.rank, op.instr), self._streams(ops))

    def _streams(self, ops: list[Op]) -> int:
        """Note [node links] in passes/cost/links.py: a ZeRO collective runs at once with the stage's alike
        groups' (each tp/cp position reduces or gathers over its own group), so they share their node's link
        (`CostModel.groups_at_once`)."""
        instr = ops[0].instr
        if not isinstance(instr, (AllGather, ReduceScatter, AllReduce)) or instr.what not in (Tensor.GRADS,
                                                                                           Tensor.PARAMS):
            return 1
        members = self.members[instr.group]
        return max(self.costs.groups_at_once(o.rank, members) for o in ops)

    # ------------------------------------------------------------ sizes

    def message_bytes(self, send: Op) -> float:
        assert isinstance(send.instr, Send)
        return math.prod(send.instr.shape) * self.delta

    def _opt_numel(self, rank: int, ms: int) -> float:
        shard = self.shards[rank][ms]
        return sum(self._part_share(rank, shard, part) * self.costs.numel(ms, rank) / self._opt_parts(part)
                   for part in (shard, shard.experts) if part is not None)

    def _opt_parts(self, part: Shard) -> int:
        if part.group is None or part.level == 0:
            return 1
        parts = len(self.members[part.group])
        if part.outer is not None and part.outer_level == 1:
            parts *= len(self.members[part.outer])
        return parts

    def _part_share(self, rank: int, shard: Shard, part: Shard) -> float:
        """The share of a ministage's parameters in buffer `part` (its expert or dense ones, or all)."""
        if shard.experts is None:
            return 1.0
        experts = self.costs.expert_fraction(shard.ms, rank)
        return experts if part is not shard else 1.0 - experts

    def _collective_bytes(self, rank: int, instr: AllGather | ReduceScatter | AllReduce | AllToAll) -> float:
        if isinstance(instr, AllReduce) and instr.what in (Tensor.LOSS, Tensor.NORM):
            return 8.0
        if isinstance(instr, AllReduce) and instr.what is Tensor.TIED:
            return self.costs.tied_bytes
        if isinstance(instr, AllToAll):
            return self.costs.boundary_bytes(instr.ms)
        ms = instr.ms
        assert ms is not None   # a gradient or parameter collective names its ministage
        whole = self.shards[rank][ms]
        shard = whole.part(instr.group)
        full = self.costs.param_bytes(ms, rank) * self._part_share(rank, whole, shard) if instr.unit is None \
            else self.costs.unit_param_bytes(instr.unit, rank)
        if instr.group == shard.outer:
            assert shard.group is not None   # an outer group is one across shard groups
            full /= len(self.members[shard.group])
        return self.costs.states.collective(COLLECTIVE_OF[type(instr)], full)   # a reduction moves gradients

    def _copy_bytes(self, rank: int, instr: Instr) -> float:
        assert isinstance(instr, (Offload, Prefetch))   # the machine times only copies on the copy stream
        if instr.what is Tensor.ACT:
            return self.costs.boundary_bytes(instr.ms)
        if isinstance(instr, Offload) and instr.host_current:
            return 0.0        # released, not copied (Note [clean parameter offload] in passes/lower/offload.py)
        shard = self.shards[rank][instr.ms]
        full = self.costs.param_bytes(instr.ms, rank)
        return full / len(self.members[shard.group]) if shard.level == 3 and shard.group else full


def timed_machine(program: Program, costs: CostModel, backend: Backend | None = None) -> Machine:
    """The programs' blocking machine timed by the cost model, not yet run: `verify(..., machine=)` runs it and
    `simulate(..., ran=)` reads its times (Note [one run] in passes/verify/protocol.py). It runs the blocking
    rule of the backend the plan's ranks use (`plan_backend`: NCCL's order on GPUs), as `verify` proves, or
    of `backend` (what another backend's rule would make of the same programs)."""
    return Machine(program, _Costs(program, costs), record=True,
                   backend=backend or plan_backend(costs.pipeline))


def _finished(machine: Machine) -> Machine:
    problem = machine.problem
    if problem is not None:
        raise SimulationError(f"rank {problem.rank}, instruction {problem.index}: {problem.message} "
                              "(unverified programs?)")
    stuck = machine.unfinished()
    if stuck:
        raise SimulationError(f"ranks {stuck[:4]} cannot finish the step (unverified programs?)")
    return machine


def _events(machine: Machine) -> list[Event]:
    out = []
    texts: dict[Instr, str] = {}    # lanes and microbatches repeat instructions: each is formatted once
    for op in machine.ran:
        instr = machine.program.ranks[op.rank].instrs[op.index]
        kind, stream = classify(instr)
        assert op.end is not None   # it ran
        text = texts.get(instr)
        if text is None:
            text = texts[instr] = str(instr)
        out.append(Event(op.rank, op.index, text, kind, stream, op.start, op.end))
    return sorted(out, key=lambda e: (e.rank, e.start, e.index))


def _memory_samples(machine: Machine, pipeline: Pipeline, sizes: Sizes) -> list[MemorySample]:
    """Each rank's memory curve, one sample per change (Note [memory samples])."""
    samples = []
    levels = rank_levels(machine.program, pipeline, sizes)
    for rp, rank_level in zip(machine.program.ranks, levels, strict=True):
        state = machine.ranks[rp.rank]
        times = [*state.issued, state.t]
        last = None
        for time, level in zip(times, rank_level, strict=True):
            if level != last:
                samples.append(MemorySample(rp.rank, time, level))
                last = level
    return samples


def simulate(program: Program, plan: Plan, costs: CostModel,
             plan_facts: Iterable[tuple[str, str]] = (), ran: Machine | None = None) -> Timeline:
    """The predicted Timeline of one step (source "predicted"), with each rank's memory curve.

    `ran`: `timed_machine(program, costs)`, which `verify` or the planner may have run already (Note [one run]);
    by default the programs are run here."""
    if ran is None:
        ran = timed_machine(program, costs)
    ran.run()   # a machine runs once: run already, it only says what its run met
    machine = _finished(ran)
    clock = cast(_Costs, machine.clock)
    flows = tuple(Flow(send.rank, send.index, recv.rank, recv.index, clock.message_bytes(send))
                  for send, recv in machine.messages)
    infos = []
    for rp in program.ranks:
        gpu = plan.pipeline.world[rp.rank]
        infos.append(RankInfo(rp.rank, rp.stage, rp.lane, gpu.device.name, str(gpu), gpu.device.memory))
    classes = tuple({c.value: s for c, s in class_times(rp.instrs, machine.ranks[rp.rank].issued,
                                                         machine.ranks[rp.rank].t).items()}
                    for rp in program.ranks)
    return Timeline("predicted", tuple(infos), tuple(_events(machine)), flows,
                    tuple(_memory_samples(machine, plan.pipeline, costs)), machine.end_time(), tuple(plan_facts),
                    classes)
