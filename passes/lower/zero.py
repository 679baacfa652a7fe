"""Pass `zero`: ZeRO collectives, optimizer steps and gradient clipping.

Note [zero placement] — per ministage with shard group G (absent for a
single lane: nothing to reduce) and level L:

    L0  all_reduce grads after the ministage's last backward; step.
    L1  reduce_scatter grads after the last backward; step the shard;
        all_gather params after the step.
    L2  like L1, but under per-microbatch schedules (GPipe, 1F1B, interleaved,
        ZB) reduce_scatter after every microbatch's backward, as DeepSpeed
        does under gradient accumulation.
    L3  parameters stay sharded: all_gather before use and free after; under
        per-microbatch schedules around every compute op, under Zorse once per
        ministage sweep ("gather once per ministage"); gradients
        reduced like L2; no gather after the step. Under per-microbatch
        schedules each compute op runs unit by unit (Note [zero-3 units] in
        passes/cost/zero_units.py): forward in layer order, backward in
        reverse, each unit gathered one op ahead, freed after use, and its
        gradients reduce-scattered as soon as its backward is done.

Note [gradient buffer release]: under ZeRO-2 and 3 the runtime allocates
a buffer's full gradients (a ministage's, or a ZeRO-3 unit's) for its
weight-gradient op (`bwd`, `bwd_w`; runtime/buffers.py `ready_grads`) and
frees them when the wait of the reduce-scatter after that op completes
(`reduced`), keeping only the reduced shard. So that wait comes right
before the rank's second gradient op after it, or before the buffer's own
next one if that comes first: a rank holds the buffer being filled and the
one being reduced, not every buffer it filled since its first backward
(with gradient clipping every wait used to sit at the step, and
specs/zorse/a_llama65b.het would have needed 88 GiB on its 80 GiB A100s),
while each reduction still runs beside every op up to the next gradient op
but one (the forwards and input-gradient ops between them included: a ZB
lane whose one ministage reduces its whole gradients after each bwd_w waits
for it only before its next bwd_w, as before). The last two gradient ops
leave their waits to the step. The verifier follows each buffer from its
gradient op to that wait (passes/verify/memory.py), the estimate counts the
heaviest two neighbouring buffers (`memory.reduced_at_once`). Zorse without
clipping keeps its own placement: each ministage's waits and step right
after the next op.

Note [regathers of offloaded parameters]: under Zorse's interleaved update
the gather after a ministage's step is waited one compute op later where its
parameters are offloaded, not at the end of the step: the offload of a
ministage waits for every reference to its parameters (Note [parameter
residency] in passes/lower/offload.py), so a wait at the end kept every
ministage of the stage on the device through the backward, where Zorse
keeps the current one, the prefetched and those whose update overlaps it
(the estimate's `memory.resident_window`). A random planned job (an MoE model on A100-40s, four ministages
of 5.7 GiB) compiled to 56.8 GiB against the 39 GiB its estimate counted.
Parameters that stay on the device keep the wait at the end, which overlaps
the gather with the rest of the backward.

Gathers are posted one compute run ahead (prefetch) and waited right before
use; a rank's first gather at the very start of its program, ahead of the
receives its first op waits for, so a later stage gathers while the
pipeline fills (the estimate exposes the first stage's first gather alone). Per-microbatch collectives run on G.f / G.b so that each group sees its
collectives in the same order on every lane. Under Zorse without gradient
clipping each ministage steps as soon as its gradients are reduced
(interleaved optimizer update); otherwise all steps come at the end, after
the global gradient norm when clipping. Hierarchical ZeRO adds a reduction
over the outer group after the inner one (beside the backward where it can:
Note [outer reductions beside the backward]), and a gather back after the step.
A ministage holding a copy of a tied embedding (Note [tied gradients] in
hetc/ir/program.py) sums it with the other copy after those reductions, before
the norm and its step: at the end of the step, also under Zorse's
interleaved update (the sum waits for the other stage's last backward).
"""

from __future__ import annotations

import bisect
import dataclasses

from hetc.ir.errors import InternalError
from hetc.ir.groups import TIED, WORLD, Direction, GroupId, with_direction
from hetc.passes.cost.zero_units import gathers_per_block, in_run_order, ministage_units
from hetc.ir.geometry import RankPlace
from hetc.passes.lower.context import LowerContext, next_handle
from hetc.passes.lower.edits import Edits, Handles
from hetc.passes.lower.schedule import lockstep_groups
from hetc.ir.program import (COMPUTE_TYPES, AllGather, AllReduce, Backward, BackwardWeight, ComputeInstr, Forward, Free, Instr,
                          Program, RankProgram, ReduceScatter, Shard, Step, Tensor, Unit, Wait)
from hetc.ir.spec import OffloadTarget, ScheduleKind

__all__ = ["insert_zero"]


def insert_zero(program: Program, ctx: LowerContext) -> Program:
    _check_lane_patterns(program, ctx)
    return Program(tuple(_rank(rp, ctx.geometry.places[rp.rank], ctx) for rp in program.ranks), program.groups)


def _per_microbatch(ctx: LowerContext) -> bool:
    return ctx.pipeline.schedule is not ScheduleKind.ZORSE


def _shards(place: RankPlace, ctx: LowerContext) -> tuple[Shard, ...]:
    stage, zero = place.stage, place.stage.zero
    group = _name(ctx.geometry.zero_group(place))
    off = stage.offload
    per_block = group is not None and gathers_per_block(ctx.pipeline.schedule, zero, off, stage.ep)
    return tuple(
        Shard(ms, zero.resolved_level if group else 0, group, _name(ctx.geometry.outer_group(place)),
              zero.across if group else 0, off.params is not OffloadTarget.NONE,
              off.optimizer is not OffloadTarget.NONE, off.activations is not OffloadTarget.NONE,
              _name(ctx.geometry.tp_group(place)), _name(ctx.geometry.cp_group(place)), *_expert_groups(place, ms, ctx),
              units=ministage_units(ctx.model, ctx.pipeline.ministages[ms].layers, per_block))
        for ms in stage.ministages)


def _name(group: GroupId | None) -> str | None:
    """A group as the program names it (Note [group names])."""
    return None if group is None else str(group)


def _expert_groups(place: RankPlace, ms: int, ctx: LowerContext) -> tuple[str | None, str | None]:
    """(ep_group, expert_group) of a ministage: its MoE blocks' all-to-alls and its experts' replicas."""
    ep = ctx.geometry.ep_group(place, ms)
    return _name(ep), _name(ctx.geometry.expert_group(place)) if ep else None


def _split_units(instrs: tuple[Instr, ...], shards: tuple[Shard, ...]) -> tuple[Instr, ...]:
    """Each compute op of a ministage split into units becomes one op per unit: forward in layer order,
    backward in reverse (Note [units] in hetc/ir/program.py)."""
    units = {sh.ms: sh.units for sh in shards if sh.units}
    out: list[Instr] = []
    for instr in instrs:
        if not isinstance(instr, COMPUTE_TYPES) or instr.ms not in units:
            out.append(instr)
            continue
        out += [dataclasses.replace(instr, unit=u) for u in in_run_order(units[instr.ms], isinstance(instr, Forward))]
    return tuple(out)


def _rank(rp: RankProgram, place: RankPlace, ctx: LowerContext) -> RankProgram:
    shards = _shards(place, ctx)
    edits = Edits()
    handles = Handles(next_handle(rp.instrs))
    rp = dataclasses.replace(rp, instrs=_split_units(rp.instrs, shards))
    compute = [(i, instr) for i, instr in enumerate(rp.instrs) if isinstance(instr, COMPUTE_TYPES)]
    _gathers({sh.ms: sh for sh in shards if sh.group is not None}, compute, edits, handles, ctx)
    interleaved_update = _interleaved_update(ctx)
    gradient_ops = [k for k, (_, instr) in enumerate(compute) if isinstance(instr, (Backward, BackwardWeight))]
    finals = [[_reduce(part, unit, compute, gradient_ops, edits, handles, ctx) for part in _parts(shard)
               for unit in _units(part)] for shard in shards]
    gather_waits: list[Wait] = []
    if interleaved_update:
        for shard, reductions in zip(shards, finals):
            pos, _, first = reductions[0]
            posts, later = _regathers(shard, handles)
            update = _waits(reductions) + _outer_reduce(shard) + _tied_reduce(shard, ctx) + [Step(shard.ms)] + posts
            if shard.ms in ctx.geometry.tied_ministages:     # the sum waits for the other copy's backward: at the end
                edits.end += update
                gather_waits += later
                continue
            for instr in update:
                edits.add_after(pos, instr, first)
            after = next((i for i, _ in compute if i > pos), None)
            if shard.param_offload and after is not None:    # Note [regathers of offloaded parameters]
                for instr in later:
                    edits.add_after(after, instr)
            else:
                gather_waits += later
    else:
        for reductions in finals:
            edits.end += _waits(reductions)
        edits.end += _outer_reductions(shards, compute, gradient_ops, edits, handles, ctx)
        for shard in shards:
            edits.end += _tied_reduce(shard, ctx)
        if ctx.grad_clip:
            edits.end.append(AllReduce(Tensor.NORM, str(WORLD)))
        for shard in shards:
            posts, later = _regathers(shard, handles)
            edits.end += [Step(shard.ms), *posts]
            gather_waits += later
    edits.end += gather_waits
    return dataclasses.replace(rp, shards=shards, instrs=edits.apply(rp.instrs))


def _units(shard: Shard) -> tuple[Unit | None, ...]:
    """The units of a ministage's buffers (None: the ministage whole)."""
    return shard.units or (None,)


def _parts(shard: Shard) -> list[Shard]:
    """The flat buffers of a ministage: one, or its dense and its expert parameters (expert parallelism)."""
    return [shard] if shard.experts is None else [shard, shard.experts]


def _waits(reductions: list[tuple[int, list[Wait], bool]]) -> list[Wait]:
    return [w for _, waits, _ in reductions for w in waits]


def _regathers(shard: Shard, handles: Handles) -> tuple[list[Instr], list[Wait]]:
    got = [_regather(part, handles) for part in _parts(shard)]   # in order: each takes its handles
    return [i for posts, _ in got for i in posts], [w for _, waits in got for w in waits]


def _runs(compute: list[tuple[int, ComputeInstr]], per_mb: bool) -> list[tuple[int, list[int]]]:
    """The rank's compute ops grouped into runs that share one gather: (ms, op indices), in order.

    Per-microbatch schedules gather around every op (of one unit, where the
    ministage is split); Zorse around every sweep of one ministage in one
    direction.
    """
    runs: list[tuple[int, list[int]]] = []
    prev = None
    for k, (_, instr) in enumerate(compute):
        key = (instr.ms, isinstance(instr, Forward))
        if per_mb or key != prev:
            runs.append((instr.ms, [k]))
        else:
            runs[-1][1].append(k)
        prev = key
    return runs


def _gathers(shards: dict[int, Shard], compute: list[tuple[int, ComputeInstr]], edits: Edits, handles: Handles, ctx: LowerContext) -> None:
    """ZeRO-3: gather each run's parameters while the previous run computes; free them after."""
    per_mb = _per_microbatch(ctx)
    runs = _runs(compute, per_mb)
    for g, (ms, run) in enumerate(runs):
        shard = shards.get(ms)
        if shard is None or shard.level != 3 or shard.group is None:
            continue
        first, last = run[0], run[-1]
        # Zorse: a ministage's forward sweep followed by its own backward sweep keeps its gather
        continues = not per_mb and g > 0 and runs[g - 1][0] == ms
        continued = not per_mb and g + 1 < len(runs) and runs[g + 1][0] == ms
        if not continues:
            direction = Direction.FORWARD if isinstance(compute[first][1], Forward) else Direction.BACKWARD
            group = with_direction(shard.group, direction) if per_mb else shard.group
            h = handles.take()
            post_at = compute[runs[g - 1][1][0]][0] if g > 0 else 0
            unit = compute[first][1].unit
            edits.add_before(post_at, AllGather(Tensor.PARAMS, ms, group, h, unit))
            edits.add_before(compute[first][0], Wait(h))
        if not continued:
            edits.add_after(compute[last][0], Free(Tensor.PARAMS, ms, compute[last][1].unit))


def _reduce(shard: Shard, unit: Unit | None, compute: list[tuple[int, ComputeInstr]], gradient_ops: list[int],
            edits: Edits, handles: Handles, ctx: LowerContext) -> tuple[int, list[Wait], bool]:
    """Post the gradient reductions of one buffer (a unit's, or the ministage's); return (where the step
    goes, waits still due, step goes first there).

    The step waits one compute op longer, so the reduction overlaps that op;
    when that op is another ministage's last backward, the step (and the
    gather after it) goes ahead of that ministage's reduction, so every lane
    issues the group's collectives in the same order however many
    microbatches it runs (Note [zero placement]).
    """
    grad_ops = [k for k in gradient_ops if compute[k][1].ms == shard.ms and compute[k][1].unit == unit]
    last_pos = compute[min(grad_ops[-1] + 1, len(compute) - 1)][0]
    first = last_pos != compute[grad_ops[-1]][0]
    if shard.group is None:
        return last_pos, [], first
    per_mb = _per_microbatch(ctx) and shard.level >= 2
    released = shard.level >= 2 and not _interleaved_update(ctx)   # Note [gradient buffer release]
    pending: list[Wait] = []

    def wait(n: int, h: int) -> None:
        """The wait of the reduction posted after the buffer's n-th gradient op: where it frees the buffer
        (Note [gradient buffer release]), else left to the step."""
        end = _release_point(gradient_ops, grad_ops[n], grad_ops[n + 1] if n + 1 < len(grad_ops) else None)
        if end is None:
            pending.append(Wait(h))
        else:
            edits.add_before(compute[end][0], Wait(h))

    if per_mb:
        for n, k in enumerate(grad_ops):
            h = handles.take()
            edits.add_after(compute[k][0], ReduceScatter(Tensor.GRADS, shard.ms,
                                                         with_direction(shard.group, Direction.BACKWARD), h, unit))
            wait(n, h)
        return last_pos, pending, first
    h = handles.take()
    op = (AllReduce(Tensor.GRADS, shard.group, shard.ms, h) if shard.level == 0
          else ReduceScatter(Tensor.GRADS, shard.ms, shard.group, h))
    edits.add_after(compute[grad_ops[-1]][0], op)
    if released:
        wait(len(grad_ops) - 1, h)
    else:
        pending.append(Wait(h))
    return last_pos, pending, first


def _release_point(gradient_ops: list[int], k: int, own_next: int | None) -> int | None:
    """The compute op before which the reduction posted after gradient op k is waited (Note [gradient buffer
    release]): the rank's second gradient op after k (`gradient_ops`: all of them, in order), or the buffer's
    own next one (`own_next`) if sooner; None: neither comes, the step waits for it."""
    after = bisect.bisect_right(gradient_ops, k)
    ends = gradient_ops[after + 1:after + 2] + ([] if own_next is None else [own_next])
    return min(ends) if ends else None


def _interleaved_update(ctx: LowerContext) -> bool:
    """Zorse without clipping steps each ministage right after its reduction (Note [zero placement])."""
    return ctx.pipeline.schedule is ScheduleKind.ZORSE and not ctx.grad_clip


def _outer_reduce(shard: Shard) -> list[Instr]:
    """Hierarchical ZeRO's reductions across nodes, one per unit, each waited where it is posted."""
    return [_outer_op(shard, unit) for unit in _units(shard)] if shard.outer is not None else []


def _outer_op(shard: Shard, unit: Unit | None, handle: int | None = None) -> Instr:
    assert shard.outer is not None
    if shard.outer_level == 0:
        return AllReduce(Tensor.GRADS, shard.outer, shard.ms, handle, unit)
    return ReduceScatter(Tensor.GRADS, shard.ms, shard.outer, handle, unit)


# Note [outer reductions beside the backward]: hierarchical ZeRO reduces each buffer (a unit, or a ministage
# whole) across nodes once its gradients are reduced within the node. Where those reductions are released as
# the backward goes (Note [gradient buffer release]: ZeRO-2/3), the last one of a buffer completes at its wait,
# two gradient ops after the buffer's last, and the reduction across nodes is posted right there, beside the
# rest of the backward, as FSDP's HSDP posts its inter-node all-reduce as each unit's reduce-scatter finishes;
# the step waits for them all. The rest (the buffers of the last two gradient ops, ZeRO-0/1, Zorse's
# interleaved update) reduce across nodes after the last backward, one after another, each waited as it is
# posted (`zero_time.sync_time` and the step bound count them so).
# Every member of an outer group must post its collectives in one order (Note [blocking rules]): the
# buffers go in one order on every rank (ministages last to first, units last to first: the order the backward
# finishes them), each posted no sooner than the one before it, so that lanes whose schedules finish buffers
# in another order (other microbatch counts) still agree. Under NCCL the outer group's collectives run on
# their own communicator and stream (Note [NCCL order] in passes/verify/machine.py), beside the node's.


def _outer_reductions(shards: tuple[Shard, ...], compute: list[tuple[int, ComputeInstr]], gradient_ops: list[int],
                      edits: Edits, handles: Handles, ctx: LowerContext) -> list[Instr]:
    """Post each reduction across nodes where its buffer's reduction within the node completes (Note [outer
    reductions beside the backward]); return what goes after the last backward: their waits, then the
    reductions of the buffers reduced within the node only there, each waited as it is posted."""
    waits: list[Instr] = []
    after: list[Instr] = []
    at: int | None = 0                        # compute op the previous one went before (None: the end)
    for shard in sorted((sh for sh in shards if sh.outer is not None), key=lambda sh: -sh.ms):
        for unit in reversed(_units(shard)):
            ready = _reduced_within_node(shard, unit, compute, gradient_ops, ctx)
            at = None if ready is None or at is None else max(ready, at)
            if at is None:
                after.append(_outer_op(shard, unit))
                continue
            h = handles.take()
            edits.add_before(compute[at][0], _outer_op(shard, unit, h))
            waits.append(Wait(h))
    return waits + after


def _reduced_within_node(shard: Shard, unit: Unit | None, compute: list[tuple[int, ComputeInstr]],
                         gradient_ops: list[int], ctx: LowerContext) -> int | None:
    """The compute op before which the last reduction of a buffer within its shard group is waited (`_reduce`
    places it: Note [gradient buffer release]), or None where the step waits for it."""
    if shard.group is None or shard.level < 2 or _interleaved_update(ctx):
        return None
    own = [k for k in gradient_ops if compute[k][1].ms == shard.ms and compute[k][1].unit == unit]
    return _release_point(gradient_ops, own[-1], None)


def _tied_reduce(shard: Shard, ctx: LowerContext) -> list[Instr]:
    """The sum of the tied embedding's copies, where this ministage holds one: after its own reductions, before
    the gradient norm and its step (Note [tied gradients] in hetc/ir/program.py)."""
    return [AllReduce(Tensor.TIED, str(TIED), shard.ms)] if shard.ms in ctx.geometry.tied_ministages else []


def _regather(shard: Shard, handles: Handles) -> tuple[list[Instr], list[Wait]]:
    """Gathers after the step: (posts to place after the step, waits for the end of the step)."""
    posts: list[Instr] = []
    waits: list[Wait] = []
    if shard.outer is not None and shard.outer_level == 1:
        posts += [AllGather(Tensor.PARAMS, shard.ms, shard.outer, unit=u) for u in _units(shard)]
    if shard.group is not None and shard.level in (1, 2):
        h = handles.take()
        posts.append(AllGather(Tensor.PARAMS, shard.ms, shard.group, h))
        waits.append(Wait(h))
    return posts, waits


def _check_lane_patterns(program: Program, ctx: LowerContext) -> None:
    """Lanes in lockstep (Note [coupled lanes]) run the same compute ops in the same order; validation refused
    plans whose lanes cannot (hetc.passes.validate_plan), so a difference here is a bug in pass `schedule`."""
    by_rank = {rp.rank: rp for rp in program.ranks}   # every rank, or those `lower(ranks=...)` builds
    for group in lockstep_groups(ctx.pipeline, ctx.model):
        patterns = {tuple((type(i).__name__, i.ms) for i in by_rank[lane.ranks[0]].instrs
                          if isinstance(i, COMPUTE_TYPES)) for lane in group.lanes if lane.ranks[0] in by_rank}
        if len(patterns) > 1:
            raise InternalError(f"the lanes of stage {group.stage.index} in lockstep ({group.reason.value}) run "
                                "different compute sequences")
