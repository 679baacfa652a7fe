"""Live rebalancing: a running job notices a lane or a link that has become slow and re-routes microbatches
around it (`hetc run --rebalance`).

Note [live rebalancing]
Slow-but-alive GPUs (thermal throttling, a degraded link, a noisy neighbour) cost a job more than failures
do, and a heterogeneous plan already knows the remedy: give a slower lane fewer microbatches. So with
`--rebalance` every rank reports its compute time per step (what the runtime measures for --metrics), and
plan rank 0 keeps, per lane, its compute seconds per microbatch (the slowest of the lane's ranks):

- *calibration*: after the first step (start-up), the fastest of the next `window` steps is the lane's
  reference rate: what the lane does when healthy, on this machine, under this plan. (The plan's own
  prediction differs from the machine by a factor per device and per node, which would read as a
  slowdown of some lane from step one; the reference removes it.)
- *detection*: a lane's slowdown is the fastest of its last `window` steps over its reference, divided
  by the median of that ratio over all lanes: what slows every lane alike (a busy host) is no lane's
  fault, and no routing could help it. Noise only ever adds time (a rank that waits for a core, an
  interrupt), so the fastest of a window is the lane's rate with the noise left out, and it rises only
  when every step of the window is slow: a sustained slowdown, not a noisy step. Measured on the demo
  (4 ranks on 2 shared cores), the median of a window still read 2.2x on a healthy lane with one
  microbatch; the fastest read under 1.5x (benchmarks/rebalance.py). A lane is slow when its slowdown is
  `threshold` or more, and healthy again when it falls below halfway back (1 + (threshold − 1)/2); the
  band between the two keeps a lane near the threshold from flapping.
- *decision*: when the set of slow lanes changes, and `cooldown` steps have passed since the last
  change, each stage with more than one lane gets the routing that water-fills its microbatches over its
  lanes' current rates (passes/plan/routing.py, the planner's own); with no lane slow, the plan's own
  routing comes back. The new plan is compiled, verified and simulated on rank 0 with the measured
  slowdowns as part of the cost model (`CostModel(measured_slowdown=)`); it is taken only when the
  simulation says it gains `min_gain` at least (a return to the plan's routing once every lane is
  healthy is always taken: the cause of the change is gone), and the step it predicts is the measured
  step scaled by the simulation's ratio.
- *switch*: rank 0 puts every rank's new listing (and evaluation listing) in the store before its
  decision for the step; every rank reads the decision after each step and, on a switch, runs its new
  program from the next step. A change of routing moves no weights: each stage keeps its ministages, its
  ZeRO shards and its process groups, and a global microbatch reads the same samples whichever lane
  serves it (Note [Plan-independent data] in runtime/data.py), so the losses are those of the run
  without the slowdown.

A link is watched the same way, on the fastest transit of its messages (Note [link transit] in
runtime/links.py): a slow link makes both lanes it joins slower by its extra time per microbatch in the
water-filling, and the re-plan's cost model learns its slowdown (`CostModel(measured_link_slowdown=)`).

Every detection and switch is a line on rank 0 and a `--metrics` record with `"event": "rebalance"`
(`"slow": [stage, lane]` or `"link": [rank, rank]`).
Note [a new layer split]
Re-routing cannot help a slow lane alone in its stage. There rank 0 tries moving each border between
stages of one layer range by one or two layers, compiles and simulates each split with the measured
slowdowns, and takes the best when it gains `split_gain` (a bigger bar than routing's: the change
costs a checkpoint). Every rank then saves the step just done to --checkpoint (DCP, the run's own
saver), creates the new plan's process groups, builds its new ministages with no values, and loads
the checkpoint into them, resharded as any resume is (runtime/checkpoint.py); the next step runs the
new programs. No process restarts and no step is repeated or lost; without --checkpoint the line
says that a new split needs one. The new plan travels through the store as one pickled value (spec,
programs), as a plan directory would on a shared file system.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import statistics
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from hetc.ir.pipeline import Pipeline
from hetc.ir.program import Program, RankProgram
from hetc.ir.errors import SpecError
from hetc.ir.plan import Plan
from hetc.passes.validate import check_spec
from hetc.passes.verify import VerifyError
from hetc.runtime.links import LinkId, MessageLog, border_rates, border_seconds, link_transits, model_link_factor
from hetc.ir.spec import Auto, LayerRange, Routing, RoutingKind, Spec

if TYPE_CHECKING:
    from hetc.passes.cost import CostModel

__all__ = ["LaneWatch", "LinkWatch", "RateWatch", "RebalanceOptions", "Rebalancer", "Switch", "target_routing"]

LaneId = tuple[int, int]      # (stage, lane)
K = TypeVar("K", LaneId, LinkId)
DECISION_KEY = "hetc/rebalance/step/{step}"
LISTING_KEY = "hetc/rebalance/v{version}/{kind}-{rank}"
SPLIT_KEY = "hetc/rebalance/v{version}/split"


@dataclass(frozen=True)
class RebalanceOptions:
    """`hetc run --rebalance` and its knobs (Note [live rebalancing])."""

    window: int = 5
    threshold: float = 2.0     # above the step-to-step noise measured by benchmarks/rebalance.py
    cooldown: int = 5
    min_gain: float = 0.05
    split_gain: float = 0.2    # a new layer split (through a checkpoint) must gain this much
    # A link's transit is noisier than a lane's compute: a rank waiting for a core reads as slow links,
    # up to 1.9x at a load average near 2 on the demo (Note [link transit] in runtime/links.py).
    link_threshold: float = 4.0

    def for_links(self) -> RebalanceOptions:
        """These options with the links' threshold as the threshold (a link is watched as a lane is)."""
        return dataclasses.replace(self, threshold=self.link_threshold)

    @property
    def recovered(self) -> float:
        """The ratio under which a slow lane is healthy again."""
        return 1 + (self.threshold - 1) / 2


@dataclass
class RateWatch(Generic[K]):
    """Per lane, its compute seconds per microbatch (or per link, its seconds per message, Note [link
    transit] in runtime/links.py): the reference, the recent window, and the lanes (links) slow."""

    keys: list[K]          # the lanes (links) watched
    opts: RebalanceOptions
    seen: int = 0
    reference: dict[K, float] = field(default_factory=dict)
    recent: dict[K, deque[float]] = field(default_factory=dict)
    slow: dict[K, float] = field(default_factory=dict)     # lane -> its current slowdown

    def observe(self, per_microbatch: Mapping[K, float]) -> None:
        """One step's seconds per microbatch of every lane (a lane missing from it, as a link that carried
        no message this step, keeps its window)."""
        self.seen += 1
        if self.seen == 1:
            return      # the first step also starts the run up
        for key in self.keys:
            if key in per_microbatch:
                self.recent.setdefault(key, deque(maxlen=self.opts.window)).append(per_microbatch[key])
        if not self.reference and self.seen - 1 == self.opts.window:    # the first whole window: calibration
            self.reference = {lane: min(got) for lane, got in self.recent.items() if min(got) > 0}

    def ratios(self) -> dict[K, float]:
        """Each lane's slowdown: its fastest of its last `window` steps, over its reference, over the median
        of that ratio over all lanes (none before calibration)."""
        if not self.reference:
            return {}
        own = {lane: min(self.recent[lane]) / ref for lane, ref in self.reference.items()}
        common = statistics.median(own.values())
        return {lane: r / common for lane, r in own.items()}

    def update(self) -> tuple[list[K], list[K]]:
        """Update the slow lanes from the ratios: (lanes that became slow, lanes that recovered)."""
        ratios = self.ratios()
        became = [lane for lane, r in ratios.items() if r >= self.opts.threshold and lane not in self.slow]
        recovered = [lane for lane, r in ratios.items() if lane in self.slow and r < self.opts.recovered]
        for lane in recovered:
            del self.slow[lane]
        for lane, r in ratios.items():
            if lane in self.slow or lane in became:
                self.slow[lane] = r
        return became, recovered


LaneWatch = RateWatch[LaneId]
LinkWatch = RateWatch[LinkId]


def target_routing(pipeline: Pipeline, planned: Mapping[int, tuple[int, ...]], reference: Mapping[LaneId, float],
                   slow: Mapping[LaneId, float], equal: Mapping[int, bool],
                   borders: Mapping[LaneId, float] | None = None) -> dict[int, tuple[int, ...]]:
    """Microbatches per lane of every stage: the plan's own where no lane of the stage is slow, else
    water-filled over the lanes' current rates (reference × slowdown, plus `borders`: the seconds per
    microbatch a lane loses to its slow links, `border_seconds` in runtime/links.py)."""
    from hetc.passes.plan.routing import spread

    borders = borders or {}
    out = {}
    for stage in pipeline.stages:
        lanes = [(stage.index, lane.index) for lane in stage.lanes]
        if len(lanes) < 2 or not any(lane in slow or borders.get(lane, 0.0) > 0 for lane in lanes):
            out[stage.index] = planned[stage.index]
            continue
        m = sum(len(lane.microbatches) for lane in stage.lanes)
        classes = [(1, reference[lane] * slow.get(lane, 1.0) + borders.get(lane, 0.0), m) for lane in lanes]
        got = spread(m, classes, equal=equal[stage.index])
        out[stage.index] = planned[stage.index] if got is None else tuple(c for counts in got for c in counts)
    return out


def routing_of(pipeline: Pipeline) -> dict[int, tuple[int, ...]]:
    return {st.index: tuple(len(lane.microbatches) for lane in st.lanes) for st in pipeline.stages}


def with_routing(plan: Plan, routing: Mapping[int, tuple[int, ...]]) -> Spec:
    """`plan`'s spec with explicit microbatch counts per lane for every stage whose lanes are more than one."""
    stages = tuple(st if len(routing[i]) < 2 else
                   dataclasses.replace(st, microbatches=Routing(kind=RoutingKind.COUNTS, counts=routing[i]))
                   for i, st in enumerate(plan.parallel.resolved_stages))
    return dataclasses.replace(plan.spec, parallel=dataclasses.replace(plan.parallel, stages=stages))


def layer_splits(plan: Plan, stage: int) -> list[Spec]:
    """`plan`'s spec with each border of stage `stage` (to the stage before it and after it) moved by one or
    two layers, where both stages have one layer range and keep a layer (Note [a new layer split])."""
    model, parallel, pipeline = plan.model, plan.parallel, plan.pipeline
    stages = parallel.resolved_stages
    out = []
    for left in (stage - 1, stage):
        if left < 0 or left + 1 >= len(stages):
            continue
        a, b = stages[left], stages[left + 1]
        if isinstance(a.layers, Auto) or isinstance(b.layers, Auto) or len(a.layers) != 1 or len(b.layers) != 1:
            continue
        [(first, border)] = pipeline.layer_runs(left)
        [(_, last)] = pipeline.layer_runs(left + 1)
        for shift in (-2, -1, 1, 2):
            moved = border + shift
            if not first < moved < last:
                continue
            name = model.layer_name
            new = list(stages)
            new[left] = dataclasses.replace(a, layers=(LayerRange(first=name(first), last=name(moved - 1)),))
            new[left + 1] = dataclasses.replace(b, layers=(LayerRange(first=name(moved), last=name(last - 1)),))
            out.append(dataclasses.replace(plan.spec, parallel=dataclasses.replace(parallel, stages=tuple(new))))
    return out


@dataclass(frozen=True)
class Switch:
    """What a rank runs from the next step on."""

    program: RankProgram
    evaluation: RankProgram | None
    full: Program | None = None          # rank 0: every rank's programs (the trace of a step needs them)
    plan: Plan | None = None             # with them, their plan
    resplit: Plan | None = None  # a new layer split: the rank reshards (Note [a new layer split])
    whole: Program | None = None         # with it, the new programs (groups and every rank's listing)


@dataclass
class _Compiled:
    plan: Plan
    program: Program
    evaluation: Program | None
    simulated_s: float


class Rebalancer:
    """One rank's part of live rebalancing (Note [live rebalancing]); rank 0 decides."""

    def __init__(self, plan_dir: Path, plan: Plan, rank: int, opts: RebalanceOptions,
                 store, log, can_reshard: bool = False, version: int = 0) -> None:
        """`can_reshard`: the run saves checkpoints, so a new layer split can go through one; `version`: the
        last plan version published (a rebalancer after a new split goes on counting)."""
        self.plan_dir, self.plan, self.rank, self.opts = plan_dir, plan, rank, opts
        pipeline = plan.pipeline
        self.store, self.log = store, log      # `log(record)`: a --metrics record (rank 0)
        self.can_reshard = can_reshard
        self.planned = routing_of(pipeline)
        lanes = [(st.index, lane.index) for st in pipeline.stages for lane in st.lanes]
        self.watch = LaneWatch(lanes, opts)
        self.links: LinkWatch | None = None     # from the first step's messages (Note [link transit])
        self.border_rates: dict[tuple[LinkId, LaneId], float] = {}   # messages per microbatch, as last seen
        self.link_bytes: dict[LinkId, int] = {}         # the size of each link's fastest message, as last seen
        self.version = version
        self.last_change: int | None = None
        self.steps: deque[float] = deque(maxlen=opts.window)
        self.check: tuple[int, float, float] | None = None     # (switch step, step before, predicted step)
        self._program: Program | None = None

    # ------------------------------------------------------------ every rank

    def after_step(self, step: int, compute_s: float, step_s: float, messages: MessageLog) -> Switch | None:
        """Report this rank's compute time and `messages` of `step`; the switch every rank makes after it,
        if any."""
        self.store.set(f"hetc/rebalance/compute/{step}/{self.rank}", repr(compute_s))
        self.store.set(f"hetc/rebalance/messages/{step}/{self.rank}", messages.to_json())
        if self.rank == 0:
            decision = self._decide(step, step_s)
            self.store.set(DECISION_KEY.format(step=step), json.dumps(decision))
        else:
            decision = json.loads(self.store.get(DECISION_KEY.format(step=step)))
        if decision is None:
            return None
        if decision.get("split"):
            return self._resplit_to(decision["version"])
        return self._switch_to(decision["version"])

    def _resplit_to(self, version: int) -> Switch:
        spec, program, evaluation = pickle.loads(self.store.get(SPLIT_KEY.format(version=version)))
        plan = check_spec(spec, self.plan_dir).plan()   # the running plan with other counts or layers
        self.version = version
        return Switch(program.ranks[self.rank], evaluation.ranks[self.rank] if evaluation is not None else None,
                      program if self.rank == 0 else None, plan, plan, program)

    def _switch_to(self, version: int) -> Switch:
        program = RankProgram.from_text(self.store.get(LISTING_KEY.format(version=version, kind="rank",
                                                                          rank=self.rank)).decode())
        text = self.store.get(LISTING_KEY.format(version=version, kind="eval", rank=self.rank)).decode()
        evaluation = RankProgram.from_text(text) if text else None
        if self.rank != 0:
            return Switch(program, evaluation)
        assert self._program is not None
        return Switch(program, evaluation, self._program, self.plan)

    # ------------------------------------------------------------ rank 0

    def _decide(self, step: int, step_s: float) -> dict | None:
        world = self.plan.pipeline.world_size
        keys = [f"hetc/rebalance/compute/{step}/{r}" for r in range(world)]
        compute = [float(v) for v in self.store.multi_get(keys)]
        self.watch.observe(self._per_microbatch(compute))
        self.steps.append(step_s)
        self._check_gain(step)
        became, recovered = self.watch.update()
        for lane in became:
            self._tell_slow(step, lane)
        for lane in recovered:
            self._say(step, f"{self._lane_name(lane)} is back to its reference rate", {"recovered": list(lane)})
        links_changed = self._watch_links(step)
        if not (became or recovered or links_changed):
            return None
        if self.last_change is not None and step - self.last_change < self.opts.cooldown:
            return None
        return self._replan(step)

    def _watch_links(self, step: int) -> bool:
        """Observe every link's transit in `step` (Note [link transit]); whether a link became slow or
        recovered."""
        world = self.plan.pipeline.world_size
        logs = self.store.multi_get([f"hetc/rebalance/messages/{step}/{r}" for r in range(world)])
        transits = link_transits({r: MessageLog.from_json(text.decode()) for r, text in enumerate(logs)})
        if self.links is None:
            self.links = LinkWatch(sorted(transits.fastest), self.opts.for_links())
        self.links.observe(transits.fastest)
        self.border_rates.update(border_rates(self.plan.pipeline, transits.messages))
        self.link_bytes.update(transits.nbytes)
        became, recovered = self.links.update()
        for link in became:
            self._tell_slow_link(step, link)
        for link in recovered:
            self._say(step, f"{self._link_name(link)} is back to its reference rate", {"recovered_link": list(link)})
        return bool(became or recovered)

    def _per_microbatch(self, compute: list[float]) -> dict[LaneId, float]:
        return {(st.index, lane.index): max(compute[r] for r in lane.ranks) / max(1, len(lane.microbatches))
                for st in self.plan.pipeline.stages for lane in st.lanes}

    def _replan(self, step: int) -> dict | None:
        from hetc.passes.lower.schedule import lockstep_groups

        coupled = {group.stage.index for group in lockstep_groups(self.plan.pipeline, self.plan.model)}
        equal = {st.index: st.index in coupled for st in self.plan.pipeline.stages}
        # each lane's seconds per microbatch lost to its slow links (Note [link transit])
        target = target_routing(self.plan.pipeline, self.planned, self.watch.reference, self.watch.slow, equal,
                                border_seconds(self.border_rates, self._link_extra_s()))
        current = routing_of(self.plan.pipeline)
        if target == current:
            alone = [lane for lane in self.watch.slow if len(self.plan.pipeline.stages[lane[0]].lanes) == 1]
            return self._resplit(step, alone[0][0]) if alone else None
        slow = self._rank_slowdowns()
        start = time.perf_counter()
        try:
            before, after = (self._compile(with_routing(self.plan, routing), slow)
                             for routing in (current, target))
        except (SpecError, VerifyError) as err:     # a routing the plan's rules refuse: keep the one that runs
            self._say(step, f"re-routing refused: {str(err).splitlines()[0]}", {"change": None, "taken": False})
            return None
        gain = before.simulated_s / after.simulated_s - 1 if after.simulated_s > 0 else 0.0
        measured = statistics.median(self.steps)
        predicted = measured * after.simulated_s / before.simulated_s if before.simulated_s > 0 else measured
        change = {str(s): [list(current[s]), list(target[s])] for s in target if target[s] != current[s]}
        restores = target == self.planned     # every lane healthy again: the plan as compiled, gain or not
        if gain < self.opts.min_gain and not restores:
            self._say(step, f"re-routing {self._describe(change)} would gain {gain:.0%} (< {self.opts.min_gain:.0%}): "
                      "kept", {"change": change, "predicted_gain": gain, "taken": False})
            return None
        self.version += 1
        self._publish(after)
        compile_s = time.perf_counter() - start
        self.plan, self._program = after.plan, after.program
        self.last_change, self.check = step, (step, measured, predicted)
        why = "back to the plan's routing" if restores else f"+{gain:.0%} throughput"
        self._say(step, f"re-routing {self._describe(change)}: predicted step {measured:.3f} s -> {predicted:.3f} s "
                  f"({why}); compiled and verified in {compile_s:.2f} s",
                  {"change": change, "predicted_gain": gain, "measured_step_s": measured,
                   "predicted_step_s": predicted, "compile_s": compile_s, "taken": True})
        return {"version": self.version}

    def _resplit(self, step: int, stage: int) -> dict | None:
        """Re-routing cannot help a slow lane alone in `stage`: a new layer split (Note [a new layer split])."""
        name = self.plan.pipeline.stages[stage].name
        if not self.can_reshard:
            self._say(step, f"re-routing cannot help stage '{name}' (one lane); a new layer split goes through "
                      "a checkpoint: run with --checkpoint DIR", {"change": None, "taken": False})
            return None
        slow, start = self._rank_slowdowns(), time.perf_counter()
        before = self._compile(self.plan.spec, slow)
        best: _Compiled | None = None
        for spec in layer_splits(self.plan, stage):
            try:
                got = self._compile(spec, slow)
            except (SpecError, VerifyError):      # a split that does not fit or that the plan's rules refuse
                continue
            if best is None or got.simulated_s < best.simulated_s:
                best = got
        gain = before.simulated_s / best.simulated_s - 1 if best is not None and best.simulated_s > 0 else 0.0
        split = "" if best is None else self._describe_split(best.plan.pipeline)
        if best is None or gain < self.opts.split_gain:
            self._say(step, f"re-routing cannot help stage '{name}' (one lane); the best new layer split "
                      f"{split or '(none fits)'} would gain {gain:.0%} (< {self.opts.split_gain:.0%}): kept",
                      {"change": None, "split": split or None, "predicted_gain": gain, "taken": False})
            return None
        self.version += 1
        self.store.set(SPLIT_KEY.format(version=self.version), pickle.dumps((best.plan.spec, best.program,
                                                                             best.evaluation)))
        measured = statistics.median(self.steps)
        predicted = measured * best.simulated_s / before.simulated_s
        self.last_change, self.check = step, (step, measured, predicted)
        self._say(step, f"new layer split {split}: predicted step {measured:.3f} s -> {predicted:.3f} s "
                  f"(+{gain:.0%} throughput); compiled in {time.perf_counter() - start:.2f} s; through a checkpoint "
                  f"of step {step + 1}", {"split": split, "predicted_gain": gain, "measured_step_s": measured,
                                          "predicted_step_s": predicted, "taken": True})
        return {"version": self.version, "split": True}

    def _describe_split(self, pipeline: Pipeline) -> str:
        model = self.plan.model
        return ", ".join(f"{st.name} {pipeline.layers_text(model, st.index)}" for st in pipeline.stages)

    def _link_extra_s(self) -> dict[LinkId, float]:
        """Each slow link's seconds per message more than at its reference."""
        if self.links is None:
            return {}
        return {link: self.links.reference[link] * (ratio - 1) for link, ratio in self.links.slow.items()}

    def _link_slowdowns(self, healthy: CostModel) -> dict[LinkId, float]:
        """The slow links' factors on `healthy`'s (a CostModel without them) time of their messages."""
        return {(a, b): model_link_factor(extra, healthy.p2p_transfer_time(a, b, self.link_bytes[(a, b)]))
                for (a, b), extra in self._link_extra_s().items()}

    def _rank_slowdowns(self) -> dict[int, float]:
        return {r: factor for (s, l), factor in self.watch.slow.items()
                for r in self.plan.pipeline.stages[s].lanes[l].ranks}

    def _compile(self, spec: Spec, slow: Mapping[int, float]) -> _Compiled:
        """Lower, verify and simulate the plan of `spec`, its compute slowed by `slow`, its slow links by
        theirs (Note [link transit] in runtime/links.py)."""
        from hetc.passes.build import build
        from hetc.passes.cost import CostModel
        plan = check_spec(spec, self.plan_dir).plan()   # the running plan with other counts or layers
        healthy = CostModel(plan)
        costs = CostModel(plan, measured_slowdown=slow,
                          measured_link_slowdown=self._link_slowdowns(healthy))
        got = build(plan, costs=costs, evaluation=True)
        assert got.step_time_s is not None   # simulated
        return _Compiled(plan, got.program, got.evaluation, got.step_time_s)

    def _publish(self, compiled: _Compiled) -> None:
        for rp in compiled.program.ranks:
            self.store.set(LISTING_KEY.format(version=self.version, kind="rank", rank=rp.rank), rp.to_text())
            ev = compiled.evaluation.ranks[rp.rank].to_text() if compiled.evaluation is not None else ""
            self.store.set(LISTING_KEY.format(version=self.version, kind="eval", rank=rp.rank), ev)

    def _check_gain(self, step: int) -> None:
        """`window` steps after a switch: the measured step beside the predicted one."""
        if self.check is None or step - self.check[0] < self.opts.window:
            return
        switched, before, predicted = self.check
        measured = statistics.median(self.steps)
        self.check = None
        self._say(step, f"after re-routing at step {switched + 1}: step {before:.3f} s -> {measured:.3f} s "
                  f"(predicted {predicted:.3f} s)",
                  {"measured_step_s": measured, "predicted_step_s": predicted, "before_step_s": before})

    def _tell_slow(self, step: int, lane: LaneId) -> None:
        ratio, ref = self.watch.slow[lane], self.watch.reference[lane]
        self._say(step, f"{self._lane_name(lane)} computes {ratio:.2f}x slower than it did "
                  f"({ref * ratio * 1e3:.1f} ms per microbatch, {ref * 1e3:.1f} ms at the start)",
                  {"slow": list(lane), "ratio": ratio, "measured_s": ref * ratio, "reference_s": ref})

    def _tell_slow_link(self, step: int, link: LinkId) -> None:
        assert self.links is not None   # it watched the link
        ratio, ref = self.links.slow[link], self.links.reference[link]
        self._say(step, f"{self._link_name(link)} carries messages {ratio:.2f}x slower than it did "
                  f"({ref * ratio * 1e3:.2f} ms the fastest, {ref * 1e3:.2f} ms at the start)",
                  {"link": list(link), "ratio": ratio, "measured_s": ref * ratio, "reference_s": ref})

    def _link_name(self, link: LinkId) -> str:
        return f"the link between ranks {link[0]} and {link[1]}"

    def _lane_name(self, lane: LaneId) -> str:
        stage = self.plan.pipeline.stages[lane[0]]
        ranks = stage.lanes[lane[1]].ranks
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"lane {lane[1]} of stage '{stage.name}' ({who})"

    def _describe(self, change: Mapping[str, list[list[int]]]) -> str:
        return "; ".join(f"stage '{self.plan.pipeline.stages[int(s)].name}' microbatches {old} -> {new}"
                         for s, (old, new) in change.items())

    def _say(self, step: int, text: str, record: dict) -> None:
        print(f"hetc run: step {step + 1}: {text}", file=sys.stderr, flush=True)
        self.log({"event": "rebalance", "step": step + 1, **record})
