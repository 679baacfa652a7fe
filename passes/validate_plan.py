"""Rules on the resolved plan: what the runtime and the lowering passes need of a Pipeline.

`hetc check` must report every error `hetc compile` or `hetc run` would
meet, so the rules that need the resolved ranks, lanes and ministages live
here, beside the validation pass, and lowering only asserts them:

- tied embeddings need the embedding and the head in one ministage or on
  different stages (`hetc.passes.validate_runtime`, which the runtime shares);
- a lane's ranks must ascend where torch's group numbering matters
  (sequence-parallel gathers, Ulysses' all-to-alls, expert groups);
- lanes that move in lockstep (Note [coupled lanes] in passes/lower/lane_sim.py)
  must queue the same ops in the same order;
- hierarchical ZeRO (shard = node) needs as many of a stage's replicas on
  every node (`uneven_node_shards` in hetc/ir/geometry.py): two replicas
  on one node and one on another met in collectives of half and whole
  buffers, which gloo stops on and NCCL does not check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetc.ir.errors import Diagnostic
from hetc.ir.geometry import hierarchical_zero, uneven_node_shards
from hetc.passes.lower.schedule import LockstepReason, lane_queues, lockstep_cause, lockstep_groups, queue_shape
from hetc.ir.pipeline import Lane, Pipeline, Stage
from hetc.ir.plan import Plan
from hetc.passes.validate_runtime import check_tied_embeddings
from hetc.ir.spec import CPKind, StageSpec

__all__ = ["check_plan"]


def check_plan(plan: Plan, errors: list[Diagnostic]) -> None:
    """Append a located error for every rule of the module docstring that `plan`'s pipeline breaks."""
    model, pipeline = plan.model, plan.pipeline
    if (problem := check_tied_embeddings(model, pipeline)) is not None:
        errors.append(Diagnostic(model.span_of("tied_embeddings"), problem))
    for stage in pipeline.stages:
        st = plan.parallel.resolved_stages[stage.index]
        _check_rank_order(st, stage, errors)
        _check_node_shards(pipeline, st, stage, errors)
    _check_lockstep(plan, errors)


def _check_node_shards(pipeline: Pipeline, st: StageSpec, stage: Stage, errors: list[Diagnostic]) -> None:
    """Hierarchical ZeRO: every node holding replicas of the stage holds as many (`uneven_node_shards`)."""
    if not hierarchical_zero(stage):
        return
    per_node = uneven_node_shards([[pipeline.world[r].host for r in lane.ranks] for lane in stage.lanes],
                                  stage.tp, stage.cp)
    if per_node is not None:
        held = ", ".join(f"{group}[{i}] holds {n}" for (group, i), n in per_node.items())
        errors.append(Diagnostic(stage.zero.span_of("shard"), f"hierarchical ZeRO (shard = node) shards stage "
                                 f"'{st.name}' over each node's replicas and reduces shard i of every node "
                                 f"together, so every node must hold as many: {held}; place the stage's lanes "
                                 "evenly over its nodes, or shard = all"))


def _ascending(ranks: Sequence[int]) -> bool:
    return list(ranks) == sorted(ranks)


def _check_rank_order(st: StageSpec, stage: Stage, errors: list[Diagnostic]) -> None:
    """torch numbers a group's members by global rank; where the order of concatenation matters, the lane's
    ranks must follow it (one error per stage and rule)."""
    tp, cp = stage.tp, stage.cp
    rules: list[tuple[str, str, Callable[[Lane], list[tuple[int, ...]]]]] = []
    if stage.sequence_parallel and tp > 1:
        rules.append(("tp", "sequence parallelism", lambda lane: [lane.ranks[c * tp:(c + 1) * tp] for c in range(cp)]))
    if cp > 1 and stage.cp_kind is CPKind.ULYSSES:
        rules.append(("cp", "Ulysses attention", lambda lane: [lane.ranks[t::tp] for t in range(tp)]))
    for what, needs, members in rules:
        lane = next((lane for lane in stage.lanes if not all(_ascending(m) for m in members(lane))), None)
        if lane is not None:
            errors.append(Diagnostic(st.span_of("ranks"), f"the {what} ranks of lane {lane.index} of stage "
                                     f"'{st.name}' are not in ascending rank order, which {needs} needs; list "
                                     "each lane's GPUs in rank order"))
    for first in range(0, len(stage.lanes), stage.ep) if stage.ep > 1 else ():
        group = stage.lanes[first:first + stage.ep]
        if not all(_ascending([lane.ranks[pos] for lane in group]) for pos in range(stage.lane_size)):
            # EP rank r (lane first + r) owns the r-th share of the experts
            errors.append(Diagnostic(st.span_of("ranks"), f"the lanes {first}..{first + stage.ep - 1} of stage "
                                     f"'{st.name}' form an expert-parallel group but are not in ascending rank "
                                     "order, which the experts' all-to-alls need; list the GPUs in rank order"))
            return


def _check_lockstep(plan: Plan, errors: list[Diagnostic]) -> None:
    pipeline = plan.pipeline
    for group in lockstep_groups(pipeline, plan.model):
        shapes = [queue_shape(lane_queues(pipeline, group.stage, lane)) for lane in group.lanes]
        odd = next((lane for lane, shape in zip(group.lanes, shapes) if shape != shapes[0]), None)
        if odd is not None:
            errors.append(_lockstep_error(plan, group.stage, group.reason, (group.lanes[0], odd)))


def _lockstep_error(plan: Plan, stage: Stage, reason: LockstepReason, lanes: tuple[Lane, Lane]) -> Diagnostic:
    st = plan.parallel.resolved_stages[stage.index]
    if reason is LockstepReason.ZERO:
        return Diagnostic(st.span, f"{lockstep_cause(stage, reason, plan.pipeline.schedule)}, so every lane of "
                                   f"stage '{stage.name}' must run the same sequence "
                                   "of ops, but its lanes serve different microbatch patterns; use the zorse "
                                   "schedule, ZeRO ≤ 1, or equal lanes")
    first, odd = lanes
    return Diagnostic(st.span_of("ep"), f"lanes {first.index} and {odd.index} of stage '{stage.name}' form an "
                                        "expert-parallel group, whose MoE compute runs in lockstep, but they run "
                                        f"different sequences of ops (microbatch counts {len(first.microbatches)} "
                                        f"and {len(odd.microbatches)}); give the lanes of each group equal "
                                        "microbatches")
