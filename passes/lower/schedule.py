"""The first lowering pass: each rank's compute order, per schedule kind.

Note [schedules by simulation]: every lane gets a *policy* that names its
next compute op (strict sequences for GPipe and Zorse; "backward first, at
most `limit` microbatches in flight" for 1F1B, interleaved 1F1B and ZB-H1).
A small discrete-event simulation runs all lanes together with nominal
durations (forward = layers, backward = 2 × layers) and records the order
in which each lane ran its ops. Because the orders come out of one
feasible execution, they are consistent across ranks by construction —
with uneven lanes and many-to-many routing as much as in a plain grid —
and the later passes only add communication around them. Durations only
choose among valid orders, so the result is deterministic. The engine is
in `lane_sim.py` (with Note [coupled lanes] and Note [lifting a limit]).
"""

from __future__ import annotations

import itertools

from hetc.errors import InternalError
from hetc.passes.lower.context import LowerContext, rank_shell
from hetc.passes.lower.lane_sim import Op, Policy, simulate
from hetc.passes.lower.zero import lane_pattern_error
from hetc.pipeline import Lane, Stage
from hetc.program import Backward, BackwardInput, BackwardWeight, ComputeInstr, Forward, Instr, Load, Program
from hetc.spec import ScheduleKind

__all__ = ["Op", "order_compute"]


def order_compute(ctx: LowerContext) -> Program:
    """Pass `schedule`: a Program holding only loads and compute, in run order.

    1F1B and interleaved 1F1B follow Megatron's strict order (a forward
    whenever the in-flight limit allows, else a backward), which does not
    depend on how long ops take; only where many-to-many routing makes that
    order wait on itself does the pass fall back to "a backward whenever
    one is ready" (Note [schedules by simulation]).
    """
    try:
        return _order(ctx, strict=True)
    except InternalError:
        return _order(ctx, strict=False)


def _order(ctx: LowerContext, strict: bool) -> Program:
    kind = ctx.pipeline.schedule
    lanes = [(stage, lane) for stage in ctx.pipeline.stages for lane in stage.lanes]
    policies = {(s.index, lane.index): _policy(ctx, kind, s, lane) for s, lane in lanes}
    for policy in policies.values():
        policy.forward_first = strict and kind in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED,
                                                   ScheduleKind.ZB)
    split = kind is ScheduleKind.ZB
    orders = simulate(policies, lambda op: _deps(ctx, op, split), lambda op: _duration(ctx, op),
                      _coupled_stages(ctx, policies), lift_limits=not strict)
    programs = []
    for place in ctx.places:
        ops = orders[(place.stage.index, place.lane.index)]
        programs.append(_with_loads(ctx, rank_shell(place), ops))
    return Program(tuple(programs), ctx.groups)


def _policy(ctx: LowerContext, kind: ScheduleKind, stage: Stage, lane: Lane) -> Policy:
    own = list(stage.ministages)
    mbs = list(lane.microbatches)
    bkind = "I" if kind is ScheduleKind.ZB else "B"
    num_stages = len(ctx.pipeline.stages)
    downstream = num_stages - stage.index
    if kind is ScheduleKind.ZORSE:
        f = [("F", ms, mb) for ms in own for mb in mbs]
        b = [("B", ms, mb) for ms in reversed(own) for mb in mbs]
        return Policy(f, b)
    if kind is ScheduleKind.INTERLEAVED:
        f, b = _interleaved_orders(ctx, own, mbs, num_stages)
        v = len(own)
        limit = (downstream - 1) * 2 + (v - 1) * num_stages + 1
        return Policy(f, b, limit=limit)
    f = [("F", ms, mb) for mb in mbs for ms in own]
    b = [(bkind, ms, mb) for mb in mbs for ms in reversed(own)]
    if kind is ScheduleKind.GPIPE:
        return Policy(f, b)
    w = [("W", ms, mb) for _, ms, mb in b] if kind is ScheduleKind.ZB else []
    return Policy(f, b, w, limit=ctx.in_flight_limit(stage.index), per_unit=len(own))


def _interleaved_orders(ctx: LowerContext, own: list[int], mbs: list[int], group: int
                        ) -> tuple[list[Op], list[Op]]:
    """Megatron's interleaved order: microbatches in groups of `group`, chunk by chunk.

    Note [interleaved groups]: a microbatch's group is its position in its
    lane of the *first* stage, divided by `group`, whichever stage asks. With
    lane-aligned plans that is Megatron's grouping of every lane's own
    microbatches; with many-to-many routing it gives all lanes one order of
    (group, ministage, microbatch), so no lane waits for a forward its
    upstream lane has queued behind one that waits for it.
    """
    first = {mb: i for lane in ctx.pipeline.stages[0].lanes for i, mb in enumerate(lane.microbatches)}
    f, b = [], []
    for _, chunk in itertools.groupby(sorted(mbs, key=lambda mb: (first[mb] // group, mb)),
                                      key=lambda mb: first[mb] // group):
        chunk_mbs = list(chunk)
        f += [("F", ms, mb) for ms in own for mb in chunk_mbs]
        b += [("B", ms, mb) for ms in reversed(own) for mb in chunk_mbs]
    return f, b


def _coupled_stages(ctx: LowerContext, policies: dict) -> dict[int, int]:
    """Stages whose lanes run a collective around every compute op (Note [coupled lanes]): stage -> lanes.

    Lanes in lockstep must queue the same ops (kind and ministage) in the
    same order; where their microbatches make the queues differ, a located
    error.
    """
    if ctx.pipeline.schedule is ScheduleKind.ZORSE:
        return {}
    coupled = [s for s in ctx.pipeline.stages if len(s.lanes) > 1 and s.zero.resolved_level >= 2]
    for stage in coupled:
        shapes = {_queue_shape(policies[(stage.index, lane.index)]) for lane in stage.lanes}
        if len(shapes) > 1:
            raise lane_pattern_error(ctx, stage)
    return {s.index: len(s.lanes) for s in coupled}


def _queue_shape(policy: Policy) -> tuple:
    return tuple(tuple((kind, ms) for kind, ms, _ in queue) for queue in (policy.f_order, policy.b_order,
                                                                           policy.w_order))


def _deps(ctx: LowerContext, op: Op, split_backward: bool) -> list[Op]:
    kind, ms, mb = op
    bkind = "I" if split_backward else "B"
    if kind == "F":
        return [] if ctx.starts_model(ms) else [("F", ms - 1, mb)]
    if kind == "W":
        return [("I", ms, mb)]
    deps = [("F", ms, mb)]
    if not ctx.ends_model(ms):
        deps.append((bkind, ms + 1, mb))
    return deps


def _duration(ctx: LowerContext, op: Op) -> float:
    m = ctx.pipeline.ministages[op[1]]
    layers = m.stop_layer - m.first_layer
    return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[op[0]] * layers


_COMPUTE: dict[str, type[ComputeInstr]] = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}


def _with_loads(ctx: LowerContext, shell, ops: list[Op]):
    """The rank's compute ops, with a `load` before the first use of each microbatch's data."""
    instrs: list[Instr] = []
    loaded = set()
    for kind, ms, mb in ops:
        needs_data = kind == "F" and (ctx.starts_model(ms) or ctx.ends_model(ms))
        if needs_data and mb not in loaded:
            instrs.append(Load(mb))
            loaded.add(mb)
        instrs.append(_COMPUTE[kind](ms, mb))
    return type(shell)(shell.rank, shell.stage, shell.lane, shell.tp_rank, shell.cp_rank, shell.shards,
                       tuple(instrs))
