"""Score a candidate: the cost model's step and memory, class by class, and what it costs in dollars.

The step time and memory are the cost model's own composition
(`passes.cost.classes.evaluate_classes`), the one `CostModel.estimate()`
runs rank by rank, here over the candidate's stages as `StageCosts` reads
them class by class (ranks the cost model times alike: same stage, device
kind and microbatch count, same peer node groups), so that 2048 ranks
score in milliseconds. tests/test_plan_agreement.py holds the score of
every plan `hetc plan` prints to its compiled program.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.passes.cost import RankMemory
from hetc.passes.cost.classes import PlanShape, evaluate_classes, throughput, tokens_per_step
from hetc.passes.cost.plan_time import step_end_time
from hetc.passes.plan.primitives import Primitives
from hetc.passes.plan.egress import egress_per_step
from hetc.passes.plan.candidate_stage import StageCosts
from hetc.passes.plan.candidate_view import PlanView
from hetc.ir.program import Collective

__all__ = ["Score", "evaluate"]


@dataclass(frozen=True)
class Score:
    step_time_s: float
    pipeline_s: float
    bubble_s: float
    tail_s: float
    tokens_per_step: int
    memory: tuple[RankMemory, ...]    # one per class of alike ranks; `ranks` expands them
    classes: tuple[tuple[int, ...], ...]   # GPU ids of each memory entry
    price_per_hour: float
    egress_per_step: float            # $ per step for bytes crossing priced links
    fill: float = 1.0                 # the share of each device's memory the plan may fill (Note [planning headroom])

    @property
    def tokens_per_s(self) -> float:
        return throughput(self.tokens_per_step, self.step_time_s)

    @property
    def fits(self) -> bool:
        """Whether every rank fits in the share of its device the search plans to (`fill`)."""
        return self.fits_within(self.fill)

    def fits_within(self, share: float) -> bool:
        """Whether every rank fits in `share` of its device's memory."""
        return all(m.total <= share * m.capacity for m in self.memory)

    @property
    def fits_device(self) -> bool:
        """Whether every rank fits in its device's memory, as the cost model says of any plan."""
        return self.fits_within(1.0)

    @property
    def fullest(self) -> RankMemory:
        """The class of ranks that fills the largest share of its device."""
        return max(self.memory, key=lambda m: m.share)

    @property
    def dollars_per_token(self) -> float:
        per_step = self.price_per_hour * self.step_time_s / 3600 + self.egress_per_step
        return per_step / self.tokens_per_step

    @property
    def dollars_per_hour(self) -> float:
        """GPU rent plus egress at this step rate."""
        egress = self.egress_per_step * 3600 / self.step_time_s if self.step_time_s else 0.0
        return self.price_per_hour + egress


def _tied_time(prims: Primitives, plan: PlanView) -> float:
    """`CostModel.tied_time` of the candidate: the embedding's stage (the first) and the head's (the last)
    sum their tied copies when they differ."""
    m = prims.model
    first, last = plan.ministages[0][2], plan.ministages[-1][2]
    if not m.tied_embeddings or first == last:
        return 0.0
    ranks = tuple(sorted(g.id for s in (first, last) for g in plan.stages[s].res.gpus))
    return prims.ring(Collective.ALL_REDUCE, ranks, m.vocab * m.hidden * prims.states.grads)


def evaluate(prims: Primitives, plan: PlanView) -> Score:
    """The cost model's composition (passes/cost/classes.py) over the candidate's stages, class by class."""
    costs = [StageCosts(prims, plan, s) for s in plan.stages]
    world = tuple(sorted(g.id for g in plan.gpus))   # the "world" group: ranks in GPU order
    end = step_end_time(prims.train.grad_clip > 0, lambda nbytes: prims.ring(Collective.ALL_REDUCE, world, nbytes),
                        _tied_time(prims, plan))
    shape = PlanShape(prims.engine, plan.schedule, plan.num_microbatches, prims.train.grad_clip,
                      tuple(s for _, _, s in plan.ministages), max(len(s.ministages) for s in plan.stages))
    got = evaluate_classes(shape, costs, end)
    t = got.time
    tokens = tokens_per_step(plan.num_microbatches, plan.micro_batch, prims.model.seq)
    price = sum(g.device.price for g in plan.gpus)
    return Score(t.step, t.pipeline, t.bubble, t.tail, tokens, got.memory, got.classes, price,
                 egress_per_step(prims, plan, costs), prims.fill)
