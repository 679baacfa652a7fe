"""Does the plan fit in device memory? One located error per stage that does not, naming what would help.

`hetc check` asks the cost model's estimate (`CostModel.estimate().memory`);
`hetc compile` asks the verifier's walk of the lowered programs
(`passes.verify.memory.rank_peaks`). Both report through `stage_overflow`, so
a user sees one message per stage — where the stage is written, its worst
rank, how many of its ranks overflow and the knobs that would make it fit —
not one line per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetc.ir.errors import Diagnostic
from hetc.passes.verify.memory import Peak, format_bytes
from hetc.ir.pipeline import Pipeline, Stage
from hetc.ir.spec import Checkpointing, OffloadTarget

if TYPE_CHECKING:     # both import this module's callers' modules at run time
    from hetc.passes.cost import CostError
    from hetc.passes.cost.memory import RankMemory
    from hetc.ir.plan import Plan

__all__ = ["HEADROOM_PRICE", "NEAR_CAPACITY", "RankUse", "cost_error", "estimate_overflows", "estimate_uses", "near_capacity_warning",
           "peak_overflows", "peak_uses", "stage_overflows"]

# Note [Near capacity]: a rank the estimate puts above this share of its device's memory fits on paper,
# but no estimate sees everything (fragmentation beyond the reserve it keeps, NCCL's buffers grown on
# demand, a library's workspace); a few percent of those is an out-of-memory error at step 1. Such plans are accepted (the
# estimate may be right) with a warning naming the ranks, so the first OOM is not a surprise.
NEAR_CAPACITY = 0.95
# what the planner pays for a plan within NEAR_CAPACITY over the best for the whole device, at most: a share of
# its objective (Note [planning headroom] in passes/plan/planner.py)
HEADROOM_PRICE = 0.05


@dataclass(frozen=True)
class RankUse:
    """One rank's memory at its peak: the parts by name, and its device's capacity."""

    rank: int
    parts: Mapping[str, float]
    capacity: float

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def over(self) -> bool:
        return self.total > self.capacity


def estimate_overflows(plan: Plan) -> list[Diagnostic]:
    """The stages of `plan` that the cost model's estimate puts over their devices' memory."""
    from hetc.passes.cost import CostError, CostModel

    try:
        estimate = CostModel(plan).estimate()
    except CostError as err:   # a device the cost model cannot time: compile would stop there too
        return [cost_error(plan, err)]
    return stage_overflows(plan, estimate_uses(estimate.memory), "the cost model estimates")


def estimate_uses(memory: Iterable[RankMemory]) -> list[RankUse]:
    """The cost model's per-rank breakdown (`Estimate.memory`) as RankUses, by rank."""
    return [RankUse(m.rank, {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                             "activations": m.activations, "buffers": m.buffers, "reserve": m.reserve},
                    m.capacity) for m in sorted(memory, key=lambda m: m.rank)]


def near_capacity_warning(pipeline: Pipeline, uses: list[RankUse], source: str) -> str | None:
    """One line naming the ranks that fit but above NEAR_CAPACITY of their device (Note [Near capacity]);
    None when there are none. `source` says where the numbers come from."""
    near = [u for u in uses if not u.over and u.total > NEAR_CAPACITY * u.capacity]
    if not near:
        return None
    worst = max(near, key=lambda u: u.total / u.capacity)
    ranks = ", ".join(str(u.rank) for u in near[:8]) + (f" and {len(near) - 8} more" if len(near) > 8 else "")
    return (f"rank{'s' if len(near) > 1 else ''} {ranks} fill{'s' if len(near) == 1 else ''} more than "
            f"{NEAR_CAPACITY:.0%} of {'its' if len(near) == 1 else 'their'} device memory: {source} that rank "
            f"{worst.rank} needs {format_bytes(worst.total)} of the {format_bytes(worst.capacity)} its "
            f"{pipeline.world[worst.rank].device.name} holds ({worst.total / worst.capacity:.1%}), which leaves "
            "little room for what no estimate sees (fragmentation beyond its reserve, library workspaces, "
            "buffers grown on demand): the run may still run out of memory")


def cost_error(plan: Plan, err: CostError) -> Diagnostic:
    """A `passes.cost.CostError`, located at the device kind it blames (else at the plan)."""
    device = plan.spec.device(err.device) if err.device is not None else None
    return Diagnostic(device.span if device is not None else plan.parallel.span, str(err))


def peak_overflows(plan: Plan, peaks: list[Peak]) -> list[Diagnostic]:
    """The stages whose ranks' verified peaks (`passes.verify.memory.rank_peaks`) exceed their devices."""
    return stage_overflows(plan, peak_uses(peaks), "the verifier finds")


def peak_uses(peaks: Iterable[Peak]) -> list[RankUse]:
    """The verifier's per-rank peaks (`passes.verify.memory.rank_peaks`) as RankUses, by rank."""
    return [RankUse(p.rank, p.parts, p.capacity) for p in sorted(peaks, key=lambda p: p.rank)]


def stage_overflows(plan: Plan, uses: list[RankUse], source: str) -> list[Diagnostic]:
    """One error per stage with a rank over its capacity; `source` says where the numbers come from."""
    per_stage = [(stage, [uses[r] for r in stage.ranks]) for stage in plan.pipeline.stages]
    return [_stage_overflow(plan, stage, mine, source) for stage, mine in per_stage
            if any(u.over for u in mine)]


def _stage_overflow(plan: Plan, stage: Stage, uses: list[RankUse], source: str) -> Diagnostic:
    over = [u for u in uses if u.over]
    worst = max(over, key=lambda u: u.total / u.capacity)
    gpu = plan.pipeline.world[worst.rank]
    parts = ", ".join(f"{name} {format_bytes(b)}" for name, b in worst.parts.items() if b > 0)
    count = "" if len(uses) == 1 else (f"; all {len(uses)} of its ranks overflow" if len(over) == len(uses)
                                       else f"; {len(over)} of its {len(uses)} ranks overflow")
    st = plan.parallel.resolved_stages[stage.index]
    return Diagnostic(st.span, f"stage '{stage.name}' does not fit in device memory: {source} that rank "
                               f"{worst.rank} needs {format_bytes(worst.total)} ({parts}) but its "
                               f"{gpu.device.name} {gpu} holds {format_bytes(worst.capacity)}{count}; to fit, try "
                               + ", ".join(_knobs(plan, stage)))


def _knobs(plan: Plan, stage: Stage) -> list[str]:
    """What would lower the stage's memory, among what it does not use yet."""
    model, train, par, pipeline, knobs = plan.model, plan.train, plan.parallel, plan.pipeline, []
    replicas = len(stage.lanes) * stage.cp
    level = stage.zero.resolved_level
    if level < 3:
        knobs.append(f"a higher ZeRO level (zero = {level + 1}..3)" if replicas > 1 else
                     "more lanes with a ZeRO level (lanes = 2, zero = 1..3)")
    off = [name for name, target in (("params", stage.offload.params), ("optimizer", stage.offload.optimizer))
           if target is OffloadTarget.NONE]
    if off:
        knobs.append("offload { " + ", ".join(f"{name} = cpu" for name in off) + " }")
    if stage.checkpoint is not Checkpointing.FULL:
        where = "the model" if par.resolved_stages[stage.index].activation_checkpoint is None else "the stage"
        knobs.append(f"activation_checkpoint = full in {where}")
    if model.heads % (2 * stage.tp) == 0 and model.num_kv_heads % (2 * stage.tp) == 0:
        knobs.append(f"more tensor parallelism (tp = {2 * stage.tp})")
    if sum(len(pipeline.ministages[ms].layers) for ms in stage.ministages) > 1:
        knobs.append("more stages (fewer layers per stage)")
    if train.micro_batch > 1:
        knobs.append(f"a smaller micro_batch (now {train.micro_batch})")
    return knobs
