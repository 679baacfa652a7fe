"""The verifier: prove a compiled program safe before anything runs.

`verify` runs four independent checks and reports the first failing one's
findings with a steps × ranks grid of the ranks involved:

- `protocol`: all ranks together under the runtime's blocking rules — sends
  meet receives with the same shape, collectives are entered in the same
  order by every member, no rank blocks forever, every handle is waited;
- `dataflow`: each rank uses only what it has, every microbatch passes every
  ministage forward and backward exactly once, every step follows all
  gradient contributions to its shard;
- `transfers`: every send and receive moves the tensor the plan gives that
  transfer (peer, shape, tokens), so a plan.het edited since compile cannot
  crash the job after launch (Note [transfers against the plan]);
- `memory` (when sizes are given): each rank's memory timeline stays within
  its device.
"""

from __future__ import annotations

from collections.abc import Callable

from hetc.passes.lower.forward_only import forward_only
from hetc.passes.verify.dataflow import check_dataflow
from hetc.passes.verify.errors import Finding, VerifyError, at
from hetc.passes.verify.machine import Backend, Machine
from hetc.passes.verify.memory import Sizes, check_memory
from hetc.passes.verify.protocol import check_protocol
from hetc.passes.verify.transfers import check_transfers
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Plan
from hetc.ir.program import Program, RankProgram, Recv, Send
from hetc.ir.grid import render_grid

__all__ = ["Backend", "Finding", "Sizes", "VerifyError", "plan_backend", "shape_problem", "verified_evaluation",
           "verify"]


def plan_backend(pipeline: Pipeline) -> Backend:
    """The backend the plan's ranks run: NCCL where any rank has a GPU (the runtime's rule in
    runtime/worker.py: nccl on CUDA devices, gloo on CPU), so its programs are proven under NCCL's order."""
    return Backend.NCCL if any(not gpu.device.is_cpu for gpu in pipeline.world) else Backend.GLOO


def verify(program: Program, plan: Plan, sizes: Sizes | None = None,
           forward_only: bool = False, machine: Machine | None = None, backend: Backend | None = None) -> None:
    """Raise VerifyError naming rank and instruction if the programs are unsafe.

    `sizes` (a `CostModel`) turns on the memory check; `VerifyError.check`
    says which check failed ("memory" is a plan that does not fit, not a
    lowering bug). `forward_only` checks an evaluation program
    (passes/lower/forward_only.py) for completeness forward only.
    `machine`: the blocking machine the protocol check runs (a timed one the
    simulator reads after, Note [one run] in protocol.py); by default an untimed one.
    `backend`: whose blocking rule the protocol check proves the programs under (Note [NCCL order] in
    machine.py); by default the one the plan's ranks run (`plan_backend`).
    """
    pipeline, model, train = plan.pipeline, plan.model, plan.train
    _check_shape(program, pipeline)
    backend = backend or plan_backend(pipeline)
    checks: list[tuple[str, Callable[[], list[Finding]]]] = [("dataflow", lambda: check_dataflow(program, pipeline, model.num_model_layers,
                                                  train.grad_clip > 0, model.seq, forward_only)),
              ("protocol", lambda: check_protocol(program, machine, backend)),
              ("transfers", lambda: check_transfers(program, plan))]   # Note [transfers against the plan]
    if sizes is not None:
        checks.append(("memory", lambda: check_memory(program, pipeline, sizes)))
    for name, check in checks:
        findings = check()
        if findings:
            focus: dict[int, int] = {}
            for f in findings:
                focus.setdefault(f.rank, max(f.index, 0))
            raise VerifyError(findings, render_grid(program, dict(list(focus.items())[:6])), check=name)


def verified_evaluation(program: Program, plan: Plan, backend: Backend | None = None) -> Program | None:
    """The evaluation programs of a job that evaluates (`train { eval_every }`), verified; else None.

    Note [Evaluation programs] in passes/lower/forward_only.py says why the memory check is not rerun.
    """
    if plan.train.eval_every == 0:
        return None
    evaluation = forward_only(program)
    verify(evaluation, plan, forward_only=True, backend=backend)
    return evaluation


def _check_shape(program: Program, pipeline: Pipeline) -> None:
    if program.world_size != pipeline.world_size:
        raise VerifyError([Finding(0, -1, "", f"the program has {program.world_size} ranks but the plan has "
                                   f"{pipeline.world_size}")])
    for r, rp in enumerate(program.ranks):
        problem = shape_problem(rp, r, pipeline)
        if problem:
            raise VerifyError([Finding(r, -1, "", problem)])
    outside = _ranks_outside(program)
    if outside:
        raise VerifyError(outside)


def _ranks_outside(program: Program) -> list[Finding]:
    """Peers and group members that name no rank of the program (a listing edited by hand): every later
    check indexes the plan's ranks by them."""
    world = program.world_size
    findings = [Finding(0, -1, str(g), f"group {g.name} names rank {r}, but the program has ranks 0-{world - 1}")
                for g in program.groups for r in g.ranks if not 0 <= r < world]
    for rank, rp in enumerate(program.ranks):
        for i, instr in enumerate(rp.instrs):
            peer = instr.peer_to if isinstance(instr, Send) else instr.peer_from if isinstance(instr, Recv) else 0
            if not 0 <= peer < world:
                findings.append(at(program, rank, i, f"peer rank {peer} is not a rank of the program (0-{world - 1})"))
    return findings


def shape_problem(rp: RankProgram, r: int, pipeline: Pipeline) -> str:
    """What is wrong with the header of rank r's program against the plan ('' where nothing is)."""
    place = pipeline.stage_of_rank.get(r)
    lane = pipeline.lane_of_rank.get(r)
    if rp.rank != r or place is None or lane is None or (rp.stage, rp.lane) != (place.index, lane.index):
        return (f"the header says rank {rp.rank} stage {rp.stage} lane {rp.lane}, but in the plan rank {r} is "
                f"stage {place.index if place else '?'} lane {lane.index if lane else '?'}")
    held = [shard.ms for shard in rp.shards]
    if sorted(held) != sorted(place.ministages):
        return (f"the buffer table has `shard` lines for ministages {held or 'none'}, but stage {place.index} runs "
                f"ministages {list(place.ministages)}: one line each")
    return ""
