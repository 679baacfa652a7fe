"""Sailor's inputs as a .het spec: model, cluster and (with --plan) the plan.

A Sailor plan (`pipeline_list[0]`) gives per stage its layers
(`layers_per_stage`, indices over [embed, blocks, head]), one entry per data-
parallel replica in `tmp_per_stage` (`[[[gpu, gpus_per_node, zone], ...], tp]`:
the VMs the replica runs on and its TP degree), `mbs` and `gbs`. It ran
Megatron-DeepSpeed: 1F1B, TP inside a node, replica j of every stage forms
pipeline j, gradients all-reduced after the flush (ZeRO-0). Each replica
becomes one lane on its own node; nodes of one (GPU kind, GPUs per node,
zone) form a node group.

With --quotas (`{gpu_kind: {zone: gpus}}`) the cluster holds those GPUs and
the plan is `auto`, for `hetc plan`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from hetc.ir.errors import InternalError, UsageError
from hetc.importers.common import (NodeBook, catalog_devices, gpu_slice, layer_range, read_input_json, render,
                                   require_dir)
from hetc.ir.jsontypes import RawJson
from hetc.passes.cost import Estimate
from hetc.passes.cost.profiles import NetworkFits, ProfileError, Profiles
from hetc.passes.cost.sources.devices import catalog_name
from hetc.passes.cost.sources.sailor_data import SailorModel, read_json, read_models, read_sailor
from hetc.ir.spec import (AUTO, ClusterSpec, DType, IntraLinkSpec, LinkSpec, ModelSpec, OptimizerSpec,
                       ParallelSpec, RankSlice, Routing, ScheduleKind, Spec, StageSpec, TrainSpec, ZeroSpec)

if TYPE_CHECKING:   # the loader and validator are imported where a plan is loaded, as hetc.compiler is
    from hetc.ir.plan import Plan

__all__ = ["explain_plan", "import_sailor", "imported_plan", "plan_model"]

log = logging.getLogger(__name__)

# Links in the spec are constants; the cost model uses Sailor's size-dependent fits when given
# the data folder (--profile). The constants are the fits at this message size.
REFERENCE_MESSAGE = 64e6
DEFAULT_GPUS_PER_NODE = 4


def import_sailor(data: str, model_name: str, plan: str | None, quotas: str | None) -> str:
    folder = require_dir(data, "Sailor data folder")
    try:
        models = read_models(folder)
        net = read_sailor(folder).network
    except ProfileError as err:
        raise UsageError(str(err)) from None
    model = models.get(model_name)
    if model is None:
        raise UsageError(f"no training_config_*.json in '{folder}' describes model '{model_name}'; "
                         f"known: {', '.join(sorted(models)) or 'none'}")
    book = NodeBook()
    if plan is not None:
        raw = read_input_json(plan, "Sailor plan")
        parallel, train, idle, header = _plan(raw, model, book, Path(plan).name)
    elif quotas is None:
        raise UsageError("hetc import sailor needs --plan or --quotas")
    else:
        raw = read_input_json(quotas, "quotas file")
        _quotas(raw, book, folder)
        parallel = ParallelSpec(schedule=AUTO, stages=AUTO)
        train, idle, header = TrainSpec(global_batch=model.global_batch), (), [f"quotas: {Path(quotas).name}"]
    spec = Spec(model=_model_spec(model), devices=catalog_devices({k for k, _, _ in book.counts}),
                cluster=_cluster(book, net), train=train,
                parallel=dataclasses.replace(parallel, idle=idle) if idle else parallel)
    return render(spec, [f"Imported from Sailor by `hetc import sailor` (model {model_name}, data {folder}).",
                         *header,
                         f"Measured layer times and network fits: hetc explain SPEC --profile {folder}"])


def plan_model(data: str, plan: str) -> str:
    """The model a Sailor plan trains: the one whose layers (embedding, blocks, head) its stages cover.

    Sailor's plans do not name their model; the layer count tells the
    models of a data folder apart (OPT-350: 26, GPT-Neo-2.7: 34).
    """
    folder = require_dir(data, "Sailor data folder")
    raw = read_input_json(plan, "Sailor plan")
    try:
        covered = sum(len(layers) for layers in raw["pipeline_list"][0]["layers_per_stage"])
        models = read_models(folder)
    except (KeyError, IndexError, TypeError) as err:
        raise UsageError(f"'{plan}' is not a Sailor plan: missing or bad {err}") from None
    except ProfileError as err:
        raise UsageError(str(err)) from None
    fits = sorted(name for name, m in models.items() if m.layers + 2 == covered)
    if len(fits) != 1:
        known = ", ".join(f"{name} ({m.layers + 2})" for name, m in sorted(models.items())) or "none"
        raise UsageError(f"'{plan}' covers {covered} layers: {'several' if fits else 'no'} model in "
                         f"'{folder}' has that many (known: {known}); name it with --model")
    return fits[0]


def explain_plan(data: str, plan: str, profiles: Profiles | None, model: str | None = None) -> Estimate:
    """`hetc import sailor` then `hetc explain --profile`: the cost model's estimate for a Sailor plan, timed as
    Megatron-DeepSpeed runs it (its sends and receives block: Note [async sends]).

    `model` is Sailor's model name; by default the one the plan's layer count names (`plan_model`).
    """
    from hetc.passes.cost import CostModel
    from hetc.passes.cost.transfers import Engine

    return CostModel(imported_plan(data, plan, model), profiles, Engine.MEGATRON).estimate()


def imported_plan(data: str, plan: str, model: str | None = None) -> Plan:
    """A Sailor plan as `hetc import sailor` writes it, loaded and checked (`model` as in `explain_plan`)."""
    import tempfile

    from hetc.compiler import load_checked

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "plan.het"
        spec.write_text(import_sailor(data, model or plan_model(data, plan), plan, None))
        _, checked = load_checked(spec)
    explicit = checked.explicit()
    if explicit is None:   # _plan writes every stage of the Sailor plan
        raise InternalError("a Sailor plan imported with `auto` left in it")
    return explicit


def _model_spec(m: SailorModel) -> ModelSpec:
    # Sailor's runs keep fp32 weights (4 bytes per parameter in llm_info.json) but their matmuls run on
    # tensor cores: the profiled A100 and GH200 layers exceed the fp32 peak. That is tf32 (on GPUs
    # without TF32 the peak falls back to fp32). Megatron keeps a copy of a tied embedding on the last
    # stage, so an untied model counts that memory right.
    return ModelSpec(name=m.name, arch=m.arch, layers=m.layers, hidden=m.hidden, heads=m.heads, ffn=m.ffn,
                     vocab=m.vocab, seq=m.seq, dtype=DType.TF32 if m.dtype_bytes == 4 else DType.FP16,
                     tied_embeddings=False, optimizer=OptimizerSpec(beta2=0.999))


def _plan(raw: RawJson, model: SailorModel, book: NodeBook,
          name: str) -> tuple[ParallelSpec, TrainSpec, tuple[RankSlice, ...], list[str]]:
    """(the plan, the job, the GPUs it leaves idle, header lines) of Sailor plan `raw`."""
    try:
        pipeline = raw["pipeline_list"][0]
        stages_layers, replicas = pipeline["layers_per_stage"], pipeline["tmp_per_stage"]
        mbs, gbs = int(raw["mbs"]), int(raw["gbs"])
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise UsageError(f"'{name}' is not a Sailor plan: missing or bad {err}") from None
    if len(raw["pipeline_list"]) > 1:
        raise UsageError(f"'{name}' has {len(raw['pipeline_list'])} pipelines; hetc imports one "
                         "(Sailor's heterogeneous plans put all replicas in one pipeline)")
    if len(stages_layers) != len(replicas):
        raise UsageError(f"'{name}': {len(stages_layers)} layer lists but {len(replicas)} stages in "
                         "tmp_per_stage")
    hetc_model = _model_spec(model)
    stages: list[StageSpec] = []
    idle: list[RankSlice] = []
    first = 0
    for s, (layers, reps) in enumerate(zip(stages_layers, replicas)):
        stop = first + len(layers)
        if list(layers) != list(range(first, stop)):
            log.warning("%s: stage %d lists layers %s; taking the contiguous range %d..%d", name, s, layers,
                        first, stop - 1)
        stage, unused = _stage(s, reps, hetc_model, first, stop, book, name)
        stages.append(stage)
        idle += unused
        first = stop
    if first != model.layers + 2:
        raise UsageError(f"'{name}' covers {first} layers but {model.name} has {model.layers + 2} "
                         f"(embedding, {model.layers} blocks, head)")
    measured = [f"{k} = {raw[k]}" for k in ("real", "red_grads", "max_mem") if k in raw]
    header = [f"plan: {name}" + (f" (measured: {', '.join(measured)})" if measured else "")]
    parallel = ParallelSpec(schedule=ScheduleKind.ONE_F_ONE_B, zero=ZeroSpec(level=0), stages=tuple(stages))
    return parallel, TrainSpec(global_batch=gbs, micro_batch=mbs), tuple(idle), header


def _stage(s: int, reps: RawJson, model: ModelSpec, first: int, stop: int, book: NodeBook,
           name: str) -> tuple[StageSpec, list[RankSlice]]:
    ranks: list[RankSlice] = []
    idle: list[RankSlice] = []
    tps: set[int] = set()
    for j, rep in enumerate(reps):
        try:
            vms, tp = rep[0], int(rep[1])
            kind, per_node, zone = catalog_name(str(vms[0][0])), int(vms[0][1]), str(vms[0][2])
        except (IndexError, TypeError, ValueError) as err:
            raise UsageError(f"'{name}': stage {s} replica {j} is not [[[gpu, gpus_per_node, zone]], tp] "
                             f"({err})") from None
        if len(vms) != 1 or tp > per_node:
            raise UsageError(f"'{name}': stage {s} replica {j} spans {len(vms)} VMs (tp {tp}); hetc keeps "
                             "tensor parallelism inside one node")
        group, node = book.take(kind, per_node, zone)
        ranks.append(gpu_slice(group, node, 0, tp))
        if tp < per_node:
            idle.append(gpu_slice(group, node, tp, per_node))
        tps.add(tp)
    if len(tps) != 1:
        raise UsageError(f"'{name}': stage {s} mixes TP degrees {sorted(tps)}; a hetc stage has one")
    stage = StageSpec(name=f"s{s}", layers=(layer_range(model, first, stop),), ranks=tuple(ranks),
                      lanes=len(reps), tp=tps.pop(), microbatches=Routing())
    return stage, idle


def _quotas(raw: RawJson, book: NodeBook, folder: Path) -> None:
    basic = folder / "basic_cluster_config.json"
    cfg = read_json(basic) if basic.is_file() else {}
    if not isinstance(raw, dict) or not raw:
        raise UsageError('a quotas file maps GPU kinds to {zone: GPUs}, e.g. '
                         '{"A100-40": {"us-central1-a": 8}}')
    for gpu, zones in raw.items():
        per_node = int(cfg.get(gpu, {}).get("gpus_per_node", DEFAULT_GPUS_PER_NODE))
        if not isinstance(zones, dict):
            raise UsageError(f"quotas: '{gpu}' must map zones to GPU counts")
        for zone, count in zones.items():
            if not isinstance(count, int) or count < 0 or count % per_node:
                raise UsageError(f"quotas: {gpu} in {zone}: {count} is not a multiple of {per_node} GPUs "
                                 "per node")
            for _ in range(count // per_node):
                book.take(catalog_name(gpu), per_node, zone)


def _cluster(book: NodeBook, net: NetworkFits) -> ClusterSpec:
    def intra(kind: str, gpus: int) -> IntraLinkSpec | None:
        fit = net.intra_rate(kind, gpus)
        return IntraLinkSpec(bandwidth=fit.rate(REFERENCE_MESSAGE)) if fit is not None else None

    nodes = book.node_specs(_region, intra)
    links = []
    for i, a in enumerate(nodes):
        for b in nodes[i:]:
            fit = net.inter_rate(a.zone, a.device, b.zone, b.device, min(a.gpus, b.gpus))
            if fit is not None:
                links.append(LinkSpec(a=a.name, b=b.name, bandwidth=fit.rate(REFERENCE_MESSAGE)))
    return ClusterSpec(name="sailor", nodes=nodes, links=tuple(links))


def _region(zone: str) -> str:
    """GCP zones are region-letter: us-central1-a is in us-central1."""
    head, _, tail = zone.rpartition("-")
    return head if head and len(tail) == 1 else zone
