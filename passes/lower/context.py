"""What every lowering pass needs to know about the plan, computed once.

`LowerContext` answers the questions passes ask over and over: which lane
runs ministage k for microbatch j, which messages carry a boundary tensor
between two lanes (pieces of the sequence where their block layouts
differ, hetc/ir/layout.py). Where each rank sits and which groups it is in
come from the plan's geometry (Note [rank geometry] in hetc/ir/geometry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.geometry import RankPlace
from hetc.ir.layout import Range, arrival_ranges, boundary_ranges, held_length, transfers
from hetc.ir.memo import cached_property
from hetc.passes.cost import CostModel
from hetc.passes.lower.lane_sim import Run
from hetc.ir.pipeline import Lane, Stage
from hetc.ir.plan import Plan
from hetc.ir.program import Instr, RankProgram, Tensor

__all__ = ["LowerContext", "Message", "next_handle", "rank_shell"]


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point transfer of a boundary tensor (or, with `seq`, of its tokens [a, b))."""

    src: int
    dst: int
    shape: tuple[int, ...]
    seq: Range | None


class LowerContext:
    def __init__(self, plan: Plan, costs: CostModel | None = None):
        self.plan = plan
        self.spec, self.pipeline = plan.spec, plan.pipeline
        self.model, self.train, self.parallel = plan.model, plan.train, plan.parallel
        self.geometry = plan.geometry   # places and groups (Note [rank geometry] in hetc/ir/geometry.py)
        self._costs = costs
        self.grad_clip = plan.train.grad_clip
        self._messages: dict[tuple[Tensor, int, int], tuple[Message, ...]] = {}
        self._held: dict[tuple[int, int], tuple[Range, ...]] = {}
        self._arrives: dict[tuple[int, int], tuple[Range, ...]] = {}

    @cached_property
    def costs(self) -> CostModel:
        """The cost model the schedule is timed with (the catalog's arithmetic unless one is given)."""
        return self._costs or CostModel(self.plan)

    @cached_property
    def schedule(self) -> Run:
        """The timed run of every lane (Note [schedules by simulation]), made once: pass `schedule` takes
        each lane's compute order from it."""
        from hetc.passes.lower.schedule import timed_schedule   # that module reads this context: not at import
        return timed_schedule(self)

    def in_flight_limit(self, stage: int) -> int:
        """Microbatches each lane of `stage` keeps in flight (Note [in-flight limit], passes/cost)."""
        return self.costs.in_flight_limits[stage]

    @cached_property
    def _lane_by_stage_mb(self) -> dict[tuple[int, int], Lane]:
        return {(s.index, mb): lane for s in self.pipeline.stages for lane in s.lanes for mb in lane.microbatches}

    def lane_for(self, ms: int, mb: int) -> Lane:
        """The lane that runs ministage `ms` on microbatch `mb`."""
        return self._lane_by_stage_mb[(self.pipeline.ministages[ms].stage, mb)]

    def held(self, stage: Stage, pos: int) -> tuple[Range, ...]:
        """The tokens lane position `pos` of `stage` holds at its ministages' borders (the same in every
        lane of the stage: memoised)."""
        got = self._held.get((stage.index, pos))
        if got is None:
            got = self._held[(stage.index, pos)] = boundary_ranges(stage, pos, self.model.seq)
        return got

    def arrives(self, stage: Stage, pos: int) -> tuple[Range, ...]:
        """The tokens lane position `pos` of `stage` receives of a boundary tensor from another stage: what
        it holds, or its tp part (Note [scatter-gather borders] in hetc/ir/layout.py). Memoised."""
        got = self._arrives.get((stage.index, pos))
        if got is None:
            got = self._arrives[(stage.index, pos)] = arrival_ranges(stage, pos, self.model.seq)
        return got

    def messages(self, what: Tensor, ms: int, mb: int) -> tuple[Message, ...]:
        """The transfers of `what` leaving ministage `ms` for microbatch `mb` (activation forward to ms+1,
        gradient backward to ms−1) between different ranks.

        Each position of the consuming lane gets the tokens it receives
        (`arrives`) from the producing lane (`hetc.ir.layout.transfers`); where
        the layouts agree that is one whole tensor per position, else pieces of
        the sequence.
        """
        key = (what, ms, mb)
        if key not in self._messages:
            self._messages[key] = self._transfers(ms, ms + 1 if what is Tensor.ACT else ms - 1, mb)
        return self._messages[key]

    def _transfers(self, producer: int, consumer: int, mb: int) -> tuple[Message, ...]:
        (src_stage, src_lane), (dst_stage, dst_lane) = ((self.stage_of(m), self.lane_for(m, mb))
                                                        for m in (producer, consumer))
        giving = [self.held(src_stage, p) for p in range(len(src_lane.ranks))]
        needing = [self.arrives(dst_stage, q) for q in range(len(dst_lane.ranks))]
        out = []
        for piece in transfers(giving, needing):
            src, dst = src_lane.ranks[piece.giver], dst_lane.ranks[piece.needer]
            if src != dst:
                tokens = held_length(giving[piece.giver]) if piece.seq is None else piece.seq[1] - piece.seq[0]
                out.append(Message(src, dst, (self.pipeline.micro_batch, tokens, self.model.hidden), piece.seq))
        return tuple(out)

    def stage_of(self, ms: int) -> Stage:
        return self.pipeline.stages[self.pipeline.ministages[ms].stage]

    def starts_model(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].first_layer == 0

    def ends_model(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].stop_layer == self.model.num_model_layers


def next_handle(instrs: list[Instr] | tuple[Instr, ...]) -> int:
    """The first handle number not used in a rank's program."""
    used = [h for i in instrs if (h := getattr(i, "handle", None)) is not None]
    return max(used, default=-1) + 1


def rank_shell(place: RankPlace) -> RankProgram:
    return RankProgram(place.rank, place.stage.index, place.lane.index, place.tp_rank, place.cp_rank, (), ())
