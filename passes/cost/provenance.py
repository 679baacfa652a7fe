"""Where every number of an estimate came from: layer times, link rates, and the profiles left unused.

Note [provenance]: `hetc explain` and `hetc plan` say, for each stage, what
timed its layers (a profile file, a measured fit scaled to this shape, or
the catalog's arithmetic: each matrix multiply by its shape where the
device kind names its SMs, else FLOPs / (peak × efficiency)), and for each kind
of link the plan's traffic crosses, what gave its rate: a measured fit (a
Sailor data folder's network fits, a `hetc profile` file's collectives) or
the spec's declared link (its `link` / `intra` block, or the default it
falls back on). A measured fit wins over a declared link — measured
numbers are preferred over datasheets (DESIGN.md §3) — and the link lists
the declaration it overrides, so a Sailor folder never replaces the spec's
links silently. Every profile offered (`--profile`, `$HETC_PROFILES`) whose
layer times the plan does not use is listed with the reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from hetc.ir.jsontypes import JsonObject
from hetc.passes.cost.hardware import ring_pair_kinds
from hetc.passes.cost.model import CostModel
from hetc.passes.cost.profiles import ComputeTable, dtype_class
from hetc.passes.cost.shapes import layer_kind
from hetc.passes.cost.params import block_params
from hetc.ir.program import Collective
from hetc.ir.spec import OffloadTarget
from hetc.ir.pipeline import Stage
from hetc.ir.topology import Gpu

__all__ = ["LinkSource", "Provenance", "UnusedProfile", "provenance"]

# An unused data folder's tables are summarized by reason beyond this many.
LISTED_TABLES = 3


@dataclass(frozen=True, slots=True)
class LinkSource:
    """What gave the rate of one kind of link the plan uses."""

    used_by: str          # the traffic that crosses it
    between: str          # the node groups at its ends
    source: str           # a measured fit's file, or the spec's declaration
    overrides: str = ""   # the spec's declared link a measured fit replaces

    def __str__(self) -> str:
        over = f" (overrides {self.overrides})" if self.overrides else ""
        return f"{self.used_by}, {self.between}: {self.source}{over}"


@dataclass(frozen=True, slots=True)
class UnusedProfile:
    profile: str   # the file (or data folder) offered
    reason: str

    def __str__(self) -> str:
        return f"{self.profile}: {self.reason}"


@dataclass(frozen=True)
class Provenance:
    """Note [provenance] for one plan."""

    layers: dict[int, tuple[str, ...]]   # stage -> where its layer times came from
    links: tuple[LinkSource, ...]
    unused: tuple[UnusedProfile, ...]

    def to_json(self) -> JsonObject:
        return {"sources": {str(k): list(v) for k, v in self.layers.items()},
                "links": [{"used_by": x.used_by, "between": x.between, "source": x.source,
                           "overrides": x.overrides or None} for x in self.links],
                "unused_profiles": [{"profile": u.profile, "reason": u.reason} for u in self.unused],
                "rejected_profiles": [str(u) for u in self.unused]}


def provenance(cm: CostModel) -> Provenance:
    """Note [provenance] of the plan `cm` (a CostModel) costs."""
    layers = _layer_sources(cm)
    used = {s for sources in layers.values() for s in sources}
    return Provenance(layers, tuple(_links(cm)), tuple(_unused(cm, used)))


# ------------------------------------------------------------------ layer times


def _layer_sources(cm: CostModel) -> dict[int, tuple[str, ...]]:
    out = {}
    for stage in cm.pipeline.stages:
        devices = {cm.gpu(r).device.name for r in stage.ranks}
        kinds = {layer_kind(cm.model, i) for ms in stage.ministages for i in cm.ministage(ms).layers}
        layers = sorted({_described(cm, d, cm.compute.layer(d, k, cm.pipeline.micro_batch, stage.tp).source)
                         for d in devices for k in kinds})
        engine = [f"engine, {d}: {cm.profiles.overhead[d] * 1e3:.4g} ms a microbatch outside the layers"
                  for d in sorted(devices) if cm.profiles.overhead.get(d)]
        out[stage.index] = tuple(layers + engine)
    return out


def _described(cm: CostModel, device: str, source: str) -> str:
    """A layer time's source, and for the catalog's arithmetic which of its two ways timed it (docs/costmodel.md
    "Compute time by shape"): each matrix multiply by its shape where the kind names its SMs, else one flat
    fraction of the peak for every layer."""
    if source != "arithmetic":
        return source
    spec = cm.compute.devices[device]
    if spec.sms > 0:
        return (f"arithmetic, {device}: each matrix multiply by its shape on {spec.sms} SMs, at most "
                f"{spec.efficiency:g} of peak")
    hint = "" if spec.is_cpu else " (name its `sms` to time them by shape)"
    return f"arithmetic, {device}: {spec.efficiency:g} of peak for every layer{hint}"


# ------------------------------------------------------------------ links


def _links(cm: CostModel) -> list[LinkSource]:
    """One entry per kind of pair (node groups, same node) each kind of traffic crosses, then host copies."""
    out: dict[tuple[str, frozenset[str], bool], LinkSource] = {}
    for used_by, a, b, ring_size in _crossings(cm):
        key = (used_by, frozenset((a.group, b.group)), a.host == b.host)   # either direction alike
        if key not in out:
            out[key] = _link_source(cm, used_by, a, b, ring_size)
    return list(out.values()) + _host_links(cm)


def _host_links(cm: CostModel) -> list[LinkSource]:
    """The host <-> device copies of stages that offload anything (`CostModel.copy_time`'s rate)."""
    out = []
    for stage in cm.pipeline.stages:
        off = stage.offload
        if all(getattr(off, k) is OffloadTarget.NONE for k in ("params", "optimizer", "activations")):
            continue
        for device in sorted({cm.gpu(r).device.name for r in stage.ranks}):
            measured = cm.profiles.copy_sources.get(device) if device in cm.profiles.copy else None
            source = f"measured in {measured}" if measured else f"the host_link of device {device} at " \
                f"{cm.hardware.devices[device].span}"
            out.append(LinkSource(f"stage {stage.name}: offload", f"{device} <-> its host", source))
    return out


def _crossings(cm: CostModel) -> Iterator[tuple[str, Gpu, Gpu, int]]:
    """(traffic, sender, receiver, GPUs of the ring on the sender's node) for the plan's transfers."""
    p = cm.pipeline
    for stage in p.stages:
        for lane in stage.lanes:
            if len(lane.ranks) > 1:
                for a, b, size in ring_pair_kinds(Collective.ALL_REDUCE, tuple(cm.gpu(r) for r in lane.ranks)):
                    yield f"stage {stage.name}: inside a lane (tp/cp)", a, b, size
        for group in {cm.zero_group(r) for r in stage.ranks}:
            if len(group) > 1:
                for a, b, size in ring_pair_kinds(Collective.ALL_GATHER, tuple(cm.gpu(r) for r in group)):
                    yield f"stage {stage.name}: ZeRO-{stage.zero.resolved_level} group", a, b, size
    firsts = [_first_gpus(cm, stage) for stage in p.stages]
    for k in range(len(p.stages) - 1):
        used_by = f"pipeline {p.stages[k].name} -> {p.stages[k + 1].name}"
        for a in firsts[k]:
            for b in firsts[k + 1]:   # `_links` keeps the first pair of each kind
                yield used_by, a, b, 2


def _first_gpus(cm: CostModel, stage: Stage) -> list[Gpu]:
    """The first GPU of each of the stage's lanes, one per node (a border's kinds of pair read only the
    node group and whether the two share a host): every lane by every lane was 18 million pairs at 16,384
    GPUs."""
    out: dict[tuple[str, int], Gpu] = {}
    for lane in stage.lanes:
        gpu = cm.gpu(lane.ranks[0])
        out.setdefault(gpu.host, gpu)
    return list(out.values())


def _link_source(cm: CostModel, used_by: str, a: Gpu, b: Gpu, ring_size: int) -> LinkSource:
    between = f"{a.group} (same node)" if a.host == b.host else f"{a.group} <-> {b.group}"
    declared = cm.topology.link(a, b)
    fit = cm.hardware.measured_link(a, b, ring_size, 1)
    if fit is None:
        return LinkSource(used_by, between, declared.origin)
    return LinkSource(used_by, between, f"measured fit in {fit.source or 'a profile'}",
                      declared.origin if declared.declared else "")


# ------------------------------------------------------------------ unused profiles


def _unused(cm: CostModel, used: set[str]) -> list[UnusedProfile]:
    groups: dict[tuple[str, str], list[tuple[ComputeTable, str]]] = defaultdict(list)
    for table in cm.profiles.compute:
        if any(s == table.source or s.startswith(table.source + " ") for s in used):
            continue
        kind, detail = _why_unused(cm, table)
        groups[(_offered(cm, table), kind)].append((table, detail))
    out = []
    for (offered, kind), tables in groups.items():
        if len(tables) <= LISTED_TABLES:
            out += [UnusedProfile(t.source, detail) for t, detail in tables]
        else:
            names = sorted({f"{t.model_name or '?'} on {t.device}" for t, _ in tables})
            shown = ", ".join(names[:LISTED_TABLES]) + (", ..." if len(names) > LISTED_TABLES else "")
            out.append(UnusedProfile(offered, f"{len(tables)} profiles {kind} ({shown})"))
    out += [UnusedProfile(r.where, r.why) for r in cm.profiles.rejected_for(cm.model.name)]
    return out


def _offered(cm: CostModel, table: ComputeTable) -> str:
    """The path given on the command line that the table was read from."""
    return next((s for s in cm.profiles.sources if table.source.startswith(s)), table.source)


def _why_unused(cm: CostModel, table: ComputeTable) -> tuple[str, str]:
    """(a short kind for grouping, the full reason) a measured table times none of the plan's layers."""
    m = cm.model
    devices = sorted({g.device.name for g in cm.pipeline.world})
    if not table.same_shape(m.hidden, block_params(m)):
        return "of other model shapes", (f"measures another model shape (hidden {table.hidden}, "
                                         f"{table.block_params:,} parameters a block); {m.name} has hidden "
                                         f"{m.hidden}, {block_params(m):,} a block")
    if dtype_class(table.dtype) != dtype_class(m.dtype):
        return "in another dtype", (f"measured in {table.dtype}, but {m.name} trains in {m.dtype.value} "
                                    "(a different speed class)")
    if table.device not in devices:
        return "of devices the plan does not use", (f"measures {table.device}, which holds no rank of this "
                                                     f"plan (its ranks run on {', '.join(devices)})")
    return "shadowed by others", (f"another measurement of {table.device} was preferred (the nearest "
                                  f"sequence length to {m.seq} comes first; this one is {table.seq})")
