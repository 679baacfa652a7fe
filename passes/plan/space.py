"""The search space: which parts of the plan the planner chooses, and from what.

What the spec fixes stays fixed; what it leaves to the planner is searched:

- `auto` anywhere (schedule, ZeRO level, prefetch, a stage's fields, the model's or a stage's
  activation checkpointing: none, selective or full per stage);
- when the spec writes no stage at all (`stages` auto, the usual case), also
  the plan-wide settings it does not write: schedule, ZeRO level, offload
  and idle GPUs; and the micro-batch size when the main file's `train`
  block does not write it (`hetc import sailor --quotas` leaves it out).

A written value is never overridden: `zero = 2` under an auto plan keeps
ZeRO-2 on every stage.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hetc.ir.errors import Diagnostic, SpecError
from hetc.passes.plan.candidate import Candidate, Knobs, Offload
from hetc.passes.plan.partition import bandwidth_domains
from hetc.passes.plan.stages import StageRule, stage_rules
from hetc.ir.spec import AUTO, Auto, Checkpointing, ParallelSpec, ScheduleKind, ZeroSpec
from hetc.ir.plan import Job

__all__ = [
    "CHECKPOINTS",
    "DEFAULT_SCHEDULES",
    "MAX_IDLE_GROUPS",
    "Fixed",
    "SearchSpace",
    "knob_options",
    "space_from_spec",
]

# 1F1B and GPipe are left out of `schedule = auto`: in the cost model zero-bubble (ZB-H1) runs 1F1B's
# steady state with a bubble shrunk by the weight-gradient work, and GPipe takes 1F1B's time with every
# microbatch's activations held. ZB-H1 keeps one microbatch more in flight than 1F1B on a stage with
# stages after it (Note [in-flight limit] in passes/cost/schedule.py), so where memory binds 1F1B can
# fit where ZB does not; but on lanes of uneven width its compiled step can run well past the closed
# form the search ranks by (specs/zorse/c_auto.het's cluster: a 1F1B plan of 24.4 s compiled to 30.4 s),
# so the search would chase plans that lose. A spec that names a schedule gets it.
DEFAULT_SCHEDULES = (ScheduleKind.ZB, ScheduleKind.INTERLEAVED, ScheduleKind.ZORSE)
PLAIN_OFFLOADS = (Offload(), Offload(optimizer=True), Offload(params=True, optimizer=True))
ZORSE_OFFLOADS = (Offload(), Offload(activations=True), Offload(params=True, activations=True),
                  Offload(params=True, optimizer=True, activations=True))
MINISTAGES = (1, 2, 4)
CHECKPOINTS = (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL)   # weakest first
INTERLEAVE = (2,)
MICRO_BATCHES = (1, 2, 4, 8)
TP_DEGREES = (1, 2, 4, 8)
MAX_STAGES = 16
# With more node groups than this, the idle choices are a few (`_idle_sets`), not every subset.
MAX_IDLE_GROUPS = 3


@dataclass(frozen=True)
class Fixed:
    """What the spec pins (None: the planner's choice). A baseline plan may be chosen only if it agrees."""

    schedule: ScheduleKind | None = None
    zero: int | None = None
    offload: Offload | None = None
    micro_batch: int | None = None
    idle: tuple[str, ...] | None = None
    stages: bool = False              # the spec writes its stages: no other layout is admitted
    checkpoint: Checkpointing | None = None

    def admits(self, c: Candidate) -> bool:
        return (not self.stages and (self.schedule is None or c.schedule is self.schedule)
                and (self.zero is None or all(k.zero == self.zero for k in c.knobs))
                and (self.offload is None or all(k.offload == self.offload for k in c.knobs))
                and (self.micro_batch is None or c.micro_batch == self.micro_batch)
                and (self.checkpoint is None or all(k.checkpoint is self.checkpoint for k in c.knobs))
                and (self.idle is None or set(c.idle) == set(self.idle)))


@dataclass(frozen=True)
class SearchSpace:
    schedules: tuple[ScheduleKind, ...] = DEFAULT_SCHEDULES
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[Offload, ...] = PLAIN_OFFLOADS
    zorse_offloads: tuple[Offload, ...] = ZORSE_OFFLOADS
    ministages: tuple[int, ...] = MINISTAGES
    checkpoints: tuple[Checkpointing, ...] = (Checkpointing.NONE,)   # the model's level, or CHECKPOINTS (auto)
    interleave: tuple[int, ...] = INTERLEAVE
    micro_batches: tuple[int, ...] = (1,)
    tp: tuple[int, ...] = (1,)
    idle_sets: tuple[tuple[str, ...], ...] = ((),)
    max_stages: int = MAX_STAGES
    prefetch: int = 1
    zero_base: ZeroSpec = field(default_factory=ZeroSpec)
    stages: tuple[StageRule, ...] | None = None   # the spec wrote its stages: what each fixes
    fixed: Fixed = field(default_factory=lambda: Fixed())


def space_from_spec(job: Job, **overrides: Any) -> SearchSpace:   # SearchSpace's fields
    """The space the job's spec leaves open (`overrides` narrow it further, e.g. in tests)."""
    par = job.parallel
    designing = par.stages is AUTO

    def free(name: str, value: object = None) -> bool:
        return value is AUTO or (designing and not par.written(name))

    _whole_groups_idle(par)
    micro_batches = _micro_batches(job, designing)
    checkpoint = job.model.activation_checkpoint
    rules = None if designing else stage_rules(job)
    fixed = Fixed(
        schedule=None if par.schedule is AUTO or free("schedule") else par.schedule,
        zero=None if free("zero", par.zero.level) else par.zero.resolved_level,
        offload=None if free("offload") else Offload.from_spec(par.offload),
        micro_batch=micro_batches[0] if len(micro_batches) == 1 else None,
        idle=None if free("idle") else tuple(s.group for s in par.idle),
        stages=not designing,
        checkpoint=None if isinstance(checkpoint, Auto) else checkpoint,
    )
    out: dict[str, Any] = {
        "schedules": DEFAULT_SCHEDULES if fixed.schedule is None else (fixed.schedule,),
        "zero_levels": (0, 1, 2, 3) if fixed.zero is None else (fixed.zero,),
        "offloads": PLAIN_OFFLOADS if fixed.offload is None else (fixed.offload,),
        "zorse_offloads": ZORSE_OFFLOADS if fixed.offload is None else (fixed.offload,),
        "micro_batches": micro_batches,
        "checkpoints": CHECKPOINTS if isinstance(checkpoint, Auto) else (checkpoint,),
        "tp": TP_DEGREES if rules is None or any(r.tp is None for r in rules) else (1,),   # None: designing
        "idle_sets": _idle_sets(job) if fixed.idle is None else (fixed.idle,),
        "prefetch": 1 if par.prefetch is AUTO else par.prefetch,
        "zero_base": par.zero if par.zero.level is not AUTO else ZeroSpec(shard=par.zero.shard,
                                                                           across=par.zero.across),
        "fixed": fixed,
        "stages": rules,
    }
    out.update(overrides)
    return SearchSpace(**out)


def _whole_groups_idle(par: ParallelSpec) -> None:
    """The planner idles whole node groups, so a written idle slice of part of one cannot be kept."""
    if par.stages is not AUTO:
        return
    for r in par.idle:
        bounds = (r.node_start, r.node_stop, r.gpu_start, r.gpu_stop)
        if not (r.node_is_slice and r.gpu_is_slice and bounds == (None, None, None, None)):
            raise SpecError([Diagnostic(r.span, f"the planner leaves whole node groups idle: write idle = "
                                        f"[{r.group}], or leave `idle` out to let it choose")])


def _micro_batches(job: Job, designing: bool) -> tuple[int, ...]:
    train = job.train
    main_file = job.spec.span.file
    if not designing or train.written("micro_batch") or train.span.file != main_file or \
            train.grad_accum is not None:
        return (train.micro_batch,)
    return tuple(b for b in MICRO_BATCHES if train.global_batch % b == 0)


def _idle_sets(job: Job) -> tuple[tuple[str, ...], ...]:
    """Node groups to leave idle.

    With at most `MAX_IDLE_GROUPS` node groups, every proper subset. With
    more: none; each group alone; each bandwidth domain of the two-way cut
    (a region behind a slow link); and whole device kinds, slowest first.
    """
    topo = job.topology
    groups = list(topo.groups)
    if len(groups) <= MAX_IDLE_GROUPS:
        return tuple(c for k in range(len(groups)) for c in itertools.combinations(groups, k))
    dtype = job.model.dtype

    def speed(name: str) -> float:
        device = topo.gpu_at(name, 0, 0).device
        return device.peak.for_dtype(dtype) * device.efficiency

    out: list[tuple[str, ...]] = [()]
    out += [(g,) for g in groups]
    two_way = bandwidth_domains(topo, groups)[1]
    out += [domain for domain in two_way]
    kinds = sorted({topo.gpu_at(g, 0, 0).device.name: speed(g) for g in groups}.items(), key=lambda kv: kv[1])
    for k in range(1, len(kinds)):
        dropped = {name for name, _ in kinds[:k]}
        out.append(tuple(g for g in groups if topo.gpu_at(g, 0, 0).device.name in dropped))
    return tuple(dict.fromkeys(tuple(sorted(o, key=groups.index)) for o in out if len(o) < len(groups)))


def _stage_checkpoints(written: Checkpointing | Auto | None, model: tuple[Checkpointing, ...]
                       ) -> tuple[Checkpointing, ...]:
    """The levels a written stage may take: what it writes (`auto`: every level), else the model's."""
    if written is None:
        return model
    return CHECKPOINTS if isinstance(written, Auto) else (written,)


def knob_options(space: SearchSpace, schedule: ScheduleKind, interleave: int, lanes: int,
                 rule: StageRule | None = None) -> list[Knobs]:
    """Stage configurations to try under `schedule` for a stage of `lanes` lanes (what `rule` fixes, fixed).

    With one lane every ZeRO level shards over one rank: level 0 says the
    same thing plainly (and ZeRO-3's gather buffer only costs memory). With
    several lanes ZeRO-1 holds less than ZeRO-0 and steps a shard of the
    optimizer in the same sync time, so level 0 is dropped when 1 is allowed.
    """
    levels = space.zero_levels
    if lanes == 1:
        levels = (min(levels),)
    elif 0 in levels and 1 in levels:
        levels = tuple(z for z in levels if z != 0)
    plain, zorse, ministages, checkpoints = space.offloads, space.zorse_offloads, space.ministages, space.checkpoints
    if rule is not None:
        levels = levels if rule.zero is None else (rule.zero,)
        plain, zorse = (plain, zorse) if rule.offload is None else ((rule.offload,), (rule.offload,))
        ministages = ministages if rule.ministages is None else (rule.ministages,)
        checkpoints = _stage_checkpoints(rule.checkpoint, checkpoints)
    if schedule is ScheduleKind.ZORSE:
        return [Knobs(z, off, k, c) for z in levels for off in zorse for k in ministages for c in checkpoints]
    if schedule is ScheduleKind.INTERLEAVED:
        return [Knobs(z, off, interleave, c) for z in levels for off in plain for c in checkpoints]
    fixed = rule is not None and rule.ministages is not None
    return [Knobs(z, off, k, c) for z in levels for off in plain
            for k in (ministages if (off.params or z >= 3 or fixed) else (1,)) for c in checkpoints]
