"""The first lowering pass: each rank's compute order, per schedule kind.

Note [schedules by simulation]: every lane gets a *policy* that names its
next compute op (strict sequences for GPipe and Zorse; at most `limit`
microbatches in flight for 1F1B, interleaved 1F1B and ZB-H1, each with its
`lane_sim.Order` of preference among forwards and backwards).
A small discrete-event simulation runs all lanes together with the cost
model's durations and border transfers (Note [timed schedule]) and records
the order in which each lane ran its ops. Because the orders come out of
one feasible execution, they are consistent across ranks by construction —
with uneven lanes and many-to-many routing as much as in a plain grid —
and the later passes only add communication around them. Durations only
choose among valid orders, and they are the cost model's numbers, so the
result is deterministic. The engine is in `lane_sim.py` (with Note
[coupled lanes] and Note [lifting a limit]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import StrEnum
from typing import NamedTuple, TypeVar

from hetc.ir.errors import Diagnostic, InternalError, SpecError
from hetc.passes.cost.memory import interleaved_warmup
from hetc.passes.cost.pipeline_stage import lane_groups
from hetc.passes.cost.schedule import Grouping
from hetc.passes.lower.context import LowerContext, rank_shell
from hetc.passes.lower.lane_sim import Op, Order, Policy, Run, simulate
from hetc.ir.pipeline import Lane, Pipeline, Stage
from hetc.ir.program import Backward, BackwardInput, BackwardWeight, ComputeInstr, Forward, Instr, Load, Phase, Program
from hetc.ir.spec import ModelSpec, ScheduleKind

__all__ = ["Lockstep", "LockstepReason", "Op", "lane_queues", "lockstep_cause", "lockstep_groups", "order_compute",
           "queue_shape", "timed_schedule"]


def order_compute(ctx: LowerContext) -> Program:
    """Pass `schedule`: a Program holding only loads and compute, in run order.

    Interleaved 1F1B follows Megatron's strict order (a forward whenever
    the in-flight limit allows, else a backward), which does not depend on
    how long ops take; 1F1B and ZB-H1 run, in that order of preference, what
    is ready (Note [1F1B by readiness]); only where many-to-many routing
    makes an order wait on itself does the pass fall back to "a backward
    whenever one is ready" (Note [schedules by simulation]). The timed run
    is `ctx.schedule`, made once.

    Note [1F1B by readiness]: Megatron's strict 1F1B waits for a forward's
    input whenever the in-flight limit allows a forward, though a backward
    may be ready. On lanes fed unevenly (a stage of 3 lanes feeding 4, then
    1: Zorse's heterogeneous pipelines) inputs come late and each wait
    holds up the gradients behind it: specs/zorse/a_auto.het's 65B model
    over H100 and A100 lanes as 1F1B simulated 231 s a step where the
    closed form, which counts no such wait, gives 114 s, and the same plan
    as ZB-H1 117 s. Preferring the forward, but running a ready backward
    while its input is late, it runs 118 s (tests/test_plan_agreement.py
    holds every 1F1B plan of the random family to the closed form). Where
    inputs come on time the order is Megatron's.
    """
    orders = ctx.schedule.orders
    programs = []
    instrs: dict[tuple[int, int], tuple[Instr, ...]] = {}   # a lane's ranks run the same ops: made once
    for place in ctx.geometry.places:
        key = (place.stage.index, place.lane.index)
        if key not in instrs:
            instrs[key] = _with_loads(ctx, orders[key])
        programs.append(dataclasses.replace(rank_shell(place), instrs=instrs[key]))
    return Program(tuple(programs), ctx.geometry.groups)


def timed_schedule(ctx: LowerContext) -> Run:
    """The timed run of every lane that pass `schedule` takes its orders from (`LowerContext.schedule` keeps
    it)."""
    try:
        return _run(ctx, strict=True)
    except InternalError:
        pass
    try:
        return _run(ctx, strict=False)
    except InternalError:
        groups = lockstep_groups(ctx.pipeline, ctx.model)
        if not groups:
            raise
        raise SpecError([_unorderable(ctx, group) for group in groups]) from None


def _unorderable(ctx: LowerContext, group: Lockstep) -> Diagnostic:
    """Lanes in lockstep (Note [coupled lanes]) whose ops no order runs: each waits for a sibling's input
    that the stage they feed sends only after the first lane's next op (a stage of several lanes under
    ZeRO-2 or 3 feeding a stage of fewer through chunks of layers that loop back to it)."""
    stage, schedule = group.stage, ctx.pipeline.schedule.value
    fix = ("use the zorse schedule, ZeRO ≤ 1, or contiguous layers per stage" if group.reason is LockstepReason.ZERO
           else "give the stages contiguous layers, or ep = 1")
    return Diagnostic(ctx.parallel.resolved_stages[stage.index].span,
                      f"the lanes of stage '{stage.name}' run their ops in lockstep "
                      f"({lockstep_cause(group.stage, group.reason, ctx.pipeline.schedule)}), and no order of "
                      f"them exists under {schedule} with the stages they feed and are fed by: each would wait "
                      f"for an input that another stage sends only after a sibling lane's next op; {fix}")


def _run(ctx: LowerContext, strict: bool) -> Run:
    kind = ctx.pipeline.schedule
    lanes = [(stage, lane) for stage in ctx.pipeline.stages for lane in stage.lanes]
    policies = {(s.index, lane.index): _policy(ctx, s, lane) for s, lane in lanes}
    for policy in policies.values():
        policy.order = _lane_order(kind, strict)
    split = kind is ScheduleKind.ZB
    return simulate(policies, _memo(lambda op: _deps(ctx, op, split)), _memo(lambda op: _duration(ctx, op)),
                    _coupled_lanes(ctx, policies), lift_limits=not strict, lag=lambda dep, op: _lag(ctx, dep, op))


def _lane_order(kind: ScheduleKind, strict: bool) -> Order:
    """How a lane picks its next op (Note [schedules by simulation]). ZB-H1 keeps its preferences without
    waiting for a forward whose input is late: a weight gradient it holds fills the wait (Note [timed
    schedule]); 1F1B does too, a backward filling it (Note [1F1B by readiness]); interleaved 1F1B follows
    Megatron's strict order, its warm-up counted as Megatron's; the fallback takes a backward whenever one
    is ready."""
    if kind is ScheduleKind.ZB or (strict and kind is ScheduleKind.ONE_F_ONE_B):
        return Order.READY_FORWARD
    return Order.STRICT if strict and kind is ScheduleKind.INTERLEAVED else Order.READY_BACKWARD


_T = TypeVar("_T")


def _memo(fn: Callable[[Op], _T]) -> Callable[[Op], _T]:
    """`fn` remembered per op: the simulation asks for an op's dependencies and duration many times (the
    lanes of a lockstep group look at each other's next ops); callers never change what it returns."""
    seen: dict[Op, _T] = {}

    def remembered(op: Op) -> _T:
        got = seen.get(op)
        if got is None:
            got = seen[op] = fn(op)
        return got
    return remembered


def lane_queues(pipeline: Pipeline, stage: Stage, lane: Lane, grouping: Grouping = Grouping.DEPTH_FIRST
                ) -> tuple[list[Op], list[Op], list[Op]]:
    """The forward, backward and weight-gradient queues `lane` of `stage` runs under the pipeline's schedule
    (under interleaved 1F1B, in groups cut by `grouping`)."""
    kind = pipeline.schedule
    own = list(stage.ministages)
    mbs = list(lane.microbatches)
    if kind is ScheduleKind.ZORSE:
        return [("F", ms, mb) for ms in own for mb in mbs], [("B", ms, mb) for ms in reversed(own) for mb in mbs], []
    if kind is ScheduleKind.INTERLEAVED:
        f, b = _interleaved_orders(own, lane_groups(pipeline, lane, grouping))
        return f, b, []
    bkind = "I" if kind is ScheduleKind.ZB else "B"
    f = [("F", ms, mb) for mb in mbs for ms in own]
    b = [(bkind, ms, mb) for mb in mbs for ms in reversed(own)]
    w = [("W", ms, mb) for _, ms, mb in b] if kind is ScheduleKind.ZB else []
    return f, b, w


def _policy(ctx: LowerContext, stage: Stage, lane: Lane) -> Policy:
    """The lane's queues with the schedule's in-flight limit."""
    kind, num_stages = ctx.pipeline.schedule, len(ctx.pipeline.stages)
    if kind is ScheduleKind.INTERLEAVED:   # its groups cut once, for the queues and the warm-up
        groups = lane_groups(ctx.pipeline, lane, ctx.costs.interleaved_grouping)
        f, b = _interleaved_orders(list(stage.ministages), groups)
        return Policy(f, b, limit=interleaved_warmup(stage.index, num_stages, len(stage.ministages),
                                                     max(map(len, groups)), ctx.pipeline.chunks_after(stage.index)))
    f, b, w = lane_queues(ctx.pipeline, stage, lane, ctx.costs.interleaved_grouping)
    if kind in (ScheduleKind.ZORSE, ScheduleKind.GPIPE):
        return Policy(f, b)
    return Policy(f, b, w, limit=ctx.in_flight_limit(stage.index), per_unit=len(stage.ministages))


def _interleaved_orders(own: list[int], groups: list[list[int]]) -> tuple[list[Op], list[Op]]:
    """Megatron's interleaved order: the lane's microbatches in `groups` (`lane_groups`), chunk by chunk.

    Note [interleaved groups]: a microbatch's group is its position in its
    lane of the *first* stage, divided by `group` (p, or the equal groups
    of `schedule.group_width` in passes/cost where p leaves a remainder),
    whichever stage asks.
    With lane-aligned plans that is Megatron's grouping of every lane's own
    microbatches; with many-to-many routing it gives all lanes one order of
    (group, ministage, microbatch), so no lane waits for a forward its
    upstream lane has queued behind one that waits for it. A lane's share
    of a group (`lane_group`: p where lanes line up, 16 on a lane of a
    stage of 2 behind 8 lanes, 3 on a lane of 2 behind one lane) is what its
    warm-up counts. Groups cut per lane at its share instead fall out of step
    across stages where the shares do not divide evenly (random job 27).
    Megatron's p is what a group needs where every stage takes one chunk-step
    per microbatch: the first microbatch of a group comes back for its next
    chunk as the lane finishes the group's p. Where slow borders or slow
    stages lie on the chunks' loop, a group of p chunk-steps at the busiest
    lane's pace (p·T*/(n₀·v)) ends before the loop (one chunk of every other
    stage and every border, forward or backward) brings its first
    microbatch back, and every group waits for the rest of the loop: random
    job 81, whose single-lane stages fan out to lockstep stages of 2 lanes
    over two cross-region borders, ran 1.462 s against its estimate's
    1.214 s. Then the plan runs breadth-first (`Grouping.BREADTH_FIRST`,
    `schedule.interleaved_grouping` in passes/cost): one group of every
    microbatch, so the loop is waited for once per chunk (job 81: 1.244 s).
    Groups of 8 to 14 of its 16 microbatches ran 1.38-1.46 s: each group
    still pays it. Breadth-first stashes a whole chunk of every microbatch,
    so a plan where that does not fit keeps Megatron's groups, and so does
    one whose groups cover the loop: wider groups put a chunk's gradient ops
    back to back, each waiting for the ZeRO-2 reduce-scatter before it
    (random job 39: 7 % slower at twice p). Validation reads the groups of
    p (`validate_plan`): lanes in lockstep with one queue shape there serve
    as many microbatches, so they share it breadth-first too.

    Note [interleaved warm-up]: Megatron's strict order keeps a lane
    2(p−s−1) + (v−1)·g + 1 chunk-steps ahead (`memory.interleaved_warmup`,
    g the lane's group): (v−1)·g to reach its last chunk of the first group,
    2(p−s−1) for the round trip through the stages ahead. Megatron has g = p.
    With Megatron's p where g > p the lane cannot reach its last chunk of the
    first group before it needs that chunk's backward; a lane of a wide stage
    fed by a narrow one (g < p) takes the round trip g/p times: further ahead
    of its group than its upstream lane runs, it waits for a forward that
    lane holds behind a backward it waits for. Either way the strict order
    was stuck and lifting limits (Note [lifting a limit]) stashed more and
    ran longer (specs/zorse/a_auto.het: 188.8 s and 8 GiB of activations on
    an H100 against 173.4 s and 8.5 GiB now; random job 81). The timed
    in-flight limit of 1F1B (Note [in-flight limit]) is not added: a lane
    kept further ahead than the stages after it allow waits for them in the
    same way (random job 39: 5.76 s against 5.31 s without).
    """
    f, b = [], []
    for chunk_mbs in groups:
        f += [("F", ms, mb) for ms in own for mb in chunk_mbs]
        b += [("B", ms, mb) for ms in reversed(own) for mb in chunk_mbs]
    return f, b


def _coupled_lanes(ctx: LowerContext, policies: dict[tuple[int, int], Policy]) -> list[tuple[tuple[int, int], ...]]:
    """The groups of lanes that move in lockstep (Note [coupled lanes]), as (stage, lane) keys.

    Lanes in lockstep must queue the same ops (kind and ministage) in the
    same order; validation has refused plans where they do not
    (`hetc.passes.validate_plan`), so here that is an invariant.
    """
    out = []
    for group in lockstep_groups(ctx.pipeline, ctx.model):
        keys = tuple((group.stage.index, lane.index) for lane in group.lanes)
        if len({queue_shape((policies[key].f_order, policies[key].b_order, policies[key].w_order))
                for key in keys}) > 1:
            raise InternalError(f"lanes {keys} move in lockstep but queue different ops")
        out.append(keys)
    return out


class Lockstep(NamedTuple):
    """Lanes of one stage that issue collectives together around every compute op, and why."""

    stage: Stage
    lanes: tuple[Lane, ...]
    reason: LockstepReason


class LockstepReason(StrEnum):
    ZERO = "zero"      # ZeRO-2/3 under a per-microbatch schedule: gradients reduced (and params gathered) per op
    EXPERTS = "ep"     # an expert-parallel group: all-to-alls inside every MoE block


def lockstep_cause(stage: Stage, reason: LockstepReason, schedule: ScheduleKind) -> str:
    """Why a stage's lanes run in lockstep, as the errors about them say it."""
    if reason is LockstepReason.ZERO:
        return f"ZeRO-{stage.zero.resolved_level} under {schedule.value} reduces every microbatch"
    return "their expert-parallel all-to-alls run together"


def lockstep_groups(pipeline: Pipeline, model: ModelSpec) -> list[Lockstep]:
    """Every group of lanes that must run the same ops in the same order (Note [coupled lanes])."""
    out = []
    for stage in pipeline.stages:
        if pipeline.schedule is not ScheduleKind.ZORSE and len(stage.lanes) > 1 and stage.zero.resolved_level >= 2:
            out.append(Lockstep(stage, stage.lanes, LockstepReason.ZERO))
        elif stage.ep > 1 and _has_moe_block(pipeline, model, stage):
            out += [Lockstep(stage, stage.lanes[i:i + stage.ep], LockstepReason.EXPERTS)
                    for i in range(0, len(stage.lanes), stage.ep)]
    return out


def _has_moe_block(pipeline: Pipeline, model: ModelSpec, stage: Stage) -> bool:
    return model.moe is not None and any(1 <= layer <= model.layers for ms in stage.ministages
                                         for layer in pipeline.ministages[ms].layers)


def queue_shape(queues: tuple[list[Op], list[Op], list[Op]]) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The (kind, ministage) sequence of each of a lane's queues: what lanes in lockstep must share."""
    return tuple(tuple((kind, ms) for kind, ms, _ in queue) for queue in queues)


def _deps(ctx: LowerContext, op: Op, split_backward: bool) -> list[Op]:
    kind, ms, mb = op
    if kind == "F":
        return [] if ctx.starts_model(ms) else [("F", ms - 1, mb)]
    if kind == "W":
        return [("I", ms, mb)]
    return [("F", ms, mb)] + ([] if ctx.ends_model(ms) else [("I" if split_backward else "B", ms + 1, mb)])


def _duration(ctx: LowerContext, op: Op) -> float:
    """The op's time on its lane: the cost model's, for its slowest rank (a lane's ranks compute together).

    Note [timed schedule]: where the order depends on what is ready (ZB-H1's
    weight gradients filling the wait for an input gradient, lanes in
    lockstep following the first one ready, the fallback order), nominal
    durations choose an order for an execution that does not happen: with
    uneven lanes of different device kinds a lane ran the input gradient it
    expected first and idled, while a weight gradient it had could have
    filled the wait. The same times as the simulated program (and the
    border transfers, `_lag`) choose the order the program will meet.
    """
    kind, ms, mb = op
    lane = ctx.lane_for(ms, mb)
    phase = Phase(kind)   # a compute op's kind is its phase's letter
    return max(ctx.costs.op_time(r, ms, phase) for r in lane.ranks)


def _lag(ctx: LowerContext, dep: Op, op: Op) -> float:
    """The border transfer between a dependency on another stage and its consumer (Note [timed schedule])."""
    if dep[0] == "K" or ctx.pipeline.ministages[dep[1]].stage == ctx.pipeline.ministages[op[1]].stage:
        return 0.0
    src, dst = ctx.lane_for(dep[1], dep[2]), ctx.lane_for(op[1], op[2])
    border = min(dep[1], op[1])
    # each rank of the lane sends its share at once (Note [scatter-gather borders] in hetc/ir/layout.py)
    share = ctx.costs.boundary_bytes(border) / len(src.ranks)
    return ctx.costs.message_time(src.ranks[0], dst.ranks[0], share)


_COMPUTE: dict[str, type[ComputeInstr]] = {"F": Forward, "B": Backward, "I": BackwardInput, "W": BackwardWeight}


def _with_loads(ctx: LowerContext, ops: list[Op]) -> tuple[Instr, ...]:
    """A lane's compute ops, with a `load` before the first use of each microbatch's data."""
    instrs: list[Instr] = []
    loaded = set()
    for kind, ms, mb in ops:
        needs_data = kind == "F" and (ctx.starts_model(ms) or ctx.ends_model(ms))
        if needs_data and mb not in loaded:
            instrs.append(Load(mb))
            loaded.add(mb)
        instrs.append(_COMPUTE[kind](ms, mb))
    return tuple(instrs)
