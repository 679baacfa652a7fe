"""The plans other systems would run, scored with the same cost model.

- `megatron`: a homogeneous DP × PP × TP grid over every GPU (declaration
  order, TP inside a node), equal layers per stage, 1F1B, ZeRO-1 (the
  distributed optimizer); the best grid by score, as a Megatron user would
  tune it.
- `fastest`: the same grid search on the fastest GPU kind alone (a
  homogeneous sub-cluster; the other GPUs idle).
- `hexiscale`: one stage per node group, fastest first, equal layers per
  stage, ZeRO-2 and even microbatches (HexiScale's heterogeneous PP + DP).
- `cephalo`: one stage of every GPU under ZeRO-3 (Cephalo's whole-cluster
  FSDP).

A baseline that cannot be built says why (`note`); one that does not fit
in memory keeps its score with `fits` false.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hetc.passes.cost.intra_lane import tp_allowed
from hetc.passes.plan.candidate import Candidate, GpuBlock, Knobs, Offload, StageGpus, split_evenly
from hetc.passes.plan.candidate_score import Score
from hetc.passes.plan.layouts import gpu_run, group_size, group_speed, whole_group
from hetc.passes.plan.structures import Structures
from hetc.ir.spec import Checkpointing, ScheduleKind
from hetc.ir.topology import Topology

__all__ = ["Baseline", "baselines"]

TP_DEGREES = (1, 2, 4, 8)
GRIDS_TUNED = 3   # grids (best at the smallest micro-batch) tried at every micro-batch size


@dataclass(frozen=True)
class Baseline:
    name: str
    title: str
    candidate: Candidate | None
    score: Score | None
    note: str = ""
    # the closed form, where `score` is at the compiled programs' simulated step, as `hetc plan` prints it
    # (Note [one number] in passes/plan/final.py); None: `score` is the closed form
    closed_form_s: float | None = None
    allowed: bool = True   # agrees with what the spec fixes: only such a baseline can be chosen


def baselines(search: Structures) -> list[Baseline]:
    """Every baseline for `search`'s spec and cluster, scored with its primitives."""
    out = [_grid_baseline(search, "megatron", "Megatron grid, ZeRO-1", list(search.topo.groups))]
    fastest = _fastest_groups(search)
    out.append(_grid_baseline(search, "fastest", f"only {_kind(search.topo, fastest[0])}, grid", fastest))
    out.append(_single(search, "hexiscale", "HexiScale-like: equal layers, ZeRO-2", _hexiscale(search), 2))
    out.append(_single(search, "cephalo", "Cephalo-like: whole-cluster ZeRO-3", _cephalo(search), 3))
    return out


def _kind(topo: Topology, group: str) -> str:
    return topo.gpu_at(group, 0, 0).device.name


def _fastest_groups(search: Structures) -> list[str]:
    topo, dtype = search.topo, search.model.dtype

    def per_gpu(g: str) -> float:
        device = topo.gpu_at(g, 0, 0).device
        return device.peak.for_dtype(dtype) * device.efficiency

    best = max(per_gpu(g) for g in topo.groups)
    kind = next(_kind(topo, g) for g in topo.groups if per_gpu(g) == best)
    return [g for g in topo.groups if _kind(topo, g) == kind]


def _even(m: int, lanes: int) -> tuple[int, ...] | None:
    return tuple([m // lanes] * lanes) if m % lanes == 0 else None


def _builds(search: Structures, stages: list[StageGpus], knobs: Knobs, idle: tuple[str, ...]) -> list[Candidate] | str:
    """The plan at every micro-batch size the spec allows whose microbatches split evenly over the lanes."""
    units = search.units
    if len(stages) > units:
        return f"{len(stages)} stages for {units} layers"
    if knobs.zero and not all(search.shardable(st) for st in stages):
        return "hierarchical ZeRO (shard = node) needs as many lanes of a stage on each of its nodes"
    out, why = [], ""
    for b in sorted(search.space.micro_batches):
        m = search.prims[b].num_microbatches
        counts = [_even(m, st.num_lanes) for st in stages]
        if None in counts:
            lanes = next(st.num_lanes for st, c in zip(stages, counts) if c is None)
            why = why or f"{m} microbatches do not split evenly over {lanes} lanes"
            continue
        out.append(Candidate(tuple(stages), tuple(split_evenly(units, len(stages))), (knobs,) * len(stages),
                             tuple(c for c in counts if c is not None), ScheduleKind.ONE_F_ONE_B, b, search.space.prefetch, idle))
    return out or why


def _best(search: Structures, name: str, title: Callable[[Candidate], str], candidates: list[Candidate]) -> Baseline:
    scored = [(search.score(c), c) for c in candidates]
    score, best = min(scored, key=lambda sc: (not sc[0].fits, search.goal.value(sc[0])))
    return Baseline(name, title(best), best, score)


def _plain_checkpoint(search: Structures) -> Checkpointing:
    """A baseline's activation checkpointing: the model's, or none where the planner chooses it."""
    return search.space.checkpoints[0]


def _single(search: Structures, name: str, title: str, stages: list[StageGpus], zero: int) -> Baseline:
    built = _builds(search, stages, Knobs(zero, Offload(), 1, _plain_checkpoint(search)), ())
    if isinstance(built, str):
        return Baseline(name, title, None, None, built)
    return _best(search, name, lambda c: f"{title}, b {c.micro_batch}", built)


def _hexiscale(search: Structures) -> list[StageGpus]:
    topo, dtype = search.topo, search.model.dtype
    groups = sorted(topo.groups, key=lambda g: -group_speed(topo, g, dtype) / group_size(topo, g))
    return [StageGpus(whole_group(topo, g)) for g in groups]


def _cephalo(search: Structures) -> list[StageGpus]:
    return [StageGpus(tuple(GpuBlock(g, 0, n.count, 0, n.gpus) for g, n in search.topo.groups.items()))]


def _grid_baseline(search: Structures, name: str, title: str, groups: list[str]) -> Baseline:
    """The best-scoring DP × PP × TP grid over `groups` (the others idle)."""
    topo, model = search.topo, search.model
    per_node = min(topo.groups[g].gpus for g in groups)
    total = sum(group_size(topo, g) for g in groups)
    idle = tuple(g for g in topo.groups if g not in groups)
    grids, why = [], "no grid divides the GPUs"
    for tp in TP_DEGREES:
        if per_node % tp or not tp_allowed(model, tp) or total % tp:
            continue
        grids += [(pp, tp) for pp in range(1, min(search.units, total // tp) + 1) if (total // tp) % pp == 0]
    scored: list[tuple[tuple[bool, float], list[Candidate]]] = []
    for pp, tp in grids:
        built = _builds(search, _grid_stages(topo, groups, pp, tp), Knobs(1, Offload(), 1, _plain_checkpoint(search)),
                        idle)
        if isinstance(built, str):
            why = built
            continue
        first = search.score(built[0])   # the grid at its smallest micro-batch size
        scored.append(((not first.fits, search.goal.value(first)), built))
    if not scored:
        return Baseline(name, title, None, None, why)
    # every micro-batch size for the few best grids
    candidates = [c for _, built in sorted(scored, key=lambda sb: sb[0])[:GRIDS_TUNED] for c in built]

    def described(c: Candidate) -> str:
        first = c.stages[0]
        return f"{title}: dp {first.num_lanes} × pp {len(c.stages)} × tp {first.tp}, b {c.micro_batch}"

    return _best(search, name, described, candidates)


def _grid_stages(topo: Topology, groups: list[str], pp: int, tp: int) -> list[StageGpus]:
    """Stage p takes the p-th run of GPUs in declaration order (runs are whole lanes of tp)."""
    gpus = [(g, i) for g in groups for i in range(group_size(topo, g))]
    per_stage = len(gpus) // pp
    stages = []
    for p in range(pp):
        run = gpus[p * per_stage:(p + 1) * per_stage]
        blocks: list[GpuBlock] = []
        for g in dict.fromkeys(name for name, _ in run):
            idx = [i for name, i in run if name == g]
            blocks += _blocks(topo, g, idx[0], idx[-1] + 1)
        stages.append(StageGpus(tuple(blocks), tp))
    return stages


def _blocks(topo: Topology, group: str, lo: int, hi: int) -> list[GpuBlock]:
    return list(gpu_run(group, topo.groups[group].gpus, lo, hi))
