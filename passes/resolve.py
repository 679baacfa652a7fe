"""Resolve an explicit parallel plan to ranks, lanes, ministages and routing.

Every inconsistency is a located diagnostic; `resolve_pipeline` returns the
`Pipeline` only when there are none. Stages whose layers, ranks or lanes
are `auto` are the planner's to fill; resolving them is an error here.
"""

from __future__ import annotations

from hetc.ir.errors import Diagnostic, Span, did_you_mean
from hetc.ir.pipeline import Lane, Ministage, Pipeline, Stage, route_microbatches
from hetc.ir.plan import Job
from hetc.ir.spec import AUTO, Auto, DType, ModelSpec, ParallelSpec, RankSlice, RoutingKind, Spec, StageSpec
from hetc.ir.topology import Gpu, Topology
from hetc.ir.units import counted

__all__ = ["Diagnostics", "layer_index", "plan_has_auto", "proportional_counts", "resolve_pipeline",
           "resolve_rank_slices"]

Diagnostics = list[Diagnostic]


def resolve_rank_slices(slices: tuple[RankSlice, ...], topo: Topology, errors: Diagnostics) -> list[Gpu]:
    return [gpu for s in slices for gpu in _one_slice(s, topo, errors)]


def _one_slice(s: RankSlice, topo: Topology, errors: Diagnostics) -> list[Gpu]:
    group = topo.groups.get(s.group)
    if group is None:
        errors.append(Diagnostic(s.span, f"unknown node group '{s.group}'"
                                 f"{did_you_mean(s.group, list(topo.groups))}"))
        return []
    if s.group not in topo.first_gpu_of_group:
        return []  # its device is unknown: reported elsewhere
    nodes = _indices(s.node_start, s.node_stop, s.node_is_slice, group.count, "node", s, errors)
    gpus = _indices(s.gpu_start, s.gpu_stop, s.gpu_is_slice, group.gpus, "GPU", s, errors)
    if nodes is None or gpus is None:
        return []
    return [topo.gpu_at(s.group, n, g) for n in nodes for g in gpus]


def _indices(start: int | None, stop: int | None, is_slice: bool, size: int, what: str, s: RankSlice,
             errors: Diagnostics) -> range | None:
    owner = f"nodes of '{s.group}' have" if what == "GPU" else f"'{s.group}' has"
    where = f"{owner} {size} {what}{'s' if size != 1 else ''}"
    if not is_slice:
        assert start is not None   # a single index (`group[n]`) has its start
        if start >= size:
            errors.append(Diagnostic(s.span, f"{what} {start} is outside its node group: {where}"))
            return None
        return range(start, start + 1)
    lo = 0 if start is None else start
    hi = size if stop is None else stop
    if hi > size:
        errors.append(Diagnostic(s.span, f"{what} range {lo}:{hi} is outside its node group: {where}"))
        return None
    if lo >= hi:
        errors.append(Diagnostic(s.span, f"{what} range {lo}:{hi} is empty"))
        return None
    return range(lo, hi)


def resolve_pipeline(job: Job, errors: Diagnostics) -> Pipeline | None:
    par, model, train, topo = job.parallel, job.model, job.train, job.topology
    schedule, prefetch = par.schedule, par.prefetch
    if plan_has_auto(job.spec) or isinstance(schedule, Auto) or isinstance(prefetch, Auto):   # (the types' sake)
        _check_given_ranks(par, topo, errors)
        return None
    before = len(errors)
    used = _rank_owners(par, topo, errors)
    world = tuple(g for g in topo.gpus if g.id in used)
    rank_of = {g.id: r for r, g in enumerate(world)}
    ministages = _ministages(model, par, errors)
    num_mb = train.global_batch // train.micro_batch
    stages: list[Stage | None] = []
    for idx, st in enumerate(par.resolved_stages):
        assert st.ranks is not AUTO   # none of it is auto (above)
        slice_errors: Diagnostics = []
        gpus = resolve_rank_slices(st.ranks, topo, slice_errors)
        if slice_errors:  # reported by _rank_owners; its lane arithmetic would only echo them
            stages.append(None)
            continue
        stages.append(_stage(idx, st, [rank_of[g.id] for g in gpus if g.id in rank_of], ministages,
                             job, num_mb, world, errors))
    if len(errors) > before or None in stages:
        return None
    return Pipeline(tuple(s for s in stages if s is not None), tuple(ministages), world, num_mb,
                    train.micro_batch, schedule, prefetch)


def plan_has_auto(spec: Spec) -> bool:
    """Whether the parallel plan leaves anything to the planner (then no Pipeline is resolved)."""
    par = spec.parallel
    return par is not None and (par.stages is AUTO or par.schedule is AUTO or par.zero.level is AUTO
                                or par.prefetch is AUTO or any(_stage_auto(st, spec.model) for st in par.stages))


def _stage_auto(st: StageSpec, model: ModelSpec | None) -> bool:
    return AUTO in (st.layers, st.ranks, st.lanes, st.tp, st.cp, st.ministages, st.microbatches) or \
        (st.zero is not None and st.zero.level is AUTO) or \
        (model is not None and st.checkpoint_under(model) is AUTO)


def _check_given_ranks(par: ParallelSpec, topo: Topology, errors: Diagnostics) -> None:
    """In a plan the planner completes, the rank sets it is given must still name GPUs of the cluster: it
    places its stages around them."""
    stages = () if isinstance(par.stages, Auto) else par.stages
    for slices in [st.ranks for st in stages] + [par.idle]:
        if not isinstance(slices, Auto):
            resolve_rank_slices(slices, topo, errors)


def _rank_owners(par: ParallelSpec, topo: Topology, errors: Diagnostics) -> dict[int, str]:
    """GPU id -> owning stage; GPUs used twice or by nobody are errors."""
    owner: dict[int, tuple[str, Span]] = {}
    before = len(errors)
    for label, slices in [(f"stage '{st.name}'", st.ranks) for st in par.resolved_stages] + [("idle", par.idle)]:
        assert slices is not AUTO
        for s in slices:
            twice: dict[tuple[str, Span], list[Gpu]] = {}   # one error per pair of rank sets, not per GPU
            for gpu in _one_slice(s, topo, errors):
                if gpu.id in owner:
                    twice.setdefault(owner[gpu.id], []).append(gpu)
                    continue
                owner[gpu.id] = (label, s.span)
            for (first, span), gpus in twice.items():
                what = f"GPU {gpus[0]} is" if len(gpus) == 1 else f"{len(gpus)} GPUs ({_some(gpus)}) are"
                errors.append(Diagnostic(s.span, f"{what} used twice: by {first} and by {label}",
                                         notes=((span, "first used here"),)))
    unused = [g for g in topo.gpus if g.id not in owner]
    if unused and len(errors) == before:  # a bad rank set explains them: say that only
        shown = _some(unused)
        errors.append(Diagnostic(par.span, f"{len(unused)} GPU{'s are' if len(unused) > 1 else ' is'} used by "
                                 f"no stage: {shown}; give them to a stage or list them in idle = [...]"))
    return {gid: label for gid, (label, _) in owner.items() if label != "idle"}


def _some(gpus: list[Gpu]) -> str:
    """The first few GPUs of a list, by name: `a[0, 0], a[0, 1] and 6 more`."""
    return ", ".join(str(g) for g in gpus[:4]) + (f" and {len(gpus) - 4} more" if len(gpus) > 4 else "")


def layer_index(model: ModelSpec, name: str, span: Span, errors: Diagnostics) -> int | None:
    idx = model.layer_index(name)
    if idx is None:
        last = f"block{model.layers - 1}"
        if name.startswith("block") and name[5:].isdigit():
            msg = f"'{name}' does not exist: the model has {counted(model.layers, 'block')}, block0..{last}"
        else:
            msg = f"unknown layer '{name}'{_layer_hint(model, name)}; layers are embed, block0..{last} and head"
        errors.append(Diagnostic(span, msg))
    return idx


def _layer_hint(model: ModelSpec, name: str) -> str:
    """Suggest `block7` for `blok7` or `Block7`; `embed` / `head` for their misspellings."""
    stem = name.rstrip("0123456789")
    digits = name[len(stem):]
    if digits and did_you_mean(stem.lower(), ["block"]) and model.layer_index("block" + digits) is not None:
        return f" (did you mean 'block{digits}'?)"
    return did_you_mean(name, ["embed", "head"])


def _ministages(model: ModelSpec, par: ParallelSpec, errors: Diagnostics) -> list[Ministage]:
    """Split every stage's layer ranges into ministages; check coverage and order."""
    before = len(errors)
    chunks = [(first, stop, s_idx, st.span_of("layers"))    # (first, stop, stage, span)
              for s_idx, st in enumerate(par.resolved_stages)
              for first, stop in _stage_ranges(model, st, errors)]
    if len(errors) > before:  # an unknown or reversed range would show up as gaps and overlaps too
        return []
    chunks.sort()
    _check_coverage(model, par.resolved_stages, chunks, errors)
    out: list[Ministage] = []
    per_stage: dict[int, int] = {}
    for first, stop, stage, _ in chunks:
        chunk = per_stage.get(stage, 0)
        per_stage[stage] = chunk + 1
        out.append(Ministage(len(out), stage, chunk, first, stop))
    _check_stage_order(par.resolved_stages, out, errors)
    return out


def _stage_ranges(model: ModelSpec, st: StageSpec, errors: Diagnostics) -> list[tuple[int, int]]:
    assert st.layers is not AUTO and st.ministages is not AUTO   # an explicit stage
    ranges = []
    for r in st.layers:
        lo = layer_index(model, r.first, r.span, errors)
        hi = layer_index(model, r.last, r.span, errors)
        if lo is None or hi is None:
            continue
        if hi < lo:
            errors.append(Diagnostic(r.span, f"layers {r.first}..{r.last} are out of order: "
                                     f"{r.last} comes before {r.first}"))
            continue
        ranges.append((lo, hi + 1))
    if len(st.layers) > 1:
        if st.ministages not in (1, len(st.layers)):
            errors.append(Diagnostic(st.span_of("ministages"), f"stage '{st.name}' lists {len(st.layers)} "
                                     f"layer ranges but ministages = {st.ministages}"))
        return ranges
    return [piece for lo, hi in ranges for piece in _split(lo, hi, st, errors)]


def _split(lo: int, hi: int, st: StageSpec, errors: Diagnostics) -> list[tuple[int, int]]:
    k = st.ministages
    assert k is not AUTO   # an explicit stage
    if k > hi - lo:
        errors.append(Diagnostic(st.span_of("ministages"), f"stage '{st.name}' has {hi - lo} layers and "
                                 f"cannot be split into {k} ministages"))
        return [(lo, hi)]
    bounds = [lo + (hi - lo) * i // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def _check_coverage(model: ModelSpec, names: tuple[StageSpec, ...], chunks: list[tuple[int, int, int, Span]],
                    errors: Diagnostics) -> None:
    expect = 0
    last_owner: tuple[int, Span] | None = None
    for first, stop, stage, span in chunks:
        if first > expect:
            errors.append(Diagnostic(span, f"{_layers_phrase(model, expect, first)} to no stage"))
        elif first < expect:
            assert last_owner is not None   # expect > 0: some chunk set it
            other = names[last_owner[0]].name
            overlap = _layers_phrase(model, first, min(stop, expect), verb=("is", "are"))
            errors.append(Diagnostic(span, f"{overlap} in two stages: '{other}' and '{names[stage].name}'",
                                     notes=((last_owner[1], "first assigned here"),)))
        if stop > expect:
            expect, last_owner = stop, (stage, span)
    if chunks and expect < model.num_model_layers:
        errors.append(Diagnostic(chunks[-1][3], f"{_layers_phrase(model, expect, model.num_model_layers)} "
                                 "to no stage"))


def _check_stage_order(stages: tuple[StageSpec, ...], ministages: list[Ministage], errors: Diagnostics) -> None:
    first_seen = dict.fromkeys(m.stage for m in ministages)    # stages in order of their first ministage
    for pos, s_idx in enumerate(first_seen):
        if s_idx != pos:
            st = stages[s_idx]
            errors.append(Diagnostic(st.span_of("layers"), f"stage '{st.name}' is listed as stage {s_idx} but "
                                     f"its layers make it stage {pos} of the pipeline; list stages in "
                                     "pipeline order"))
            return


def _layers_phrase(model: ModelSpec, lo: int, hi: int, verb: tuple[str, str] = ("belongs", "belong")) -> str:
    """'layer head belongs' or 'layers block2..block5 belong': layers lo..hi-1 and a verb."""
    a, b = model.layer_name(lo), model.layer_name(hi - 1)
    return f"layer {a} {verb[0]}" if a == b else f"layers {a}..{b} {verb[1]}"


def _stage(idx: int, st: StageSpec, ranks: list[int], ministages: list[Ministage], job: Job,
           num_mb: int, world: tuple[Gpu, ...], errors: Diagnostics) -> Stage | None:
    assert st.tp is not AUTO and st.cp is not AUTO and st.lanes is not AUTO   # an explicit stage
    lane_size = st.tp * st.cp
    if not ranks:
        return None
    lanes = st.lanes
    if len(ranks) != lanes * lane_size:
        errors.append(Diagnostic(st.span_of("lanes"), f"stage '{st.name}' has {len(ranks)} GPUs but lanes × tp"
                                 f" × cp = {lanes} × {st.tp} × {st.cp} = {lanes * lane_size}"))
        return None
    lane_gpus = [[world[r] for r in ranks[i * lane_size:(i + 1) * lane_size]] for i in range(lanes)]
    counts = _lane_counts(st, lane_gpus, num_mb, job, errors)
    if counts is None:
        return None
    routes = route_microbatches(counts)
    lane_objs = tuple(Lane(i, tuple(ranks[i * lane_size:(i + 1) * lane_size]), tuple(routes[i]))
                      for i in range(lanes))
    own = tuple(m.index for m in ministages if m.stage == idx)
    par = job.parallel
    checkpoint = st.checkpoint_under(job.model)
    assert not isinstance(checkpoint, Auto)   # plan_has_auto
    return Stage(idx, st.name, own, lane_objs, st.tp, st.cp, st.cp_kind, st.sequence_parallel,
                 st.zero or par.zero, st.offload or par.offload, st.ep, checkpoint)


def _lane_counts(st: StageSpec, lane_gpus: list[list[Gpu]], num_mb: int, job: Job,
                 errors: Diagnostics) -> list[int] | None:
    r = st.microbatches
    lanes = len(lane_gpus)
    train = job.train
    assert r is not AUTO   # an explicit stage
    if r.kind is RoutingKind.COUNTS:
        if len(r.counts) != lanes:
            errors.append(Diagnostic(r.span, f"stage '{st.name}' has {lanes} lanes but {len(r.counts)} "
                                     "microbatch counts"))
            return None
        if sum(r.counts) * train.micro_batch != train.global_batch:
            errors.append(Diagnostic(r.span, f"global_batch ({train.global_batch}) ≠ micro_batch "
                                     f"({train.micro_batch}) × microbatches ({sum(r.counts)} = "
                                     f"{' + '.join(map(str, r.counts))}) in stage '{st.name}'"))
            return None
        if 0 in r.counts:
            errors.append(Diagnostic(r.span, f"a lane of stage '{st.name}' gets no microbatch; "
                                     "drop the lane or give it work"))
            return None
        return list(r.counts)
    if num_mb < lanes:
        errors.append(Diagnostic(st.span_of("lanes"), f"stage '{st.name}' has {lanes} lanes but there are only "
                                 f"{num_mb} microbatches (global_batch {train.global_batch} / micro_batch "
                                 f"{train.micro_batch})"))
        return None
    if r.kind is RoutingKind.EVEN:
        return [num_mb // lanes + (1 if i < num_mb % lanes else 0) for i in range(lanes)]
    return proportional_counts(lane_gpus, num_mb, job.model.dtype)


def proportional_counts(lane_gpus: list[list[Gpu]], num_mb: int, dtype: DType) -> list[int]:
    """Counts proportional to each lane's effective FLOP/s (largest remainder), at least 1 each."""
    lanes = len(lane_gpus)
    speeds = [min(g.device.peak.for_dtype(dtype) * g.device.efficiency for g in gpus) or 1.0
              for gpus in lane_gpus]
    total = sum(speeds)
    spare = num_mb - lanes
    exact = [spare * s / total for s in speeds]
    counts = [1 + int(e) for e in exact]
    order = sorted(range(lanes), key=lambda i: -(exact[i] - int(exact[i])))
    for i in order[: num_mb - sum(counts)]:
        counts[i] += 1
    return counts
