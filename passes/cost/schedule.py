"""Step time of a pipeline from per-lane, per-microbatch timings, for each schedule kind.

What overlaps with what (docs/costmodel.md):

- point-to-point activations and gradients: each border costs one
  transfer per microbatch on the path of a microbatch through the
  pipeline (the activation of one microbatch and the gradient of another
  cross it in opposite directions at the same time); of those, a lane's
  cycle holds what its thread waits for (`LaneTiming.p2p_wait`): all of
  them where the engine blocks on them (Megatron's and DeepSpeed's 1F1B),
  what outlasts the op before their consumer where its sends are
  asynchronous (hetc's programs; Note [async sends] in transfers.py);
- per-microbatch ZeRO collectives (ZeRO-3 gathers, ZeRO-2/3
  reduce-scatters under gradient accumulation) run beside the compute, but
  the compute waits for them where lowering put the waits (`zero_cycle`,
  Note [zero cycle]);
- the bubble: 1F1B and GPipe fill and drain once through every stage but
  the bottleneck; interleaved 1F1B with v chunks divides that by v; ZB-H1
  fills it with weight-gradient work, leaving (F + I − W) per stage.

Zorse's sequential ministages are a different shape and are simulated
microbatch by microbatch in `sequential_time`.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from itertools import groupby, pairwise
from dataclasses import dataclass
from enum import StrEnum

from hetc.ir.pipeline import route_microbatches
from hetc.ir.spec import ScheduleKind

__all__ = ["ChunkSweep", "Grouping", "LaneTiming", "PipelineTime", "Unit", "UnitLane", "UnitOp", "ZeroCycle",
           "chunk_loop_wait", "group_width", "in_flight_limits", "in_steady_order", "interleaved_grouping",
           "interleaved_groups",
           "lockstep_fill", "pipeline_time", "round_trip_span", "sequential_time", "stage_max", "step_lower_bound",
           "unit_ops", "zero_cycle"]


@dataclass(frozen=True, slots=True)
class LaneTiming:
    """Per-microbatch seconds of one lane of one stage (all of the stage's ministages)."""

    stage: int
    lane: int
    microbatches: int
    forward: float
    input_grad: float
    weight_grad: float
    p2p: float = 0.0          # transfers on this stage's borders, each once (a microbatch's path through it)
    overlapped: float = 0.0   # seconds of collectives beside the compute, per microbatch (traffic)
    bound: float = 0.0        # the cycle those collectives allow (`zero_cycle`); 0: none
    trail: float = 0.0        # the last microbatch's reduce-scatter past the lane's last cycle
    p2p_wait: float = 0.0     # of `p2p`, what the lane's thread waits for per microbatch (Note [async sends])
    p2p_after: float = 0.0    # of `p2p`, over the borders with later stages (a round trip crosses them twice)

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad

    @property
    def one(self) -> float:
        """One microbatch through this lane, forward and backward, with its border transfers."""
        return self.forward + self.backward + self.p2p

    @property
    def on_thread(self) -> float:
        """One microbatch on this lane's thread: its compute and what it waits for its transfers."""
        return self.forward + self.backward + self.p2p_wait

    @property
    def cycle(self) -> float:
        """The lane's seconds per microbatch: its thread's, or what its collectives allow."""
        return max(self.on_thread, self.bound)

    @property
    def work(self) -> float:
        return self.microbatches * self.cycle


@dataclass(frozen=True, slots=True)
class PipelineTime:
    total: float
    busy: float          # the bottleneck lane's own work
    bubble: float
    bottleneck: tuple[int, int]   # (stage, lane)


def pipeline_time(schedule: ScheduleKind, lanes: list[LaneTiming], chunks: int = 1,
                  limits: Mapping[int, int] | None = None,
                  group: Callable[[LaneTiming], int] | None = None) -> PipelineTime:
    """Forward and backward of every microbatch, for 1F1B-like schedules and GPipe; `group`: under interleaved
    1F1B, a lane's microbatches in its first group (Note [chunk loop])."""
    worst = max(lanes, key=lambda t: t.work)
    if schedule is ScheduleKind.ONE_F_ONE_B and limits is not None:
        return _paced_time(schedule, lanes, limits)
    others = stage_max((t for t in lanes if t.stage != worst.stage), lambda t: _fill(schedule, t))
    # Note [fill transfers]: each stage's `one` holds the transfers it receives, so the others' fills miss the
    # bottleneck's own: its first activation in and its last gradient back lie on the fill and drain even where
    # its steady cycle hides them (the part of them its cycle does not already wait for)
    bubble = sum(others.values()) + worst.p2p - worst.p2p_wait
    if schedule is ScheduleKind.INTERLEAVED:
        bubble /= max(chunks, 1)
        bubble += chunk_loop_wait(lanes, worst, chunks, group(worst) if group else worst.microbatches)
    if schedule is ScheduleKind.ZB and limits is not None:
        paced = _paced_time(schedule, lanes, limits)
        if paced.total > worst.work + bubble:
            return paced
    return PipelineTime(worst.work + bubble, worst.work, bubble, (worst.stage, worst.lane))


def chunk_loop_wait(lanes: Sequence[LaneTiming], lane: LaneTiming, chunks: int, group: int) -> float:
    """What `lane` of interleaved 1F1B waits at its chunks' turns for a chunk's loop (`group`: its microbatches in
    its first group).

    Note [chunk loop]: a microbatch comes back to a lane for its next chunk
    only after one chunk of every other stage and a border per stage, the
    loop L (its slowest lane per stage; its border transfers, which the
    lane's thread waits for under interleaved 1F1B, Note [async sends],
    half of them activations and half gradients). Meanwhile the lane runs
    the chunk for the other microbatches of its group, g chunk-ops of c
    seconds in all, so at the turn to the next chunk it waits
    max(0, c + L − g·c): at each of the v − 1 turns of its first group's
    forwards and of its last group's backwards (between groups the lane
    runs the other direction's ops meanwhile). Megatron's grid has g = p
    and L = (p − 1)·c: no wait, the schedule's premise. Where a lane serves
    fewer microbatches than there are stages, or the others are slower,
    the loop shows: random jobs 64/3 (8 stages, 4 microbatches on the
    slowest lanes) and 256/2 (12 stages, 8 and 6 microbatches) ran 21 % and
    36 % longer than the bubble of (p − 1) chunks alone; with the loop
    counted, and their one group's gradient ops back to back behind ZeRO-2's
    reduce-scatters (`classes.lane_timing`'s sweeps), explain is −4.9 % and
    −3.3 % of their compiled steps (benchmarks/plan_agreement.py --jobs 6;
    the planner then gives both ZB-H1 plans that run faster)."""
    if chunks < 2:
        return 0.0
    forward = stage_max(lanes, lambda t: t.forward + t.p2p / 2)
    backward = stage_max(lanes, lambda t: t.backward + t.p2p / 2)
    f = lane.forward + lane.p2p_wait / 2   # the lane's own chunk-ops, its waits half before each direction
    b = lane.cycle - f
    g = min(group, lane.microbatches)
    wait = 0.0
    for own, loop in ((f, forward), (b, backward)):
        others = sum(v for s, v in loop.items() if s != lane.stage)
        wait += max(0.0, own + others - g * own) / chunks
    return (chunks - 1) * wait


def _paced_time(schedule: ScheduleKind, lanes: list[LaneTiming], limits: Mapping[int, int]) -> PipelineTime:
    """1F1B or ZB-H1, paced by the lane whose chain is longest. Note [paced pipeline]: a lane's chain is the
    fill and drain of the stages before it (each its slowest lane's `one`, and its own activation coming in:
    Note [fill transfers]) around its own span, where the stages after it are a round trip that the
    microbatches it keeps in flight hide but for what `round_trip_span` leaves (`_busiest_span`). With equal
    lanes the busiest lane paces; a lane of a later stage serving the microbatches of several earlier lanes
    can pace instead, busy all along while the busiest one waits for it (demo hetero: the last stage's one
    lane serves the two middle lanes' microbatches). Under ZB-H1 a stage before the lane holds its first
    forward and last input gradient on that way (`_zb_way`): a weight gradient, left for later, is not on
    it; ZB-H1's bubble of (F + I − W) per stage, weight gradients filling it, needs more microbatches on a
    lane than stages after it, and where lanes serve few (random job 256/3: 5 stages, 2 microbatches a
    lane) the chain is the longer. The first microbatch fills, and the last drains, through a lane of its stage
    with the most microbatches (`hetc.ir.pipeline.route_microbatches` gives both to such a lane), not through a
    slower lane of fewer (demo hetero: the middle stage's lane of one microbatch, +3.4 % on two shared
    cores)."""
    most = stage_max(lanes, lambda t: t.microbatches)
    # over the lanes the first and the last microbatch go through
    one = stage_max((t for t in lanes if t.microbatches == most[t.stage]),
                    lambda t: _zb_way(t) if schedule is ScheduleKind.ZB else t.one)

    trips = _trips_after(schedule, lanes)

    def chain(t: LaneTiming) -> float:
        fill = sum(v for s, v in one.items() if s < t.stage) + max(0.0, t.p2p - t.p2p_after - t.p2p_wait)
        return fill + _busiest_span(schedule, trips, t, limits)

    pace = max(lanes, key=lambda t: (chain(t), t.work))
    total = chain(pace)
    return PipelineTime(total, pace.work, total - pace.work, (pace.stage, pace.lane))


def stage_max(lanes: Iterable[LaneTiming], value: Callable[[LaneTiming], float]) -> dict[int, float]:
    """Per stage of `lanes`, the largest `value` of its lanes (at least 0)."""
    out: dict[int, float] = {}
    for t in lanes:
        out[t.stage] = max(out.get(t.stage, 0.0), value(t))
    return out


def in_steady_order(schedule: ScheduleKind, counts: Sequence[Sequence[int]]) -> bool:
    """Whether the lanes keep their schedule's steady order, nothing upstream reordering their arrivals
    (Note [async sends] in transfers.py; `counts`: per stage, each lane's microbatches). ZB-H1 runs F, I, W
    of each microbatch in turn where every stage's lanes serve as many microbatches each and each border's
    lane counts divide one another: a lane then trades with the lanes across a border in a fixed rotation
    (one lane feeding four takes their gradients back in the order it sent the activations). Interleaved
    1F1B alternates chunk forwards and backwards as 1F1B does where the lanes line up stage to stage (one lane
    a stage, or every stage the same lanes serving as many microbatches: side-by-side pipelines)."""
    if schedule is ScheduleKind.INTERLEAVED:
        return len({tuple(c) for c in counts}) == 1
    if schedule is not ScheduleKind.ZB:
        return False
    lanes = [len(c) for c in counts]
    return all(len(set(c)) == 1 for c in counts) and \
        all(max(a, b) % min(a, b) == 0 for a, b in pairwise(lanes))


def _zb_way(t: LaneTiming) -> float:
    """A ZB-H1 lane's forward, input gradient and transfers of one microbatch, at the pace its ZeRO collectives
    allow it (`bound` over its thread's cycle: gathers its ops wait for, Note [zero cycle])."""
    pace = t.cycle / t.on_thread if t.on_thread > 0 else 1.0
    return (t.forward + t.input_grad) * pace + t.p2p


def _fill(schedule: ScheduleKind, t: LaneTiming) -> float:
    if schedule is ScheduleKind.ZB:
        return max(0.0, t.forward + t.input_grad + t.p2p - t.weight_grad)
    return t.one


@dataclass(frozen=True, slots=True)
class UnitOp:
    """One compute op of one ZeRO-3 unit as lowering emits it (Note [zero-3 units]): its seconds, its
    parameters' gather (posted when the op before it starts) and the reduce-scatter posted after it (a
    gradient op's; 0 for a forward)."""

    compute: float
    gather: float
    reduce: float = 0.0


def unit_ops(computes: Sequence[tuple[float, float]], collectives: Sequence[tuple[float, float]]) -> tuple[UnitOp, ...]:
    """One microbatch's unit ops in run order (`zero_units.in_run_order`): the forwards in layer order, then
    the backwards in reverse; `computes`: each unit's (F, B) seconds, `collectives`: its (gather, reduce)."""
    pairs = list(zip(computes, collectives, strict=True))
    return (*(UnitOp(f, g) for (f, _), (g, _) in pairs), *(UnitOp(b, g, r) for (_, b), (g, r) in reversed(pairs)))


def _unit_slots(schedule: ScheduleKind, units: Sequence[UnitOp]) -> tuple[list[float], int]:
    """Each unit op's slot on the rank's thread: from its start to the next op's, that op's gather posted when it
    starts (Note [zero cycle]); and how many of them are forwards. In the lane's steady order a microbatch's
    last backward is followed by another's first forward (GPipe: a forward by a forward, a backward by a
    backward)."""
    forwards = len(units) // 2
    seqs = [units[:forwards], units[forwards:]] if schedule is ScheduleKind.GPIPE else [units]
    slots = [max(u.compute, seq[(k + 1) % len(seq)].gather, _held_reduce(seq, k)) for seq in seqs
             for k, u in enumerate(seq)]
    return slots, forwards


def _held_reduce(seq: Sequence[UnitOp], k: int) -> float:
    """What unit op k's slot waits for the reduce-scatter posted after the op before it: lowering waits for it
    before the second gradient op after that one (Note [gradient buffer release] in passes/lower/zero.py), the
    op after k where that is a gradient op (its `reduce`: every ZeRO-3 unit's gradient op reduces one)."""
    return seq[k - 1].reduce if seq[(k + 1) % len(seq)].reduce > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ChunkSweep:
    """An interleaved 1F1B lane whose one group holds all its `microbatches` (Note [chunk loop]): its `chunks`
    and the chunk-steps it runs ahead (`memory.interleaved_warmup`)."""

    microbatches: int
    chunks: int
    warmup: int


@dataclass(frozen=True, slots=True)
class ZeroCycle:
    bound: float   # seconds per microbatch the collectives' waits allow (0: no collectives)
    trail: float   # seconds after the lane's last cycle until its last reduce-scatter is done


def zero_cycle(schedule: ScheduleKind, ops: Sequence[float], p2p_wait: float, reduce: float, gather: float,
               copies: float, shares: tuple[float, float] = (1.0, 1.0), units: Sequence[UnitOp] = (),
               sweep: ChunkSweep | None = None) -> ZeroCycle:
    """A lane's per-microbatch cycle with ZeRO collectives placed as lowering places them.

    Note [zero cycle]: `ops` are one microbatch's compute ops in order (F, B
    or F, I, W), the last one the gradient op. Pass `zero`
    (passes/lower/zero.py, Note [zero placement]) posts each op's ZeRO-3
    gather (`gather` s) when the op before it starts and waits for it right
    before the op, so an op takes max(op, gather) of the rank's time; it
    posts a reduce-scatter (`reduce` s) after each gradient op and waits for
    it before the next gradient op of the ministage. Under 1F1B-like
    schedules the next gradient op comes one cycle later, with the other ops
    running beside the reduction: cycle = max(Σ max(op, gather) + p2p_wait,
    gradient op + reduce), per ministage (`p2p_wait`: what the lane waits
    for its border transfers, Note [async sends] in transfers.py). GPipe
    runs the gradient ops back to back: its backward slot is gradient op +
    reduce. Host copies of offloaded
    parameters (`copies` s) come before their gathers: with them, the
    collectives and copies are counted as one stream beside the compute
    (the model before this note; it fits lowering's offload windows less
    well). After the lane's last gradient op nothing waits for a next one:
    its reduction ends `trail` after the lane's last cycle (at most the
    whole `reduce`, when the cycle does not already hold it). Every number
    is the stage's (all its ministages); `shares` are the fractions of its
    parameters in its first ministage (whose gradient op comes last) and in
    its largest, which the per-ministage reductions scale by (units instead
    of ministages where ZeRO-3 gathers per block, Note [zero-3 units]).
    Where it gathers per block, lowering posts and waits each unit's gather
    around that unit's op (`units`, one microbatch's in run order): a unit
    op then takes max(its compute, the next unit's gather), and a small
    unit (the embedding, the head) cannot hide a block's gather; the last
    microbatch's last op waits for no next gather, and its unit's
    reduction ends the trail.

    `sweep`: an interleaved 1F1B lane holding all its microbatches in one group, timed as GPipe (its gradient
    ops back to back, each after the reduce-scatter before it) but where it only reduce-scatters (ZeRO-2):
    there `_sweep_waits` counts which of its gradient ops wait.
    """
    if reduce <= 0 and gather <= 0 and copies <= 0:
        return ZeroCycle(0.0, 0.0)
    first, largest = shares
    if sweep is not None and gather <= 0 and copies <= 0:
        waits = _sweep_waits(sweep, ops[0], reduce) / sweep.microbatches
        # the last gradient op (the first ministage's) reduces after the lane's last cycle, as GPipe's
        return ZeroCycle(sum(ops) + p2p_wait + waits, max(0.0, first * reduce - waits))
    if sweep is not None:
        schedule = ScheduleKind.GPIPE
    if copies > 0:
        # offloaded parameters: each gather waits for its shard's copy from the host, and lowering's residency
        # windows (passes/lower/offload.py) chain copies and gathers; counted as one stream of all of them
        n_gathers = len(ops) if gather > 0 else 0
        return ZeroCycle(reduce + n_gathers * gather + copies, reduce)
    if units and gather > 0:
        return _unit_cycle(schedule, ops, p2p_wait, reduce, largest, units)
    slots = [max(d, gather) for d in ops]
    grad = ops[-1]
    if schedule is ScheduleKind.GPIPE:
        bound = sum(slots[:-1]) + max(slots[-1], grad + reduce) + p2p_wait
    else:
        bound = max(sum(slots) + p2p_wait, largest * (grad + reduce))
    # the last microbatch's cycle, to the end of its first ministage's reduction
    last = sum(slots) - first * (slots[-1] - grad) + first * reduce + p2p_wait
    return ZeroCycle(bound, max(0.0, last - max(bound, sum(ops) + p2p_wait)))


def _sweep_waits(sweep: ChunkSweep, forward: float, reduce: float) -> float:
    """What a sweeping ZeRO-2 lane (`zero_cycle`) waits for its reduce-scatters in all.

    Note [sweep waits]: lowering runs the lane's forwards while fewer than
    its warm-up w of chunk-steps are in flight (Note [interleaved
    warm-up]): w forwards, then a backward and a forward in turn, then its
    last w backwards back to back, chunk by chunk from the last. A gradient
    op waits for the reduce-scatter of the one before it of its chunk (its
    ministage's gradient buffer, Note [zero cycle]): all of it in the
    cool-down, what the forward between them does not hide in the steady
    turns, nothing at a chunk's first. Each chunk's forward and
    reduce-scatter are taken as the stage's over its chunks. Counting every
    gradient op's wait, as GPipe's, explained random job 69 (4 stages of 2
    chunks, 4 microbatches a lane; its last stage ZeRO-2, whose last chunk
    runs 1F1B's turns) +10.8 % of its compiled step."""
    n, v = sweep.microbatches, sweep.chunks
    total = n * v
    steady = total - min(sweep.warmup, total)   # backward ops a forward follows
    per_chunk, hidden = reduce / v, forward / v
    waits = 0.0
    for j in range(1, total):   # backward j in run order (chunk v-1's n first), its chunk's one before it
        if j % n:
            waits += max(0.0, per_chunk - hidden) if j - 1 < steady else per_chunk
    return waits


def _unit_cycle(schedule: ScheduleKind, ops: Sequence[float], p2p_wait: float, reduce: float, largest: float,
                units: Sequence[UnitOp]) -> ZeroCycle:
    """`zero_cycle` of a stage gathering per block: its unit ops' slots (`_unit_slots`)."""
    slots, forwards = _unit_slots(schedule, units)
    grad = ops[-1]
    if schedule is ScheduleKind.GPIPE:
        bound = sum(slots[:forwards]) + max(sum(slots[forwards:]), largest * (grad + reduce)) + p2p_wait
    else:
        bound = max(sum(slots) + p2p_wait, largest * (grad + reduce))
    last = sum(slots) - (slots[-1] - units[-1].compute) + units[-1].reduce + p2p_wait
    return ZeroCycle(bound, max(0.0, last - max(bound, sum(ops) + p2p_wait)))


def step_lower_bound(schedule: ScheduleKind, lanes: Sequence[LaneTiming], chunks: int = 1,
                     limits: Mapping[int, int] | None = None) -> float:
    """No schedule of these lanes runs its pipeline faster, in the estimate's terms: its floor for the pipeline
    (`classes.compose_step`). The whole step's lower bound, which the compiled program is held to, is
    `step_bound` (docs/costmodel.md, "The lower bound of a step").

    The busiest lane (stage b) is busy `work`, and more where the round
    trip of a microbatch through the stages after it outlasts what the
    microbatches it keeps in flight (`limits`) give it to do meanwhile
    (`round_trip_span`; not under interleaved 1F1B, whose chunks go round
    apart); it cannot start before the
    first microbatch has come through every stage before it (their fastest
    lane's forward and transfers), and after its last op the last gradient
    still goes back through them (input-gradient backward under ZB); under
    interleaved 1F1B only through their first of `chunks` chunks. Nor is
    the pipeline shorter than its busiest lane's last microbatch: the lane
    runs its forwards in order, each at the earliest a forward after the
    one before (under interleaved 1F1B a chunk's), and the last one still
    goes the whole
    way down through every stage and back, with every border's transfer
    both ways (the fastest lane of each stage). That sets a step of few
    microbatches over latency-bound borders, whose transfers lie on the way
    even where the sends overlap the compute (Note [async sends] in
    transfers.py).
    Zorse runs stage by stage, so only the busy time bounds it.
    """
    worst = max(lanes, key=lambda t: t.work)
    if schedule is ScheduleKind.ZORSE:
        return worst.work
    back: Callable[[LaneTiming], float] = \
        (lambda t: t.input_grad) if schedule is ScheduleKind.ZB else (lambda t: t.backward)
    bound = _busiest_span(schedule, _trips_after(schedule, lanes), worst, limits or {})
    for s in {t.stage for t in lanes if t.stage < worst.stage}:
        mine = [t for t in lanes if t.stage == s]
        share = 1 / chunks if schedule is ScheduleKind.INTERLEAVED else 1.0
        bound += (min(t.forward + t.p2p for t in mine) + min(back(t) for t in mine)) * share
    way = sum(min(t.forward + back(t) + t.p2p for t in lanes if t.stage == s) for s in {t.stage for t in lanes})
    pace = worst.forward / (chunks if schedule is ScheduleKind.INTERLEAVED else 1)
    return max(bound, way + (worst.microbatches - 1) * pace)


def _trips_after(schedule: ScheduleKind, lanes: Iterable[LaneTiming]) -> dict[int, float]:
    """Per stage, a microbatch's round trip through the stages after it: each one's fastest lane's share
    (`_round_trip_share`). Found once for all lanes, which a pipeline of thousands of lanes needs: summed lane
    by lane it was quadratic (16,384 GPUs, 12,288 tp-1 lanes: 120 s of a compile)."""
    fastest: dict[int, float] = {}
    for t in lanes:
        share = _round_trip_share(schedule, t)
        fastest[t.stage] = min(fastest.get(t.stage, share), share)
    stages = sorted(fastest)
    return {s: sum(fastest[d] for d in stages if d > s) for s in stages}


def _busiest_span(schedule: ScheduleKind, trips: Mapping[int, float], worst: LaneTiming,
                  limits: Mapping[int, int]) -> float:
    """The busiest lane's span: its work, and the round trips it cannot fill (`round_trip_span`; `trips`:
    `_trips_after`)."""
    if schedule is ScheduleKind.INTERLEAVED:
        return worst.work
    trip = worst.p2p_after + trips[worst.stage]
    n = worst.microbatches
    held = n if schedule is ScheduleKind.GPIPE else min(limits.get(worst.stage, n), n)
    f = worst.forward + worst.p2p_wait / 2   # the lane's waits, half before its forwards, half its backwards
    return max(worst.work, round_trip_span(n, held, f, worst.cycle - f, trip))


def round_trip_span(n: int, held: int, f: float, b: float, trip: float) -> float:
    """A lane's span with a round trip of `trip` after it and at most `held` microbatches in flight: before its
    first backward it runs at most `held` forwards while the first one goes round; after its last forward at
    most `held` − 1 other backwards while that one goes round (disjoint waits when it serves more)."""
    before = max(0.0, f + trip - held * f)
    after = max(0.0, trip - (held - 1) * b)
    return n * (f + b) + (before + after if n > held else max(before, after))


# ------------------------------------------------------------------ in-flight limit


def in_flight_limits(schedule: ScheduleKind, lanes: Sequence[LaneTiming], num_stages: int,
                     coupled: Mapping[int, int] | None = None,
                     lane_counts: Mapping[int, int] | None = None,
                     counts: Sequence[Sequence[int]] | None = None) -> dict[int, int]:
    """Per stage: how many microbatches each lane keeps in flight under 1F1B and ZB-H1 (S − s otherwise).

    Note [in-flight limit]: the one number lowering's schedule
    (passes/lower/schedule.py) holds every lane of the stage to and the
    estimate counts stashed activations with. A microbatch stays in flight
    on a lane from its forward to its last backward op: the lane's own
    forward and backward plus the round trip R through every stage after it
    (the forward and input-gradient backward of one microbatch on that
    stage's slowest lane, and every border after the lane crossed both ways;
    the transfers lie on that way even where the sends overlap the compute,
    Note [async sends]). The pipeline runs at
    its busiest lane's pace: over the step (T* busy seconds) a lane serving
    n microbatches starts one every T*/n, so by Little's law it keeps
    ⌈(own + R) / (T*/n)⌉ in flight not to wait. With equal lanes that is
    Megatron's S − s, never less, and one more than the stage after it
    where their lanes line up (`_held_upstream`); a stage of few fast lanes feeding many
    slower ones (uneven lanes, Zorse's heterogeneous pipelines) needs more,
    and held to S − s it would idle most of the step. Lanes of a stage keep
    one limit (ZeRO-2/3 couples them), the largest any of them needs.
    Interleaved 1F1B keeps Megatron's S − s: its warm-up is counted per
    group (`memory.interleaved_warmup`, Note [interleaved warm-up] in
    passes/lower/schedule.py), and a lane held further ahead waits for the
    stages after it in its strict order. Under ZB-H1
    a stage with stages after it, its lanes not in lockstep, keeps one more:
    Little's law gives the mean, and a weight gradient in the lane's cycle
    or a lockstep slot's late microbatch makes a round trip run long; with
    the one more stash the lane runs a forward or a weight gradient
    meanwhile instead of idling (measured on the agreement family:
    tests/test_step_bound.py). So does a last stage of fewer lanes than the
    stage before it: each of its lanes takes the microbatches of several
    upstream lanes, which arrive together, and held to one in flight it ran
    each one's weight gradient before the next one's forward and input
    gradient, so the gradients the upstream lanes drain with came back one
    whole cycle apart (random job 48: 1.051 s, 1.015 s with the one more;
    with equal lane counts the one more stash bought nothing and ran
    longer on jobs 56 and 84). The margin is one microbatch for each lane
    a lane's microbatches spread over at the widest stage after it
    (`_fan_out`: k = ⌈L_d / L_s⌉): a lane feeding k lanes of a later stage
    keeps one queued for each, not one for them all. Held to one, the fast
    stages in front of a wider bottleneck starved it: in
    specs/zorse/c_auto.het 8 A10G lanes feed 24 T4 lanes, every A10G lane
    sat at its limit waiting for a gradient while the T4 lane it fed next
    waited for its input (62.0 s, 58.1 s with k = 3; explain says 55.1 s).
    Keeping 5 more there runs 55.0 s: a saturated lane answers a returning
    gradient only at its next slot, so a round trip is longer than the trips
    Little's law sums; not counted. Lanes in lockstep run what their slot
    allows and seldom reach it, so the estimate's memory would count a stash
    they never hold. Nor does a stage of k times the lanes of the one before
    it (every lane of both serving as many microbatches) keep the margin:
    each of its lanes takes every k-th microbatch of the one lane feeding it,
    which keeps one queued for it already. Under the GEMM curve random job
    23's two lanes behind one held 4 and 3 with the margin (the estimate
    counted 4 on both: +11.3 % on the second) and run the same 23.51 s step
    holding 3. Where the counts do not divide, a lane takes microbatches of
    several feeders, unevenly, and keeps its own: benchmarks/planner.py's
    1,024-GPU ZB plan (88 A100 lanes feeding 384 V100 lanes) compiled to
    1.173 s without it, 0.944 s with it. Lanes in lockstep that feed a
    lockstep stage of more lanes keep one more (`_feeds_wider_slots`): each
    slot there takes several microbatches of every one of them at once, and
    held to Little's mean they sent the second only as a gradient came back
    (random job 4: two A100 lanes of ZeRO-3 feeding four L4 lanes, their
    limit 5 of 16; every L4 slot waited 70-170 ms, 7.60 s a step against the
    6.84 s counted; holding 6 it runs 6.95 s; 7, no faster, overfills the A100).
    Last, no lane holds more than the lanes before it let it (`chain_held`,
    from each stage's lanes' counts): a microbatch in flight here is in
    flight on every lane it passed, so a lane fed by one of two lanes in
    turn holds about half its feeder's limit. Each rule above reads one
    stage or a pair; the chain does not (random job 22, stages of 1, 1, 2,
    3 and 3 lanes: the fourth stage's lanes asked for 3 and held 2, its
    memory counted +18.5 % of the compiled peak).

    `coupled`: stage -> its lanes, for stages whose lanes run in lockstep
    (Note [coupled lanes] in passes/lower/lane_sim.py): such a stage runs
    its k-th microbatch on every lane at once, so a microbatch coming from
    the stage before it (of `lane_counts` lanes) also waits for the
    L_d / L_{d−1} − 1 others of its slot, one period of that stage apart,
    and its slot's gradients come back from a stage after it of fewer lanes
    in the same way. `counts`: per stage, its lanes' microbatches, which
    bound each limit along the chain (`chain_held`); without them, each
    stage's rules alone.
    """
    stages = range(num_stages)
    if schedule not in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB) or not lanes:
        return {s: num_stages - s for s in stages}
    trip = {s: max((_round_trip_share(schedule, t) for t in lanes if t.stage == s), default=0.0)
            for s in stages}
    busiest = max(t.work for t in lanes)
    for d, width in (coupled or {}).items():
        trip[d] += _slot_wait(lanes, lane_counts, width, d - 1, _period(busiest))   # its slot fills from the stage before
        if d + 1 < num_stages:   # and its slot's gradients come back from the stage after
            trip[d + 1] += _slot_wait(lanes, lane_counts, width, d + 1, _period(busiest))
    out, most = {}, {}
    for s in stages:
        after = sum(trip[d] for d in range(s + 1, num_stages))
        mine = [t for t in lanes if t.stage == s]
        needed = max(math.ceil((_in_flight_own(t) + after) * t.microbatches / busiest * (1 - 1e-9))
                     if busiest > 0 else 1
                     for t in mine)
        most[s] = max(t.microbatches for t in mine)
        out[s] = max(num_stages - s, min(needed, most[s]))
    _held_upstream(out, most, lanes, num_stages)
    if schedule is ScheduleKind.ZB:
        for s in stages:
            if s not in (coupled or {}) and not _fed_in_rotation(lanes, lane_counts, s) and \
                    (s + 1 < num_stages or _fans_in(lane_counts, s)):   # Note [in-flight limit]
                out[s] = min(out[s] + _fan_out(lane_counts, s, num_stages), most[s])
            elif _feeds_wider_slots(coupled, lane_counts, s):
                out[s] = min(out[s] + 1, most[s])
    if counts is not None:
        out = dict(enumerate(chain_held(tuple(map(tuple, counts)), tuple(out[s] for s in stages))))
    return out


@lru_cache(maxsize=4096)
def chain_held(counts: tuple[tuple[int, ...], ...], limits: tuple[int, ...]) -> tuple[int, ...]:
    """Each stage's limit lowered to the most microbatches the stages before it let one of its lanes hold
    (Note [in-flight limit]); `counts`: per stage, its lanes' microbatches (routed by `route_microbatches`).

    A microbatch in flight on a lane is in flight on every lane it passed before (its backward there comes
    after its backward here), and a lane's microbatches in flight are consecutive ones of its own route. So
    a lane holds k of its microbatches at once only where, on every stage before it, those of them that one
    lane passed lie within that lane's limit of consecutive ones. A lane fed by one of two lanes in turn
    holds about half its feeder's limit: in random job 22 (stages of 1, 1, 2, 3 and 3 lanes) the fourth
    stage's lanes held 3 by the rules above, 2 in their compiled programs, as their feeders let them.
    Stages of the same counts route alike, so one of them only caps a later one at its own limit."""
    held = list(limits)
    for s in range(1, len(counts)):
        feeders: dict[tuple[int, ...], int] = {}   # the earlier stages' counts -> their lowest limit
        for u in range(s):
            feeders[counts[u]] = min(held[u], feeders.get(counts[u], held[u]))
        held[s] = min(held[s], feeders.pop(counts[s], held[s]))
        if held[s] > 1 and feeders:
            where = [(_positions(c), limit) for c, limit in feeders.items()]
            held[s] = max(_longest_window(route, where, held[s]) for route in route_microbatches(list(counts[s])))
    return tuple(held)


@lru_cache(maxsize=256)
def _positions(counts: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """Microbatch -> (its lane, its position in that lane's route), for lanes of these counts."""
    return {mb: (lane, i) for lane, route in enumerate(route_microbatches(list(counts))) for i, mb in enumerate(route)}


def _longest_window(route: list[int], feeders: list[tuple[dict[int, tuple[int, int]], int]], most: int) -> int:
    """The most consecutive microbatches of `route`, up to `most`, that lie, on every earlier stage (`feeders`:
    where each microbatch sat there and that stage's limit), within the limit of each lane that passed them."""
    # (feeder, lane) -> positions there of the window's microbatches
    held: defaultdict[tuple[int, int], deque[int]] = defaultdict(deque)
    start = best = 0
    for end, mb in enumerate(route):
        for u, (where, limit) in enumerate(feeders):
            lane, pos = where[mb]
            window = held[u, lane]
            while window and pos - window[0] + 1 > limit:
                for v, (earlier, _) in enumerate(feeders):   # drop the window's first microbatch everywhere
                    held[v, earlier[route[start]][0]].popleft()
                start += 1
        for u, (where, _) in enumerate(feeders):
            held[u, where[mb][0]].append(where[mb][1])
        best = max(best, end - start + 1)
        if best >= most:
            break
    return best


def _feeds_wider_slots(coupled: Mapping[int, int] | None, lane_counts: Mapping[int, int] | None, stage: int) -> bool:
    """Lockstep lanes feeding a lockstep stage of more lanes, whose every slot takes several microbatches of
    each of them at once (Note [in-flight limit])."""
    if not coupled or lane_counts is None:
        return False
    return stage in coupled and stage + 1 in coupled and lane_counts[stage + 1] > lane_counts[stage]


def _held_upstream(limits: dict[int, int], most: Mapping[int, int], lanes: Sequence[LaneTiming],
                   num_stages: int) -> None:
    """Raise each stage's limit above the next one's where their lanes line up (Note [in-flight limit]).

    A microbatch in flight on a lane is in flight on the lane that fed it as well (its backward there comes
    after its backward here), and so is the one the lane waits for next; so where each lane of a stage is
    fed by one lane of the stage before it (as many lanes, serving as many microbatches), that lane keeps one
    more than its limit or the stage after it never reaches its own, and each of its forwards waits for a
    round trip through both. Little's law can ask a stage for as many as the one before it: random deep job
    8 (one tp-4 lane a stage; the last stage's forward and backward the slowest) asked its sixth stage for 3
    beside the fifth's 3, and the compiled step ran 23.1 ms against the 13.6 ms the closed form counts."""
    for s in range(num_stages - 1, 0, -1):
        if _lined_up(lanes, s - 1, s):
            limits[s - 1] = min(max(limits[s - 1], limits[s] + 1), most[s - 1])


def _lined_up(lanes: Sequence[LaneTiming], a: int, b: int) -> bool:
    """Stages `a` and `b` have as many lanes, serving as many microbatches each."""
    return sorted(t.microbatches for t in lanes if t.stage == a) == sorted(t.microbatches for t in lanes if t.stage == b)


def _fan_out(lane_counts: Mapping[int, int] | None, stage: int, num_stages: int) -> int:
    """The most lanes of one later stage that one lane of `stage` feeds (at least 1): a later stage of k times
    its lanes spreads each lane's microbatches over k of them (Note [in-flight limit])."""
    if lane_counts is None:
        return 1
    return max([1] + [-(-lane_counts[d] // lane_counts[stage]) for d in range(stage + 1, num_stages)])


def _fed_in_rotation(lanes: Sequence[LaneTiming], lane_counts: Mapping[int, int] | None, stage: int) -> bool:
    """Each lane of the stage is fed by one lane of the stage before it, which feeds k of them in turn and
    keeps the margin for them (`_fan_out`): k times its lanes, every lane of both serving as many."""
    if lane_counts is None or stage == 0 or lane_counts[stage] <= lane_counts[stage - 1] or \
            lane_counts[stage] % lane_counts[stage - 1]:
        return False
    return all(len({t.microbatches for t in lanes if t.stage == s}) == 1 for s in (stage - 1, stage))


def _fans_in(lane_counts: Mapping[int, int] | None, stage: int) -> bool:
    """The stage has fewer lanes than the one before it: each of its lanes serves several upstream lanes."""
    return lane_counts is not None and stage > 0 and lane_counts[stage] < lane_counts[stage - 1]


def lockstep_fill(schedule: ScheduleKind, lanes: Sequence[LaneTiming], num_stages: int,
                  coupled: Mapping[int, int], lane_counts: Mapping[int, int]) -> float:
    """The fill and drain that lockstep stages add to the bubble under 1F1B-like schedules: their first
    slot waits for its microbatches to arrive, their last one for its gradients to come back
    (`in_flight_limits`), and a stage of fewer lanes before them takes the last slot's gradients together,
    each of its lanes running its k backward ops one after another before the last leaves it (random jobs
    0 and 4, two lanes feeding eight and four in lockstep: explained −8.6 % and −1.7 % of their compiled
    steps without it, +2.8 % and +0.1 % with it). GPipe runs every forward before any backward: the waits
    hide in that.

    Unlike the steady slots, which wait a period of the stage of fewer lanes per further microbatch, the first
    slot's microbatches come one forward apart: that stage runs its warm-up forwards back to back; and the last
    slot's gradients one backward apart, as the stage after drains (an input gradient under ZB-H1, whose weight
    gradients wait). Counted a period each, random job 97 (a 1-lane stage of 16 microbatches before a ZeRO-3
    stage of 2 lanes, under ZB-H1) was explained +10.7 % of its compiled step, +6.4 % with ZeRO-1."""
    if not lanes or schedule is ScheduleKind.GPIPE:
        return 0.0
    drained: Callable[[LaneTiming], float] = \
        (lambda t: t.input_grad) if schedule is ScheduleKind.ZB else (lambda t: t.backward)
    return sum(_slot_wait(lanes, lane_counts, width, d - 1, _slowest(lambda t: t.forward)) +
               _slot_wait(lanes, lane_counts, width, d - 1, _slowest(drained)) +
               (_slot_wait(lanes, lane_counts, width, d + 1, _slowest(drained)) if d + 1 < num_stages else 0.0)
               for d, width in coupled.items())


def _slot_wait(lanes: Sequence[LaneTiming], lane_counts: Mapping[int, int] | None, width: int, other: int,
               apart: Callable[[Sequence[LaneTiming]], float]) -> float:
    """What a microbatch of a lockstep stage of `width` lanes waits for the rest of its slot to pass through
    stage `other` of fewer lanes: `apart(its lanes)` per further microbatch."""
    mine = [t for t in lanes if t.stage == other]
    if not mine or not lane_counts or width <= lane_counts[other]:
        return 0.0
    return (width / lane_counts[other] - 1) * apart(mine)


def _period(busiest: float) -> Callable[[Sequence[LaneTiming]], float]:
    """A stage's lanes' steady period: the busiest lane's work over the most microbatches one of them serves."""
    return lambda mine: busiest / max(t.microbatches for t in mine)


def _slowest(op: Callable[[LaneTiming], float]) -> Callable[[Sequence[LaneTiming]], float]:
    """A stage's lanes' `op`, its slowest lane's: how far apart they send while they fill or drain."""
    return lambda mine: max(op(t) for t in mine)


def _in_flight_own(t: LaneTiming) -> float:
    """A microbatch's own time in flight on the lane: its forward, backward, and the crossing of the borders after
    it that the later stages' shares of the round trip do not count (`_round_trip_share` counts one each)."""
    return t.forward + t.backward + t.p2p_after


def _round_trip_share(schedule: ScheduleKind, t: LaneTiming) -> float:
    """What one microbatch spends in this lane on its way down and back (the gradient leaves after I)."""
    back = t.input_grad if schedule is ScheduleKind.ZB else t.backward
    return t.forward + back + t.p2p


# ------------------------------------------------------------------ interleaved groups


class Grouping(StrEnum):
    """How interleaved 1F1B groups a lane's microbatches (Note [interleaved groups] in passes/lower/schedule.py)."""

    DEPTH_FIRST = "depth-first"       # Megatron's: p microbatches of every first-stage lane in a group
    BREADTH_FIRST = "breadth-first"   # one group of every microbatch: each chunk of all of them, then the next


def interleaved_groups(first: Mapping[int, int], mbs: Sequence[int], group: int) -> list[list[int]]:
    """A lane's microbatches `mbs` in interleaved 1F1B's groups, in order (Note [interleaved groups] in
    passes/lower/schedule.py): a microbatch's group is its position in its lane of the first stage
    (`first`, `hetc.ir.pipeline.first_positions`) over `group`. Lanes in lockstep must get groups of the
    same sizes (`validate_plan`); the planner keeps to that (passes/plan/structures.py)."""
    def of(mb: int) -> int:
        return first[mb] // group

    return [list(chunk) for _, chunk in groupby(sorted(mbs, key=lambda mb: (of(mb), mb)), key=of)]


def group_width(num_stages: int, first_microbatches: int) -> int:
    """Microbatches of a first-stage lane (of n₀, `first_microbatches`) in each depth-first group of interleaved
    1F1B (Note [interleaved groups]): Megatron's p where p divides n₀; else the fewest equal groups wider than p
    that split n₀ (n₀ = 32 over p = 13: two of 16; 36 over 7: four of 9; torch's flexible interleaved
    schedule tries ⌊n₀/p⌋ of them only), and p with a last, partial group where none do (or where n₀ < 2p:
    one group of all is the breadth-first grouping, chosen on time, `interleaved_grouping`).

    Megatron's order over a partial last group can wait on itself: deep TP job 10 of the agreement family
    (13 stages, 32 microbatches in groups of 13, 13 and 6) had stage 0 hold its next forward, the last
    group's second chunk, for the last stage, which held its backward for stage 0's of a chunk stage 0 had
    not reached; lowering fell back to "a backward whenever one is ready" and the estimate, which keeps
    Megatron's order, counted 11 % more memory than the program held. Where it runs, the partial group's
    turn is idle time: deep4 (7 stages, 36 microbatches) ran 20.1 ms in groups of 7 with a last of 1, 18.3 ms
    in four of 9; random job 79 (5 stages, 16) went from 1.147 to within 1.10 of its step's lower bound."""
    for rounds in range(first_microbatches // num_stages, 1, -1):
        if first_microbatches % rounds == 0:
            return first_microbatches // rounds
    return num_stages


def interleaved_grouping(schedule: ScheduleKind, lanes: Sequence[LaneTiming], num_stages: int, chunks: int,
                         first_microbatches: int) -> Grouping:
    """Breadth-first where a group of p does not last a chunk's loop, else Megatron's depth-first groups
    (Note [interleaved groups]); `first_microbatches`: the most microbatches of a first-stage lane.

    A group is p chunk-steps of every lane at the busiest lane's pace, p·T*/(n₀·v) (each lane's share of
    it takes the same time); a chunk's loop from a lane back to it is one chunk of every other stage's
    slowest lane, forward or backward, and every border once (Σ P / v)."""
    if schedule is not ScheduleKind.INTERLEAVED or chunks < 2 or not lanes:
        return Grouping.DEPTH_FIRST
    slowest = {s: max((t for t in lanes if t.stage == s), key=lambda t: t.forward + t.backward)
               for s in dict.fromkeys(t.stage for t in lanes)}
    borders = sum(max(t.p2p for t in lanes if t.stage == s) for s in slowest)
    loop = max(max(sum(t.forward for d, t in slowest.items() if d != s),
                   sum(t.backward for d, t in slowest.items() if d != s)) for s in slowest)
    group = num_stages * max(t.work for t in lanes) / max(first_microbatches, 1)
    return Grouping.BREADTH_FIRST if loop + borders > group else Grouping.DEPTH_FIRST


# ------------------------------------------------------------------ Zorse


@dataclass(frozen=True)
class UnitLane:
    microbatches: tuple[int, ...]
    forward: float       # per microbatch, including exposed boundary copies
    backward: float      # per microbatch, including recomputation
    p2p_out: float = 0.0   # per microbatch: the activation to the next unit (forward)
    p2p_back: float = 0.0  # per microbatch: the gradient to the previous unit (backward)

    @classmethod
    def of(cls, microbatches: tuple[int, ...], forward: float, backward: float, boundary_copy: float,
           p2p_out: float, p2p_back: float) -> UnitLane:
        """With activations offloaded, the boundary activation goes to the host after the forward and
        comes back for the backward (`boundary_copy` seconds each way) beside the compute; the
        backward's rerun of the ministage is in its compute time."""
        return cls(microbatches, max(forward, boundary_copy), max(backward, boundary_copy), p2p_out, p2p_back)

    def serving(self, microbatches: tuple[int, ...]) -> UnitLane:
        """The same lane timing for another lane of its class, which serves `microbatches` (`replace`, without
        its cost: a stage asks it of every lane)."""
        return UnitLane(microbatches, self.forward, self.backward, self.p2p_out, self.p2p_back)


@dataclass(frozen=True)
class Unit:
    """One ministage: its stage and lanes, and what it costs once per step."""

    stage: int
    lanes: tuple[UnitLane, ...]
    fetch: float = 0.0      # bring its parameters in (ZeRO-3 gather, host copy): prefetched
    sync: float = 0.0       # reduce its gradients after its backward: beside later compute
    step: float = 0.0       # its optimizer step, on the device or the host: on the rank's thread either way
    publish: float = 0.0    # the gather of its stepped shard (ZeRO-1/2), after its step: not in `sync`

    @classmethod
    def of(cls, stage: int, lanes: tuple[UnitLane, ...], fetch: float, numel: float, stage_numel: float,
           sync: float, step: float, publish: float = 0.0) -> Unit:
        """A ministage of `numel` parameters of its stage's `stage_numel`: its own gradient sync (`sync`, a
        collective of its own), its share of the stage's optimizer step (`step`) and the gather that
        publishes the stepped shard after it (`publish`)."""
        ratio = numel / max(stage_numel, 1.0)
        return cls(stage, lanes, fetch, sync, step * ratio, publish)


def sequential_time(units: list[Unit], num_microbatches: int, steps_at_end: bool = False) -> float:
    """Zorse: each unit runs all its microbatches forward, then the next; backward in reverse.

    A stage starts fetching a unit's parameters when it starts the unit
    before it (one unit of prefetch) and syncs a unit's gradients on its
    communication stream after its backward. Its optimizer step waits for
    that sync one compute op longer, as lowering places it (Note [zero
    placement] in passes/lower/zero.py): after each lane's first op of the
    stage's next unit, so the sync overlaps that op; the stage's last unit
    steps right after its sync (`steps_at_end`: every step after every
    unit's sync, as with gradient clipping). Under ZeRO-1/2 the gather that
    publishes a stepped shard (`Unit.publish`) follows its step on the
    communication stream, beside the next ops, as lowering posts it; it was
    counted in the sync before the step (tests/specs/zorse_host_step.het:
    8.0 s explained, 7.23 s compiled; now 7.38 s). An optimizer on the host steps
    on the rank's thread too, as the runtime runs it (Note [optimizer
    offload] in runtime/buffers.py): counted beside the compute, a random
    planned job (Zorse, ZeRO-2, 6 B parameters a rank stepped by the host's
    Adam) explained 12.7 s of a compiled step of 23.6 s.
    """
    stage_free: dict[int, float] = {}
    stage_started: dict[int, float] = {}
    stepped: dict[int, float] = {}                 # stage -> when its last step taken ended
    comm_free: dict[int, float] = {}
    pending: dict[int, Unit] = {}                  # stage -> its unit whose step waits for its sync
    arrive = [0.0] * num_microbatches
    for unit in units:
        arrive = _run(unit, arrive, stage_free, stage_started, forward=True)
    last = {unit.stage: unit for unit in units}   # each stage's last unit: its backward sweep keeps the gather
    for unit in reversed(units):
        before = pending.pop(unit.stage, None)
        step = None if before is None else (comm_free[unit.stage], before.step)
        arrive = _run(unit, arrive, stage_free, stage_started, forward=False, step=step,
                      kept=last.pop(unit.stage, None) is unit, stepped=stepped)
        comm = comm_free.get(unit.stage, 0.0)
        if before is not None:   # the stepped shard's gather, posted after the step, before this unit's sync
            comm = max(comm, stepped[unit.stage]) + before.publish
        end = stage_free[unit.stage]
        comm_free[unit.stage] = max(comm, end) + unit.sync + (unit.publish if steps_at_end else 0.0)
        if not steps_at_end:
            pending[unit.stage] = unit
    for stage, unit in pending.items():
        stage_free[stage] = max(stage_free[stage], comm_free[stage]) + unit.step
        comm_free[stage] = stage_free[stage] + unit.publish
    if steps_at_end:   # every stage's steps after the last sync of the step (the global norm)
        synced_all = max([*stage_free.values(), *comm_free.values()])
        return synced_all + max(sum(u.step for u in units if u.stage == s) for s in stage_free)
    return max([*stage_free.values(), *comm_free.values()])


def _run(unit: Unit, arrive: list[float], stage_free: dict[int, float], stage_started: dict[int, float],
         forward: bool, step: tuple[float, float] | None = None, kept: bool = False,
         stepped: dict[int, float] | None = None) -> list[float]:
    """One sweep of `unit` over its lanes' microbatches. Its parameters come in (`fetch`) from when the
    stage's previous sweep started its first op on every lane (lowering posts the gather there; `kept`:
    the sweep before was this unit's own, whose gather it keeps). `step`: (when the stage's previous
    unit's sync is done, its optimizer step), taken after each lane's first op; `stepped[stage]`: when
    the last lane's step ended."""
    free = stage_free.get(unit.stage, 0.0)
    start = free if kept else max(free, stage_started.get(unit.stage, 0.0) + unit.fetch)
    out = list(arrive)
    end_all, first_op = start, start
    for lane in unit.lanes:
        per = lane.forward if forward else lane.backward
        t = start
        for k, j in enumerate(lane.microbatches):
            t = max(t, arrive[j])
            if k == 0:
                first_op = max(first_op, t)
            t += per
            out[j] = t + (lane.p2p_out if forward else lane.p2p_back)
            if k == 0 and step is not None:
                t = max(t, step[0]) + step[1]
                if stepped is not None:
                    stepped[unit.stage] = max(stepped.get(unit.stage, 0.0), t)
        end_all = max(end_all, t)
    stage_started[unit.stage] = first_op
    stage_free[unit.stage] = end_all
    return out
