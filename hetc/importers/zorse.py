"""Zorse's inputs as a .het spec: cluster_info.json, the model, and (with --plan) training_config.json.

cluster_info.json lists machines and their GPUs, which may be of several
kinds in one machine; a hetc node group has one kind, so a machine becomes
one node group per kind, all in the machine's own zone, joined by a zone
link with the machine's intra-node bandwidth (GB/s) and latency (ms).
Machines are joined by their measured inter-node bandwidth.

A Zorse plan (`pipeline_config`) gives per stage its GPUs (`gpu_ranks`,
global ranks), uneven `num_microbatches_per_rank`, a block range
(`layer_partition`, half-open; the first stage also holds the embedding, the
last the head), its ZeRO groups, and the interleave (ministage) degree.
Each GPU is one lane (Zorse has no tensor parallelism); a stage's ZeRO group
shards parameters (ZeRO-3). The schedule is Zorse's: boundary activations
live on the host and each ministage is recomputed from them. A stage with
several ZeRO groups is imported with one (hetc shards over a stage's lanes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from hetc.ir.errors import UsageError
from hetc.importers.common import catalog_devices, laid_out, read_input_json, render, require_dir
from hetc.ir.jsontypes import RawJson
from hetc.passes.cost.sources.devices import catalog_name
from hetc.passes.cost.sources.zorse_data import DTYPES, STATS
from hetc.ir.spec import (AUTO, Arch, ClusterSpec, DType, IntraLinkSpec, LayerRange, LinkSpec, ModelSpec,
                       NodeSpec, OffloadSpec, OffloadTarget, ParallelSpec, RankSlice, Routing, RoutingKind,
                       ScheduleKind, Spec, StageSpec, TrainSpec, ZeroSpec)

__all__ = ["import_zorse"]

log = logging.getLogger(__name__)

GB = 1e9
MS = 1e-3
# Zorse's model names say the family; head sizes follow the published configurations.
_FAMILIES = {"llama": (Arch.LLAMA, 128), "mistral": (Arch.LLAMA, 128), "gpt": (Arch.GPT, 64)}


class _Placed(NamedTuple):
    """Where a Zorse GPU rank lands in the spec's cluster."""

    group: str    # its node group
    kind: str     # its device kind (the catalog's name)
    local: int    # its index among the group's GPUs


def import_zorse(data: str, cluster: str, model_name: str, plan: str | None) -> str:
    folder = require_dir(data, "Zorse folder")
    stats = read_input_json(folder / STATS, "Zorse model stats")
    with laid_out("Zorse model stats", folder / STATS):
        if model_name not in stats:
            raise UsageError(f"model '{model_name}' is not in {folder / STATS}; "
                             f"known: {', '.join(sorted(stats))}")
        shape = stats[model_name]
    info = read_input_json(cluster, "Zorse cluster description")
    config = read_input_json(plan, "Zorse plan") if plan else {}
    with laid_out("Zorse plan", plan or ""):
        model = _model(model_name, shape, config)
    with laid_out("Zorse cluster description", cluster):
        gpus, nodes, links = _cluster(info, cluster)
        inter = _inter_bandwidth(info)
    kinds = {g.kind for g in gpus.values()}
    if plan:
        with laid_out("Zorse plan", plan):
            parallel = _plan(config, model, gpus, Path(plan).name)
            train = TrainSpec(global_batch=_int(config, "global_batch_size", plan),
                              micro_batch=_int(config, "microbatch_size", plan))
    else:
        parallel, train = ParallelSpec(schedule=AUTO, stages=AUTO), TrainSpec(global_batch=128)
    cluster_spec = ClusterSpec(name="zorse", nodes=nodes, links=links)
    if inter is not None:   # else the spec's default
        cluster_spec = dataclasses.replace(cluster_spec, inter_bandwidth=inter)
    spec = Spec(model=model, devices=catalog_devices(kinds), train=train, parallel=parallel,
                cluster=cluster_spec)
    latency = config.get("latency")
    measured = f" (Zorse's latency: {latency:.0f} ms)" if isinstance(latency, float) else ""
    header = [f"Imported from Zorse by `hetc import zorse` (model {model_name}, cluster {Path(cluster).name}"
              + (f", plan {Path(plan).name}{measured})." if plan else ")."),
              f"Measured layer times: hetc explain SPEC --profile {folder}"]
    return render(spec, header)


def _int(config: RawJson, key: str, where: str) -> int:
    try:
        return int(config[key])
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"'{where}' has no integer '{key}'") from None


def _model(name: str, shape: RawJson, config: RawJson) -> ModelSpec:
    family = next((f for f in _FAMILIES if f in name.lower()), None)
    if family is None:
        raise UsageError(f"hetc trains decoder-only LLMs; '{name}' is not a GPT, Llama or Mistral model")
    arch, head_dim = _FAMILIES[family]
    try:
        hidden, layers, per_block = int(shape["hidden_size"]), int(shape["num_layers"]), \
            int(shape["parameters_per_layer"])
    except (KeyError, TypeError, ValueError) as err:
        raise UsageError(f"model stats of '{name}' lack {err}") from None
    # solve the FFN size from the block's parameter count (multi-head attention, no GQA)
    if arch is Arch.LLAMA:
        ffn = (per_block - 4 * hidden * hidden - 2 * hidden) // (3 * hidden)
    else:
        ffn = 4 * hidden
    return ModelSpec(name=name, arch=arch, layers=layers, hidden=hidden, heads=max(hidden // head_dim, 1),
                     ffn=ffn,
                     vocab=int(config.get("vocab_size", 32000)), seq=int(config.get("sequence_length", 2048)),
                     dtype=DType(DTYPES.get(config.get("autocast_dtype", "float16"), "fp16")))


def _cluster(info: RawJson,
             where: str) -> tuple[dict[int, _Placed], tuple[NodeSpec, ...], tuple[LinkSpec, ...]]:
    """{global rank: where it lands}, node groups, links."""
    try:
        machines = info["machines"]
        bandwidth = info.get("bandwidth", {})
    except (KeyError, TypeError):
        raise UsageError(f"'{where}' is not a Zorse cluster description (no \"machines\")") from None
    gpus: dict[int, _Placed] = {}
    nodes: list[NodeSpec] = []
    links: list[LinkSpec] = []
    for m_idx, machine in enumerate(machines):
        zone = str(machine.get("machine", f"m{m_idx}"))
        by_kind: dict[str, list[int]] = {}
        for gpu in machine.get("gpus", []):
            by_kind.setdefault(catalog_name(str(gpu["name"])), []).append(int(gpu["global_rank"]))
        intra = _intra(bandwidth, m_idx)
        for kind, ranks in sorted(by_kind.items()):
            group = f"{zone}_{kind}".replace("-", "_").lower()
            nodes.append(NodeSpec(name=group, device=kind, gpus=len(ranks), zone=zone, region=zone,
                                  intra=intra))
            for local, rank in enumerate(sorted(ranks)):
                gpus[rank] = _Placed(group, kind, local)
        if len(by_kind) > 1 and intra is not None:
            links.append(LinkSpec(a=zone, b=zone, bandwidth=intra.bandwidth, latency=intra.latency))
    if not gpus:
        raise UsageError(f"'{where}' lists no GPUs")
    return gpus, tuple(nodes), tuple(links)


def _intra(bandwidth: RawJson, machine: int) -> IntraLinkSpec | None:
    gbs = bandwidth.get("intranode_bandwidth", {}).get(str(machine))
    if gbs is None:
        return None
    latency = bandwidth.get("intranode_latency", {}).get(str(machine), 0.005)
    return IntraLinkSpec(bandwidth=float(gbs) * GB, latency=float(latency) * MS)


def _inter_bandwidth(info: RawJson) -> float | None:
    """The slowest inter-node link Zorse lists, bytes/s; None when it lists none."""
    inter = info.get("bandwidth", {}).get("internode_bandwidth", {})
    values = [float(v) for v in _leaves(inter)]
    return min(values) * GB if values else None


def _leaves(tree: RawJson) -> Iterator[RawJson]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def _plan(config: RawJson, model: ModelSpec, gpus: dict[int, _Placed], where: str) -> ParallelSpec:
    try:
        stages_cfg = config["pipeline_config"]
        interleave = int(config.get("interleave_degree", 1))
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"'{where}' is not a Zorse plan (no \"pipeline_config\")") from None
    stages, used = [], set()
    for s, cfg in enumerate(stages_cfg):
        try:
            ranks = [int(r) for r in cfg["gpu_ranks"]]
            counts = tuple(int(c) for c in cfg["num_microbatches_per_rank"])
            start, stop = (int(x) for x in cfg["layer_partition"])
        except (KeyError, TypeError, ValueError) as err:
            raise UsageError(f"'{where}': stage {s} lacks {err}") from None
        if len(cfg.get("zero_config", [ranks])) > 1:
            log.warning("%s: stage %d has %d ZeRO groups; imported as one over its %d lanes", where, s,
                        len(cfg["zero_config"]), len(ranks))
        unknown = [r for r in ranks if r not in gpus]
        if unknown:
            raise UsageError(f"'{where}': stage {s} uses GPU ranks {unknown} that the cluster does not have")
        first = 0 if s == 0 else start + 1
        last = model.layers + 1 if s == len(stages_cfg) - 1 else stop
        used |= set(ranks)
        stages.append(StageSpec(
            name=f"s{s}", layers=(LayerRange(first=model.layer_name(first), last=model.layer_name(last)),),
            ranks=tuple(_gpu(gpus[r]) for r in ranks), lanes=len(ranks),
            ministages=min(interleave, last - first + 1),
            microbatches=Routing(kind=RoutingKind.COUNTS, counts=counts),
            zero=ZeroSpec(level=3 if len(ranks) > 1 else 0)))
    idle = tuple(_gpu(v) for r, v in sorted(gpus.items()) if r not in used)
    return ParallelSpec(schedule=ScheduleKind.ZORSE, stages=tuple(stages), idle=idle,
                        offload=OffloadSpec(activations=OffloadTarget.CPU), prefetch=1)


def _gpu(entry: _Placed) -> RankSlice:
    group, _, local = entry
    return RankSlice(group=group, node_start=0, node_stop=None, gpu_start=local, gpu_stop=None,
                     node_is_slice=False, gpu_is_slice=False)
