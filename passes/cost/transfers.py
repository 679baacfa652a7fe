"""How much of a lane's border transfers its thread waits for, per engine (Note [async sends]).

Note [async sends]: hetc's lowering (passes/lower/p2p.py, Note [p2p
placement]) posts every send as an `isend` right after the op that made
its tensor and waits for it only at the end of the step, and posts every
receive one compute op before its consumer, waiting right before the
consumer. The transfer runs beside that op, so a lane waits only for what
of a transfer outlasts the op before its consumer, in the lane's steady
order: under GPipe a forward follows a forward and a backward a backward;
under 1F1B a forward follows a backward and a backward a forward. With
several ministages on a stage each receive overlaps one op, a ministage's
share of the stage's compute. Two schedules count every transfer, as a
blocking engine waits for it: under interleaved 1F1B a microbatch comes
back to the lane for its next chunk only after crossing the borders in
between, so its transfers lie between the lane's own ops of it; ZB-H1 runs
what is ready, so the op a receive overlaps is not fixed (the agreement
family's interleaved and ZB plans, tests/test_plan_agreement.py, ran up to
30 % longer than the overlapped count). But interleaved 1F1B with one lane
a stage alternates its chunk forwards and backwards as 1F1B does, each
chunk's input arriving from the one lane before it in that order: its
receives run beside the op before their consumer (deep TP jobs 4 and 11,
7 and 11 stages of tp 4 and 0.1-0.3 ms chunks, were explained +22.1 % and
+22.7 % of their compiled steps counted whole, −8.2 % and +4.7 % so).
So do lanes that line up stage to stage (every stage the same lanes
serving as many microbatches each: each lane's microbatches go round the
same lanes, independent pipelines side by side; random job 19, two lanes
of a node a stage whose borders share its link, was explained +11.9 %
of its compiled step counted whole, +1.6 % so; the published interleaved
runs, whose data-parallel lanes line up, came out 2-3 points faster:
Nemotron-4 340B −9.5 % to −12.2 % of its measured step, docs/benchmarks.md
"Published runs"). Where a lane's inputs
come from lanes that serve other microbatches between them, the count
stays whole (random jobs 27 and 81 and zorse/c_auto.het fell to −11.8 %,
−10.7 % and −14.8 % counted overlapped). And ZB-H1 runs each microbatch's F, I, W
in turn in its steady order where every lane of each stage serves as many
microbatches and each border's lane counts divide one another
(`in_order`, `schedule.in_steady_order`): a lane trades with the lanes
across a border in a fixed rotation, so an activation's receive runs
beside the W before its forward, a gradient's beside the F before its
input gradient (demo moe_pp_ep2 on two shared cores: the last stage's
1.9 ms receive under a 3.1 ms W, none of it waited; demo zb and
moe_pp_ep2 came within 0.2 % of compile from +7.7 % and +1.3 %; under
the GEMM curve random jobs 22 and 46, one and two lanes feeding four and
eight, from +10.7 % and +12.6 % counted whole to −6.1 % and +3.1 %).
Where lanes serve different counts or do not divide across a border, a
lane serves the microbatches of several upstream lanes as they arrive:
there the count stays whole (zorse/c_auto.het's 16 lanes feeding 12,
counted overlapped stage by stage, −21.6 %; docs/costmodel.md "Known
limits"). Lanes in lockstep behind per-microbatch ZeRO-2/3 collectives
count overlapped too since a border's two directions run on communicators
of their own (Note [one communicator per direction] in runtime/comm.py):
while a rank pair's activation and gradient took turns on one NCCL line,
the planner's ZB-H1 plans of such lanes (random job 42,
examples/auto_demo.het) were explained +10.8 % and −16.6 % of their
compiled steps counted overlapped, and counted whole, random job 56 (two
ZeRO-3 lanes behind eight single-lane stages, borders of 0.9 and 1.1 ms)
read +11.4 % once the directions overlapped; counted overlapped, +2.2 %,
and all 158 agreement tests hold. Megatron-LM and DeepSpeed block on
their sends and receives: the lane
waits for every transfer, each border once per microbatch and cycle (the
activation of one microbatch and the gradient of another cross it at the
same time), which Sailor's measured runs validate (docs/costmodel.md,
"Validation"). Either way the transfers are on the path of a microbatch
through the pipeline: the fill and drain, the round trip of the in-flight
limit and the lower bound count them whole (`Borders.total`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from hetc.ir.spec import ScheduleKind

__all__ = ["Borders", "Engine", "transfer_waits"]


class Engine(StrEnum):
    """The training engine whose point-to-point traffic the cost model times (Note [async sends])."""

    HETC = "hetc"            # hetc's programs: asynchronous sends, receives posted one op ahead
    MEGATRON = "megatron"    # Megatron-LM / DeepSpeed: blocking sends and receives


@dataclass(frozen=True, slots=True)
class Borders:
    """One microbatch's border transfers on a lane, seconds each: the activations it receives (one per
    border before one of its ministages, whose gradient goes back over it) and the gradients it receives
    (one per border after one, whose activation goes out over it)."""

    activations: tuple[float, ...] = ()
    gradients: tuple[float, ...] = ()
    ministages: int = 1     # the stage's ministages: each receive overlaps one ministage's op
    later: float = 0.0      # of all, the borders with later stages (a round trip through them crosses each twice)

    @property
    def total(self) -> float:
        """Every border once (one transfer per border, microbatch and direction)."""
        return sum(self.activations) + sum(self.gradients)


def transfer_waits(engine: Engine, schedule: ScheduleKind, borders: Borders,
                   compute: tuple[float, float, float], in_order: bool = False) -> float:
    """Seconds per microbatch the lane's thread waits for its border transfers (Note [async sends]);
    `compute`: the stage's (F, I, W) of one microbatch; `in_order`: lanes in their steady order
    (`schedule.in_steady_order`)."""
    order = _IN_ORDER[schedule] if in_order and schedule in _IN_ORDER else _STEADY_ORDER.get(schedule)
    if engine is Engine.MEGATRON or order is None:
        return borders.total
    f, i, w = (x / max(borders.ministages, 1) for x in compute)
    before_forward, before_backward = order(f, i, w)
    return sum(max(0.0, t - before_forward) for t in borders.activations) + \
        sum(max(0.0, t - before_backward) for t in borders.gradients)


# (the op before a forward, the op before a backward) in a lane's steady order, from its (F, I, W): the schedules
# whose steady order is set (1F1B's alternation, which it keeps wherever inputs come on time, Note [1F1B by
# readiness]; GPipe's sweeps); the others count every transfer
_Order = Callable[[float, float, float], tuple[float, float]]
_STEADY_ORDER: dict[ScheduleKind, _Order] = {
    ScheduleKind.GPIPE: lambda f, i, w: (f, i + w),
    ScheduleKind.ONE_F_ONE_B: lambda f, i, w: (i + w, f),
}
# the orders lanes keep only where nothing upstream reorders their arrivals (`in_order`): ZB-H1 with every lane
# serving as many microbatches runs F, I, W in turn (W before a forward, F before an input gradient);
# interleaved 1F1B with one lane a stage alternates chunk forwards and backwards as 1F1B does
_IN_ORDER: dict[ScheduleKind, _Order] = {
    ScheduleKind.ZB: lambda f, i, w: (w, f),
    ScheduleKind.INTERLEAVED: lambda f, i, w: (i + w, f),
}
