"""Why the chosen plan leaves a node group idle, from the search's own evaluation of plans that use it.

For each idle group the best plan that uses it is found among the plans
the search scored (else among a few structures it assigns now, whose idle
set is the chosen one less that group, under the chosen plan's schedule and
micro-batch size) and the baselines. Then, by the cost model's terms of
that plan (`IdleReason.kind`):

- `memory`: no plan that uses the group fits (the closest one's fullest GPU);
- `link`: the group's stage spends longer sending and receiving a
  microbatch over a border than computing it (the link, by the spec's name);
- `slow`: the group's stage paces the pipeline: its busiest lane's seconds per
  step against the other stages', and the border it would feed; or its
  gradient sync and optimizer step after the flush are the longest;
- `overall`: the plan loses elsewhere (its bubble and the tail after the
  flush), or costs more under a cost objective;
- `written`: the spec leaves it idle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from hetc.ir.jsontypes import JsonObject
from hetc.passes.plan.candidate_score import Score
from hetc.passes.plan.candidate_stage import StageCosts
from hetc.passes.plan.baselines import Baseline
from hetc.passes.plan.candidate import Candidate
from hetc.passes.plan.deadline import Deadline
from hetc.passes.plan.structures import Found, Structures
from hetc.passes.plan.views import view_of
from hetc.ir.spec import Objective
from hetc.ir.topology import Gpu
from hetc.ir.units import human_bytes, human_seconds

__all__ = ["IdleReason", "idle_reasons"]

IdleKind = Literal["memory", "link", "slow", "overall", "written"]

# the structures assigned (with the coarse steps' configurations) to find a plan that uses an idle group,
# where the search scored none, and the seconds they may take (the search's own deadline may have passed):
# at 2048 GPUs of four kinds, about 0.2 s of CPU for two idle groups
_LOOKS = 3
_LOOK_SECONDS = 1.0


@dataclass(frozen=True)
class IdleReason:
    group: str
    kind: IdleKind
    text: str                          # one line: why, with the numbers
    step_time_s: float | None = None   # of the best plan that uses the group (None: none was built)

    def to_json(self) -> JsonObject:
        return {"group": self.group, "kind": self.kind, "why": self.text, "step_time_s": self.step_time_s}


def idle_reasons(search: Structures, found: list[Found], baselines: list[Baseline], chosen: Found,
                 written: bool) -> tuple[IdleReason, ...]:
    """One reason per node group `chosen` leaves idle; `written`: the spec fixes the idle groups."""
    if written:
        return tuple(IdleReason(g, "written", "the spec leaves it idle (`idle` in the parallel block)")
                     for g in chosen.candidate.idle)
    scored = [Found(b.candidate, b.score, None) for b in baselines if b.candidate is not None and b.score is not None]
    return tuple(_reason(search, found, scored, chosen, g) for g in chosen.candidate.idle)


def _reason(search: Structures, found: list[Found], baselines: list[Found], chosen: Found, group: str) -> IdleReason:
    """The search's plans that use `group`, else a few it assigns now, beside the baselines that use it (a
    baseline alone is a weak rival: a grid over every GPU)."""
    using = [f for f in found if group not in f.candidate.idle] or _look(search, chosen, group)
    using += [f for f in baselines if group not in f.candidate.idle]
    if not using:
        return IdleReason(group, "memory", "no plan that uses it fits in memory (none could place every "
                                           "microbatch)")
    fitting = [f for f in using if f.score.fits]
    if not fitting:
        return _memory(search, group, min(using, key=lambda f: _overflow(f.score)))
    best = min(fitting, key=lambda f: (search.goal.value(f.score), f.candidate.key()))
    return _loses(search, chosen, best, group)


def _look(search: Structures, chosen: Found, group: str) -> list[Found]:
    """Plans that use `group`: a few structures with the chosen idle set less it, assigned and scored."""
    idle = tuple(g for g in chosen.candidate.idle if g != group)
    c = chosen.candidate
    until, search.until = search.until, Deadline.after(_LOOK_SECONDS)   # Note [an anytime search]
    out: list[Found] = []
    try:
        structures = (st for layout in search.layouts_of(idle)
                      for st in search.variants(idle, layout, (c.schedule,), (c.micro_batch,)))
        for _, st in zip(range(_LOOKS), structures):
            if search.until.passed():
                break
            got = search.assign(st, full=False)
            f = None if got is None else search.found(st, got[0])
            if f is not None:
                out.append(f)
    finally:
        search.until = until
    return out


def _overflow(score: Score) -> float:
    return max(m.total - score.fill * m.capacity for m in score.memory)


def _memory(search: Structures, group: str, closest: Found) -> IdleReason:
    """No plan that uses `group` fits: the closest one's fullest GPU, preferring one of the group's, of those
    over the share the search fills (the group's GPUs may fit where another kind's do not: that one is named)."""
    gpus, fill = search.topo.gpus, closest.score.fill
    entries = [(m, gpus[ids[0]]) for m, ids in zip(closest.score.memory, closest.score.classes) if ids]
    over = [e for e in entries if e[0].total > fill * e[0].capacity] or entries
    own = [e for e in over if e[1].group == group] or over
    m, gpu = max(own, key=lambda e: e[0].share)
    within = "in memory" if fill >= 1 else f"within {fill:.0%} of device memory, the headroom hetc plan keeps"
    return IdleReason(group, "memory", f"no plan the search scored that uses it fits {within}: the closest "
                                       f"({_describe(closest.candidate)}) needs {human_bytes(m.total)} on "
                                       f"{gpu} ({gpu.device.name}, {human_bytes(m.capacity)})",
                      closest.score.step_time_s)


@dataclass(frozen=True)
class _StagePace:
    index: int
    busiest: float    # the busiest lane's seconds of compute and border transfers over its microbatches
    compute: float    # one microbatch's compute on the group's slowest lane (0: the group is not in the stage)
    border: float     # ... and its border transfers
    lane_gpu: Gpu | None   # that lane's first GPU
    flush: float      # the gradient sync and optimizer step after the flush


def _paces(search: Structures, c: Candidate, group: str) -> list[_StagePace]:
    """Per stage of `c`: the cost model's per-microbatch times (`StageCosts`) of its lanes."""
    zero = tuple(replace(search.space.zero_base, level=k.zero) for k in c.knobs)
    view = view_of(c, search.resolve, zero)
    prims = search.prims[c.micro_batch]
    out = []
    for sv in view.stages:
        sc = StageCosts(prims, view, sv)
        busiest, compute, border, lane_gpu = 0.0, 0.0, 0.0, None
        for lane, gpus in enumerate(sv.lanes):
            f, i, w = sc.compute(lane)
            own = f + i + w + sc.overhead(lane)
            borders = sc.p2p(lane).total
            busiest = max(busiest, sc.count(lane) * (own + borders))
            if any(g.group == group for g in gpus) and own + borders > compute + border:
                compute, border, lane_gpu = own, borders, gpus[0]
        out.append(_StagePace(sv.index, busiest, compute, border, lane_gpu, sc.flush()))
    return out


def _loses(search: Structures, chosen: Found, best: Found, group: str) -> IdleReason:
    """A fitting plan uses `group` but loses to `chosen`: by its link, its pace, or overall."""
    c = best.candidate
    paces = _paces(search, c, group)
    against = (f"in the best plan that uses it ({_describe(c)}, {human_seconds(best.score.step_time_s)}/step "
               f"against {human_seconds(chosen.score.step_time_s)})")
    mine = [p for p in paces if p.lane_gpu is not None]
    step = best.score.step_time_s
    if not mine:   # a plan of the pool that uses the group in no stage cannot be: say it plainly
        return IdleReason(group, "overall", f"slower overall {against}", step)
    worst = max(mine, key=lambda p: p.busiest)
    name = f"s{worst.index}"
    if worst.border > worst.compute:
        return IdleReason(group, "link", f"its link is too slow {against}: stage {name} on {group} spends "
                                         f"{human_seconds(worst.border)} a microbatch on its borders "
                                         f"({_link(search, c, worst)}) against {human_seconds(worst.compute)} "
                                         "of compute", step)
    others = [p.busiest for p in paces if p.index != worst.index]
    if not others or worst.busiest > max(others):
        which, verb, border = _border(search, c, worst.index)
        rest = f", the other stages at most {human_seconds(max(others))}" if others else ""
        return IdleReason(group, "slow", f"too slow for the border {which} {against}: stage {name} on "
                                         f"{group} takes {human_seconds(worst.busiest)} a step "
                                         f"({human_seconds(worst.compute)} a microbatch) to {verb} {border}"
                                         f"{rest}", step)
    flushes = [p.flush for p in paces if p.index != worst.index]
    if best.score.tail_s > chosen.score.tail_s and (not flushes or worst.flush > max(flushes)):
        rest = f", the other stages at most {human_seconds(max(flushes))}" if flushes else ""
        return IdleReason(group, "slow", f"too slow after the flush {against}: stage {name} on {group} takes "
                                         f"{human_seconds(worst.flush)} for its gradient sync and optimizer "
                                         f"step{rest}", step)
    if search.goal.kind is Objective.COST:
        return IdleReason(group, "overall", f"costs more {against}: "
                                            f"{best.score.dollars_per_token * 1e6:.4g} $ per million tokens "
                                            f"against {chosen.score.dollars_per_token * 1e6:.4g}", step)
    return IdleReason(group, "overall", f"slower overall {against}: bubble {human_seconds(best.score.bubble_s)} "
                                        f"and tail {human_seconds(best.score.tail_s)} against "
                                        f"{human_seconds(chosen.score.bubble_s)} and "
                                        f"{human_seconds(chosen.score.tail_s)}", step)


def _border(search: Structures, c: Candidate, s: int) -> tuple[str, str, str]:
    """(which border, for the headline; what the stage does to it; the border): the one stage s sends its
    activations over, or the last stage's, the one it takes them in over."""
    first, last = c.ranges[s][0][0], c.ranges[s][-1][1]
    name = search.model.layer_name
    if s + 1 < len(c.stages):
        return "it would feed", "feed", f"the border s{s} -> s{s + 1} ({name(last - 1)} | {name(last)})"
    if s > 0:
        return "that would feed it", "take in", f"the border s{s - 1} -> s{s} ({name(first - 1)} | {name(first)})"
    return "it would feed", "run", "the whole model (one stage)"


def _link(search: Structures, c: Candidate, pace: _StagePace) -> str:
    """The links from the group's lane to its neighbour stages' first GPUs, as the spec names them."""
    assert pace.lane_gpu is not None
    links = []
    for other in (pace.index - 1, pace.index + 1):
        if 0 <= other < len(c.stages):
            peer = search.resolve(c.stages[other]).gpus[0]
            link = search.topo.link(pace.lane_gpu, peer)
            links.append(f"to {peer.group}: {link.origin or 'the default link'}, "
                         f"{link.bandwidth / 1e9:.3g} GB/s")
    return "; ".join(links) or "no border"


def _describe(c: Candidate) -> str:
    stages = len(c.stages)
    return f"{stages} stage{'s' if stages != 1 else ''}, {c.schedule.value}, micro_batch {c.micro_batch}"
