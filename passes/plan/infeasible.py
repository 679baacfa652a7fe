"""Why no plan can be chosen, as a located error.

Three reasons, checked in this order:

1. a single layer does not fit on any GPU, even alone in a stage of every
   GPU of the node group with the most memory per GPU, sharded as far as
   the spec allows (the highest ZeRO level, parameters and optimizer state
   offloaded), one microbatch in flight: the error names the layer and
   the GPU, at the model block;
2. layers fit one by one but no plan holds them all: the closest plan's
   fullest GPU and the layers on it, at the parallel block;
3. plans fit but none within the objective's budget or minimum
   throughput: the nearest miss, at the objective.

The first two end with `advice` (passes/plan/would_fit.py): which change to
what the spec fixes would let a plan fit, or that none would.
"""

from __future__ import annotations

from collections.abc import Callable

from hetc.ir.units import human_bytes
from hetc.ir.errors import Diagnostic, SpecError
from hetc.passes.plan.candidate import Knobs, Offload, StageGpus
from hetc.passes.plan.layouts import group_size, whole_group
from hetc.passes.plan.tables import stage_costs
from hetc.passes.plan.candidate_score import Score
from hetc.passes.plan.baselines import Baseline
from hetc.passes.plan.candidate import Candidate
from hetc.passes.plan.structures import Found, Structures
from hetc.ir.spec import ScheduleKind

__all__ = ["no_plan_error"]


def no_plan_error(search: Structures, found: list[Found], baselines: list[Baseline],
                  advice: Callable[[], str]) -> SpecError:
    """`found`: the search's plans (fitting or not); `baselines`: the baselines, scored; `advice`: what to
    change when nothing fits in memory (asked only then)."""
    par = search.job.parallel
    if not found and _tied_in_one_stage_only(search):
        return SpecError([Diagnostic(par.span_of("schedule"), "interleaved 1F1B runs every stage as two chunks, and "
                                     "a one-stage plan keeps the tied embedding and head in one ministage "
                                     "(tied_embeddings); this cluster gives the planner one stage only: use "
                                     "another schedule, or more GPUs")])
    layer = _layer_that_cannot_fit(search)
    if layer is not None:
        return SpecError([Diagnostic(search.model.span, f"{layer}; {advice()}")])
    fitting = [f for f in found if f.score.fits]
    if not fitting:
        tried = [(f.candidate, f.score) for f in found] + [(b.candidate, b.score) for b in baselines
                                                           if b.score is not None and b.candidate is not None]
        closest = min(tried, key=lambda cs: _overflow(cs[1]), default=None)
        return SpecError([Diagnostic(par.span, f"{_closest(search, closest)}; {advice()}")])
    return SpecError([Diagnostic(par.objective.span, _objective_miss(search, fitting))])


def _tied_in_one_stage_only(search: Structures) -> bool:
    """Interleaved 1F1B is the only schedule allowed, the model ties its embedding and head, and every layout
    the planner may use has one stage: no structure at all (`ties_in_one_ministage`)."""
    return search.space.schedules == (ScheduleKind.INTERLEAVED,) and search.model.tied_embeddings and \
        all(len(layout) == 1 for _, layout in search.layouts())


def _frugal(search: Structures, lanes: int) -> Knobs:
    space = search.space
    offloads = [o for o in space.offloads if o.params or o.optimizer] or list(space.offloads)
    offload = max(offloads, key=lambda o: (o.params, o.optimizer))
    level = max(space.zero_levels) if lanes > 1 else min(space.zero_levels)
    return Knobs(level, offload, 1, space.checkpoints[-1])   # the strongest checkpointing allowed


def _layer_that_cannot_fit(search: Structures) -> str | None:
    topo, model = search.topo, search.model
    group = max(topo.groups, key=lambda g: (topo.gpu_at(g, 0, 0).device.memory, group_size(topo, g)))
    stage = StageGpus(whole_group(topo, group))
    res = search.resolve(stage)
    prims = search.prims[min(search.space.micro_batches)]
    gpu, lanes = res.lanes[0][0], len(res.lanes)
    knobs = _frugal(search, lanes)
    neighbours = {i: gpu for i in range(3)}
    worst = None
    for index, name in ((0, "embed"), (1, model.layer_name(1)), (2, "head")):
        sc = stage_costs(prims, res, index, 3, 1, knobs, ScheduleKind.ONE_F_ONE_B, neighbours, 0,
                         search.space.prefetch, search.space.zero_base)
        mem = sc.memory(0, gpu, 1)
        if not mem.fits and (worst is None or mem.total - mem.capacity > worst[1].total - worst[1].capacity):
            worst = (name, mem)
    if worst is None:
        return None
    name, mem = worst
    what = "block" if name.startswith("block") else name
    return (f"layer {name} does not fit on any GPU: alone in a stage of all {group_size(topo, group)} "
            f"{gpu.device.name} GPUs of '{group}' (the most memory per GPU), sharded over {lanes} "
            f"lane{'s' if lanes > 1 else ''} with ZeRO-{knobs.zero}{_offloaded(knobs.offload)}, micro_batch "
            f"{prims.micro_batch}, one microbatch in flight, the {what} needs {human_bytes(mem.total)} on "
            f"{gpu} ({gpu.device.name}, {human_bytes(mem.capacity)}): "
            f"{human_bytes(mem.params + mem.grads + mem.optimizer)} of model states, "
            f"{human_bytes(mem.activations)} of activations, {human_bytes(mem.buffers + mem.reserve)} of "
            "buffers and reserve")


def _offloaded(off: Offload) -> str:
    return "" if off == Offload() else f", {off} offloaded to the host"


def _overflow(score: Score) -> float:
    return score.fullest.share


def _closest(search: Structures, closest: tuple[Candidate, Score] | None) -> str:
    if closest is None:
        prims = search.prims[min(search.space.micro_batches)]
        m = prims.num_microbatches
        return (f"no plan places {m} microbatches (global_batch {prims.train.global_batch}) in "
                "memory on this cluster: every stage layout the planner tried overflows some GPU even at one "
                "microbatch per lane")
    c, score = closest
    mem = score.fullest
    first, stop = c.ranges[mem.stage][0][0], c.ranges[mem.stage][-1][1]
    model = search.model
    layers = f"{model.layer_name(first)}..{model.layer_name(stop - 1)}"
    return (f"no plan fits in memory: the closest ({len(c.stages)} stages, {c.schedule.value}) still needs "
            f"{human_bytes(mem.total)} on {mem.gpu} ({mem.device}, {human_bytes(mem.capacity)}) for layers "
            f"{layers}")


def _objective_miss(search: Structures, fitting: list[Found]) -> str:
    goal = search.goal
    if goal.budget > 0 and not any(goal.within_budget(f.score) for f in fitting):
        cheapest = min(fitting, key=lambda f: f.score.dollars_per_hour)
        return (f"no plan stays within the budget of {goal.budget:g} $/h: the cheapest that fits costs "
                f"{cheapest.score.dollars_per_hour:,.2f} $/h ({cheapest.score.tokens_per_s:,.0f} tokens/s)")
    fastest = max(fitting, key=lambda f: f.score.tokens_per_s)
    return (f"no plan reaches min_throughput {goal.min_throughput:,.0f} tokens/s"
            f"{' within the budget' if goal.budget > 0 else ''}: the fastest that fits reaches "
            f"{fastest.score.tokens_per_s:,.0f} tokens/s")
