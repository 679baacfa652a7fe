"""Structures and their plans: the machinery the search runs on.

A `Structure` fixes the idle GPUs, the stage layout (with its TP degree),
the schedule and the micro-batch size. `Structures` enumerates them,
tabulates each stage's options (cached on what they depend on), runs the
fast assignment over windows of layer counts, turns assignments into
candidates (`spread` routes the microbatches, or a written routing does)
and scores candidates exactly (`evaluate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

from hetc.passes.cost import Profiles
from hetc.passes.cost.intra_lane import tp_degrees
from hetc.passes.plan.assign import Assignment, assign_fast
from hetc.passes.plan.candidate import Candidate, Knobs, Offload, StageGpus
from hetc.passes.plan.deadline import Deadline
from hetc.passes.plan.grid import grid_counts, layer_grain, residues
from hetc.passes.plan.primitives import Primitives
from hetc.passes.plan.candidate_score import Score, evaluate
from hetc.passes.plan.layouts import Layout, group_size, group_speed, layouts
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.partition import bandwidth_domains
from hetc.passes.plan.routing import spread
from hetc.passes.plan.space import CHECKPOINTS, SearchSpace, knob_options
from hetc.passes.plan.candidate_view import ResolvedStage
from hetc.passes.plan.stages import StageRule, written_counts
from hetc.passes.plan.tables import Option, StageTable, holds_all, placeable, stage_costs, stage_option
from hetc.passes.plan.views import Resolver, view_of
from hetc.ir.pipeline import first_positions, route_microbatches
from hetc.ir.spec import Checkpointing, ModelSpec, Objective, ScheduleKind, ZeroShard
from hetc.passes.cost.schedule import group_width, interleaved_groups
from hetc.ir.topology import Gpu
from hetc.ir.plan import Job
from hetc.ir.geometry import uneven_node_shards
from hetc.passes.validate_runtime import ties_in_one_ministage

__all__ = ["Found", "SearchLimits", "Structure", "Structures", "base_knobs"]


@dataclass(frozen=True)
class SearchLimits:
    """How wide each step looks. Large clusters cost more per plan scored, so they look narrower."""

    exhaustive: int = 200     # at most this many structures: configure every one, skip steps 1 to 3
    quick_layouts: int = 48   # more layouts than this: a quick look keeps this many for step 1
    layouts: int = 12         # layouts kept after step 1
    structures: int = 10      # structures kept after step 2
    refine: int = 3           # best configured structures refined by CP-SAT and local search
    local_evaluations: int = 80   # exact scores per local search
    exact_screen: bool = True     # rank steps 1 and 2 by exact scores (else by the assignment model)
    window: int = 4           # layer counts tried each side of a stage's share, at first (half when coarse)
    cpsat_work: float = 0.5     # CP-SAT's deterministic time per model
    workers: int = 1            # processes scoring structures: 2 forks a worker (Note [a forked worker])

    @classmethod
    def for_cluster(cls, num_gpus: int, units: int) -> SearchLimits:
        if num_gpus <= SMALL_CLUSTER and units <= SMALL_MODEL:
            return cls()
        return cls(exhaustive=0, quick_layouts=16, layouts=4, structures=6, refine=3, local_evaluations=12,
                   exact_screen=False, window=2, cpsat_work=0.25, workers=2)


# Beyond either, exact scores cost more than the assignment model's: rank by the model, score the best.
SMALL_CLUSTER = 32   # GPUs
SMALL_MODEL = 48     # layer units


@dataclass(frozen=True)
class Structure:
    idle: tuple[str, ...]
    layout: Layout
    schedule: ScheduleKind
    micro_batch: int
    interleave: int = 0


@dataclass(frozen=True)
class Found:
    candidate: Candidate
    score: Score
    structure: Structure | None   # None: a baseline, found outside the search


class Structures:
    def __init__(self, job: Job, profiles: Profiles | None, space: SearchSpace, goal: Goal,
                 limits: SearchLimits | None = None, deadline: Deadline | None = None, fill: float = 1.0,
                 options_to_fill: bool = False):
        self.job, self.spec, self.topo = job, job.spec, job.topology
        self.space, self.goal, self.profiles = space, goal, profiles
        topo = job.topology
        self.deadline = deadline or Deadline.after(None)   # Note [an anytime search] in deadline.py
        self.until = self.deadline   # where the option tables of the work in hand stop (that step's share)
        self.model: ModelSpec = job.model
        self.limits = limits or SearchLimits.for_cluster(topo.num_gpus, job.model.num_model_layers)
        self.resolve = Resolver(topo)
        self.prims = {b: Primitives(job, profiles, b, fill, options_to_fill) for b in space.micro_batches}
        self.units = job.model.num_model_layers
        self.grain = layer_grain(job.model.layers)   # Note [a grid of layer counts] in grid.py
        # options by what they depend on (`_key`)
        self._options: dict[tuple[object, ...], Option | None] = {}
        self._holds: dict[tuple[object, ...], bool] = {}   # the same key: `_holds_all`

    def layouts(self) -> Iterator[tuple[tuple[str, ...], Layout]]:
        for idle in self.space.idle_sets:
            for layout in self.layouts_of(idle):
                yield idle, layout

    def layouts_of(self, idle: tuple[str, ...]) -> Iterator[Layout]:
        """The stage layouts of the node groups `idle` leaves (the written stages' where they write ranks)."""
        rules = self.space.stages
        if rules is not None and rules[0].gpus is not None:
            yield tuple(r.gpus for r in rules if r.gpus is not None)   # all or none: stage_rules
            return
        used = [g for g in self.topo.groups if g not in idle]
        if used:
            max_stages = min(self.space.max_stages, self.units)
            for layout in layouts(self.topo, bandwidth_domains(self.topo, used), max_stages, self.model.dtype):
                if rules is None or len(layout) == len(rules):
                    yield layout

    def rule(self, s: int) -> StageRule | None:
        return None if self.space.stages is None else self.space.stages[s]

    def variants(self, idle: tuple[str, ...], layout: Layout, schedules: Iterable[ScheduleKind],
                 micro_batches: Iterable[int],
                 tps: tuple[int, ...] = (1,)) -> Iterator[Structure]:
        for tp in tps:
            shaped = self._with_tp(layout, tp)
            if shaped is None:
                continue
            for b in micro_batches:
                if max(st.num_lanes for st in shaped) > self.prims[b].num_microbatches:
                    continue
                for schedule in schedules:
                    if schedule is ScheduleKind.INTERLEAVED and (len({st.num_lanes for st in shaped}) > 1 or
                                                                 ties_in_one_ministage(self.model, len(shaped))):
                        continue   # Note [interleaved lanes]; a tied embedding and head in one stage: one chunk
                    for v in (self.space.interleave if schedule is ScheduleKind.INTERLEAVED else (0,)):
                        if not v or len(shaped) * v <= self.units:
                            yield Structure(idle, shaped, schedule, b, v)

    def _with_tp(self, layout: Layout, tp: int) -> Layout | None:
        """The layout with lanes of `tp` GPUs, if every TP group fits in one node and splits the heads."""
        tps = [r.tp if (r := self.rule(s)) is not None and r.tp else tp for s in range(len(layout))]
        if all(st.tp == t for st, t in zip(layout, tps)):
            return layout
        for st, t in zip(layout, tps):
            if any(b.gpu_start % t or (b.gpu_stop - b.gpu_start) % t for b in st.blocks):
                return None
            lane = self.resolve(StageGpus(st.blocks, 1)).gpus[:t]
            if t not in tp_degrees(self.model, self.topo, lane):
                return None
        return tuple(StageGpus(st.blocks, t) for st, t in zip(layout, tps))

    # ------------------------------------------------------------ tables

    def _limits(self, st: Structure) -> list[int]:
        """The most layer units each stage may own (the others need one each; middle stages no embed/head)."""
        n = len(st.layout)
        most = self.units - (n - 1)
        return [most if s in (0, n - 1) else min(most, self.units - 2) for s in range(n)]

    def _fixed_layers(self, s: int) -> int | None:
        rule = self.rule(s)
        return None if rule is None else rule.layers

    def counts(self, st: Structure, s: int, lo: int, hi: int) -> range:
        """Stage s's layer counts in [lo, hi] that the search weighs (Note [a grid of layer counts])."""
        if self.grain == 1 or self._fixed_layers(s) is not None:
            return range(lo, hi + 1)
        fixed = [self._fixed_layers(i) for i in range(len(st.layout))]
        return grid_counts(lo, hi, self.grain, residues(fixed, self.units, self.grain)[s])

    def _speeds(self, st: Structure) -> list[float]:
        dtype = self.model.dtype
        return [sum(group_speed(self.topo, b.group, dtype) * b.size / group_size(self.topo, b.group)
                    for b in stage.blocks) for stage in st.layout]

    def _centres(self, st: Structure) -> list[int]:
        """Each stage's share of the units by its GPUs' speed."""
        speeds = self._speeds(st)
        return [max(1, round(self.units * v / sum(speeds))) for v in speeds]

    def _table(self, st: Structure, s: int, layers: Iterable[int], knobs: list[Knobs],
               fallback: Knobs | None = None) -> StageTable:
        """Stage s's options for these layer counts; `fallback` only where none of `knobs` fits in memory."""
        res = self.resolve(st.layout[s])
        table = StageTable(s, res)
        neighbours = self.neighbours(st, s)
        for n in layers:
            if self.until.passed():   # Note [an anytime search]: a table as far as it got
                break
            got = self._options_at(st, s, n, knobs, res, neighbours)
            if fallback is not None and not self._roomy(st, s, n, knobs, got, res, neighbours):
                got.append(self._option(st, s, n, fallback, res, neighbours))
            table.options += [o for o in got if o is not None]
        return table

    def _options_at(self, st: Structure, s: int, n: int, knobs: list[Knobs], res: ResolvedStage,
                    neighbours: dict[int, Gpu]) -> list[Option | None]:
        """Stage s's option of each of `knobs` at n units (in their order), but none for a level of activation
        checkpointing stronger than one that already holds every microbatch on every lane with the same other
        knobs (Note [recomputing only where memory binds])."""
        m = self.prims[st.micro_batch].num_microbatches
        roomy: set[tuple[int, Offload, int]] = set()   # (zero, offload, ministages) held at a weaker level
        got: dict[int, Option | None] = {}
        for i in sorted(range(len(knobs)), key=lambda i: CHECKPOINTS.index(knobs[i].checkpoint)):
            k = knobs[i]
            rest = (k.zero, k.offload, k.ministages)
            if rest in roomy:
                got[i] = None
                continue
            got[i] = o = self._option(st, s, n, k, res, neighbours)
            if o is not None and all(c.cap >= m for c in o.classes):
                roomy.add(rest)
        return [got[i] for i in range(len(knobs))]

    # Note [recomputing only where memory binds]: activation checkpointing only adds compute (the
    # recomputed forward) and only lowers activation memory, which the assignment sees through one term, the
    # microbatches a lane can hold (`LaneClass.cap`). Where a weaker level's option already holds all m
    # microbatches on every lane, a stronger level with the same ZeRO level, offload and ministages has the
    # same fill, tail and drain or longer ones and more work, and the same caps: it is dominated in every term
    # of the assignment model (Note [dominated options] in assign.py) and of the exact score, so it is not
    # built. Where memory binds, every level is built and the assignment weighs the time recomputation costs
    # against the microbatches it lets a lane hold. So `activation_checkpoint = auto` costs about one table
    # per configuration where memory is plentiful.

    def neighbours(self, st: Structure, s: int) -> dict[int, Gpu]:
        """The stages beside stage s (pipeline order wraps around), each by its first GPU: the border peers
        its option tables are read with."""
        n_stages = len(st.layout)
        return {o % n_stages: self.resolve(st.layout[o % n_stages]).lanes[0][0] for o in (s - 1, s + 1)
                if n_stages > 1}

    def _roomy(self, st: Structure, s: int, n: int, knobs: list[Knobs], got: list[Option | None],
               res: ResolvedStage, neighbours: dict[int, Gpu]) -> bool:
        """Whether one of `knobs` holds every microbatch on every lane at n units: an option's caps, or for one
        that cannot be place them (not built) its memory at m (Note [options that cannot be placed])."""
        m = self.prims[st.micro_batch].num_microbatches
        if any(o is not None and all(c.cap >= m for c in o.classes) for o in got):
            return True
        return any(self._holds_all(st, s, n, k, res, neighbours) for k in knobs
                   if not placeable(m, res, k, st.schedule, self.space.zero_base))

    def _key(self, st: Structure, s: int, n: int, knobs: Knobs, neighbours: dict[int, Gpu]) -> tuple[object, ...]:
        """What an option depends on: this stage, its place, its neighbours' first GPUs (the border peers)."""
        peers = tuple(sorted((o, g.group, g.host) for o, g in neighbours.items()))
        return (st.layout[s], s, len(st.layout), peers, st.schedule, st.micro_batch, st.interleave, n, knobs)

    def _option(self, st: Structure, s: int, n: int, knobs: Knobs, res: ResolvedStage,
                neighbours: dict[int, Gpu]) -> Option | None:
        key = self._key(st, s, n, knobs, neighbours)
        if key not in self._options:
            self._options[key] = stage_option(self.prims[st.micro_batch], res, s, len(st.layout), n, knobs,
                                              st.schedule, neighbours, st.interleave, self.space.prefetch,
                                              self.space.zero_base)
        return self._options[key]

    def _holds_all(self, st: Structure, s: int, n: int, knobs: Knobs, res: ResolvedStage,
                   neighbours: dict[int, Gpu]) -> bool:
        if knobs.ministages > n or (st.interleave and st.interleave > n):
            return False   # no such option
        key = self._key(st, s, n, knobs, neighbours)
        if key not in self._holds:
            prims = self.prims[st.micro_batch]
            sc = stage_costs(prims, res, s, len(st.layout), n, knobs, st.schedule, neighbours, st.interleave,
                             self.space.prefetch, self.space.zero_base)
            self._holds[key] = holds_all(sc, res.classes, prims.num_microbatches)
        return self._holds[key]

    def knobs(self, st: Structure, s: int, full: bool) -> list[Knobs]:
        space, sharded = self.space, self.shardable(st.layout[s])
        if not sharded:   # only ZeRO-0, which shards nothing, is a configuration of this stage
            space = replace(space, zero_levels=tuple(z for z in space.zero_levels if z == 0))
        one_ministage = ties_in_one_ministage(self.model, len(st.layout))
        options = [k for k in knob_options(space, st.schedule, st.interleave, len(self.resolve(st.layout[s]).lanes),
                                           self.rule(s))
                   if (sharded or k.zero == 0) and (k.ministages == 1 or not one_ministage)]
        return options if full or not options else base_knobs(options)

    def shardable(self, gpus: StageGpus) -> bool:
        """Whether ZeRO may shard a stage on `gpus`: not where hierarchical ZeRO (shard = node) would, over lanes
        spread unevenly on their nodes, which the validator refuses (`uneven_node_shards`)."""
        if self.space.zero_base.shard is not ZeroShard.NODE:
            return True
        res = self.resolve(gpus)
        return uneven_node_shards([[g.host for g in lane] for lane in res.lanes], res.tp) is None

    def assign(self, st: Structure, full: bool, around: tuple[int, ...] | None = None
               ) -> tuple[Assignment, list[StageTable]] | None:
        """The fast assignment over windows of layer counts; a window the answer presses against grows that
        way."""
        limits = self._limits(st)
        centres = list(around) if around else self._centres(st)
        knobs = [self.knobs(st, s, full) for s in range(len(st.layout))]
        fallbacks = [None if full or len(k) < 2 else k[-1] for k in knobs]
        knobs = [k if full or len(k) < 2 else k[:-1] for k in knobs]
        m = self.prims[st.micro_batch].num_microbatches
        width = (self.limits.window if full else max(1, self.limits.window // 2)) * self.grain
        lows = [max(1, min(c, most) - width) for c, most in zip(centres, limits)]
        highs = [min(most, max(c, 1) + width) for c, most in zip(centres, limits)]
        written = [self._fixed_layers(s) for s in range(len(st.layout))]
        for s, fixed in enumerate(written):   # written layer ranges stay
            if fixed is not None:
                lows[s] = highs[s] = limits[s] = fixed
        # the fewest units a stage can own when the others own their most: a lone stage owns them all, so its
        # window never grows (where nothing fits, it used to widen to every count)
        floors = [max(1, self.units - sum(limits) + most) if fixed is None else fixed
                  for most, fixed in zip(limits, written)]
        lows = [max(lo, floor) for lo, floor in zip(lows, floors)]
        while True:
            tables = [self._table(st, s, self.counts(st, s, lo, hi), knobs[s], fallbacks[s])
                      for s, (lo, hi) in enumerate(zip(lows, highs))]
            if self.until.passed():   # the tables may be cut short: no assignment (Note [an anytime search])
                return None
            a = assign_fast(tables, self.units, m, self.grain)
            grown = False
            for s, most in enumerate(limits):   # at the window's first or last count on the grid
                pressed_low = a is None or a.options[s].layers - self.grain < lows[s]
                pressed_high = a is None or a.options[s].layers + self.grain > highs[s]
                if pressed_low and lows[s] > floors[s]:
                    lows[s], grown = max(floors[s], lows[s] - width), True
                if pressed_high and highs[s] < most:
                    highs[s], grown = min(most, highs[s] + width), True
            if not grown:
                return (a, tables) if a is not None else None
            width *= 2

    # ------------------------------------------------------------ plans

    def candidate(self, st: Structure, a: Assignment) -> Candidate | None:
        m = self.prims[st.micro_batch].num_microbatches
        counts: list[tuple[int, ...]] = []
        for o in a.options:
            per_class = spread(m, o.lane_classes(), o.equal_counts)
            if per_class is None:
                return None
            lane_counts = [0] * sum(len(c.lanes) for c in o.classes)
            for cls, row in zip(o.classes, per_class):
                for lane, count in zip(cls.lanes, row):
                    lane_counts[lane] = count
            counts.append(self._routed(st, len(counts), m) or tuple(lane_counts))
        if st.schedule is ScheduleKind.INTERLEAVED and not _lockstep_groups_alike(a, counts):
            return None
        return Candidate(st.layout, tuple(o.layers for o in a.options), tuple(o.knobs for o in a.options),
                         tuple(counts), st.schedule, st.micro_batch, self.space.prefetch, st.idle)

    def _routed(self, st: Structure, s: int, m: int) -> tuple[int, ...] | None:
        """A written routing's counts for stage s (None: the planner routes)."""
        rule = self.rule(s)
        if rule is None or rule.routing is None:
            return None
        lanes = self.resolve(st.layout[s]).lanes
        return written_counts(rule.routing, [list(lane) for lane in lanes], m, self.model.dtype)

    def score(self, c: Candidate) -> Score:
        zero = tuple(replace(self.space.zero_base, level=k.zero) for k in c.knobs)
        return evaluate(self.prims[c.micro_batch], view_of(c, self.resolve, zero))

    def found(self, st: Structure, a: Assignment | None) -> Found | None:
        c = None if a is None else self.candidate(st, a)
        return None if c is None else Found(c, self.score(c), st)

    # ------------------------------------------------------------ the run

    def _speed_split(self, st: Structure) -> list[int]:
        """The layer units split in proportion to the stages' speed (largest remainder), within their
        limits."""
        limits = self._limits(st)
        fixed = [self._fixed_layers(s) for s in range(len(st.layout))]
        if any(n is not None for n in fixed):
            return self._split_around(st, fixed, limits)
        shares = self._speeds(st)
        exact = [self.units * v / sum(shares) for v in shares]
        out = [min(max(1, int(e)), most) for e, most in zip(exact, limits)]
        order = sorted(range(len(out)), key=lambda i: -(exact[i] - int(exact[i])))
        while sum(out) != self.units:
            step = 1 if sum(out) < self.units else -1
            i = next(i for i in order if 1 <= out[i] + step <= limits[i])
            out[i] += step
            order = order[1:] + order[:1]
        return out

    def _split_around(self, st: Structure, fixed: list[int | None], limits: list[int]) -> list[int]:
        """Written layer counts kept; the rest of the units spread over the other stages by speed."""
        free = [s for s, n in enumerate(fixed) if n is None]
        left = self.units - sum(n for n in fixed if n is not None)
        speeds = self._speeds(st)
        out = [n if n is not None else 1 for n in fixed]
        for _ in range(max(0, left - len(free))):
            s = max(free, key=lambda i: (speeds[i] / out[i] if out[i] < limits[i] else -1.0, -i))
            out[s] += 1
        return out

    def _price_factor(self, st: Structure) -> float:
        if self.goal.kind is not Objective.COST:
            return 1.0
        return sum(g.device.price for stage in st.layout for g in self.resolve(stage).gpus)


# Note [interleaved lanes]
# The search proposes interleaved 1F1B only over stages of one lane count, as Megatron-LM runs it. A stage of
# more lanes than the one before it (a fan-out) serves each microbatch's next chunk only after the loop through
# every stage has brought it back, and each of its lanes is fed a group's microbatches one upstream lane's
# forward apart (Note [interleaved warm-up] in passes/lower/schedule.py): the compiled programs wait for that
# loop, and the closed form, which holds each lane to its own cycle, does not see it. Measured: Llama-70B on
# 2 H100 + 8 A100-40 + 96 L4 in two regions planned four one-lane A100 stages feeding twelve four-lane L4
# stages, closed form 112 s, compiled 217 s; without such plans it plans 116 s, closed form within 10 %. Random
# job 27 (interleaved written) planned 2 -> 4 -> 4 lanes at 1.075 s, 1.165 × its lower bound; now 2 lanes in one
# stage, 0.856 s, at its bound (tests/test_plan_lockstep.py). A plan written with uneven interleaved lanes still
# compiles and runs; explain prints its compiled step.


def _lockstep_groups_alike(a: Assignment, counts: list[tuple[int, ...]]) -> bool:
    """Whether under interleaved 1F1B the lanes of every stage in lockstep (ZeRO-2/3 reducing every
    microbatch, `lockstep_groups` in passes/lower/schedule.py) get groups of the same sizes, so run the same
    ops: equal counts are not enough where the first stage's lanes do not line up with theirs (a stage of 8
    lanes behind one of 1 lane and groups of p = 10: lane 0 takes microbatches 0 and 8 in the first group,
    lane 7 only 7). The validator refuses such a plan as written out."""
    first = first_positions(route_microbatches(list(counts[0])))
    width = group_width(len(counts), max(counts[0]))
    return all(len({tuple(map(len, interleaved_groups(first, mbs, width)))
                    for mbs in route_microbatches(list(lanes))}) <= 1
               for option, lanes in zip(a.options, counts) if option.knobs.zero >= 2 and len(lanes) > 1)


def base_knobs(options: list[Knobs]) -> list[Knobs]:
    """A few configurations for the coarse steps: the lightest, ZeRO's most sharded without offload (and,
    where checkpointing is searched, the same with selective recomputation), the most frugal."""
    def weight(k: Knobs) -> tuple[int, int, int, int]:
        return (k.offload.params + k.offload.optimizer + k.offload.activations, CHECKPOINTS.index(k.checkpoint),
                k.zero, k.ministages)

    by_weight = sorted(options, key=weight)
    lightest = by_weight[0]
    plain = [k for k in by_weight if k.offload == lightest.offload and k.ministages == lightest.ministages]
    unchecked = [k for k in plain if k.checkpoint is lightest.checkpoint]
    selective = [k for k in plain if k.checkpoint is Checkpointing.SELECTIVE][-1:]
    return list(dict.fromkeys([by_weight[0], unchecked[-1], *selective, by_weight[-1]]))
