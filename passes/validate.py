"""The validation pass: every rule a Spec must satisfy, as located errors.

Runs the independent checks (names, model shape, cluster, the model's dtype
on its device kinds, batch arithmetic, plan resolution, memory fit) and
reports all their diagnostics together.
A spec file that defines only some sections (a catalog, a shared cluster)
is checked for what it has.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hetc.ir.errors import Diagnostic, InternalError, SpecError, did_you_mean
from hetc.frontend.values import words
from hetc.ir.layout import layout_problem
from hetc.passes.cost.intra_lane import LaneLayout, splits_experts
from hetc.passes.cost.memory import state_bytes_per_param
from hetc.passes.data_check import check_data
from hetc.passes.cost.params import model_params
from hetc.passes.resolve import resolve_pipeline
from hetc.passes.validate_plan import check_plan
from hetc.passes.validate_precision import check_precision
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Job, Plan
from hetc.ir.spec import (AUTO, AttentionKind, CPKind, DeviceSpec, DType, LinkSpec, LrScheduleKind, ModelSpec, NodeSpec, OffloadSpec, OffloadTarget, Spec, StageSpec,
                       TrainSpec, ZeroShard, ZeroSpec, ClusterSpec, storage_dtype)
from hetc.ir.topology import MAX_GPUS, Topology
from hetc.ir.units import human_count

# Every rank's program lists each of its microbatches; beyond this a step is
# not a plan anyone runs, and resolving it would take seconds.
MAX_MICROBATCHES = 65536

__all__ = ["Checked", "check_model", "check_spec", "validate"]


@dataclass(frozen=True)
class Checked:
    """A Spec that passed validation, with what validation resolved."""

    spec: Spec
    topology: Topology | None
    pipeline: Pipeline | None   # None while the plan still has `auto`

    def explicit(self) -> Plan | None:
        """The plan with its blocks and pipeline typed as present; None while it still has `auto`."""
        if self.pipeline is None:
            return None
        job = self.job()
        if job is None:   # validation resolves a pipeline only for a whole spec, on its cluster
            raise InternalError("a resolved pipeline without a cluster, model, train or parallel block")
        return job.plan(self.pipeline)

    def job(self) -> Job | None:
        """The whole spec's blocks typed as present, its plan perhaps `auto`; None for a part of a spec."""
        return None if self.topology is None else Job.of(self.spec, self.topology)

    def plan(self) -> Plan:
        """`explicit()` of a spec that has no `auto` left (one the planner wrote, or a plan directory's)."""
        plan = self.explicit()
        if plan is None:
            raise InternalError("a written-out plan with `auto` left in it")
        return plan


def validate(spec: Spec, base_dir: Path | None = None) -> list[Diagnostic]:
    errors: list[Diagnostic] = []
    _check(spec, base_dir, errors)
    return errors


def check_spec(spec: Spec, base_dir: Path | None = None) -> Checked:
    """Validate and resolve; raise one SpecError carrying every problem."""
    errors: list[Diagnostic] = []
    topo, pipeline = _check(spec, base_dir, errors)
    if errors:
        raise SpecError(errors)
    return Checked(spec, topo, pipeline)


def _check(spec: Spec, base_dir: Path | None, errors: list[Diagnostic]) -> tuple[Topology | None, Pipeline | None]:
    _unique(spec.devices, "device kind", errors)
    if spec.model is not None:
        check_model(spec.model, errors)
    if spec.train is not None:
        _check_train(spec, spec.train, base_dir, errors)
    topo = None
    if spec.cluster is not None:
        topo = _check_cluster(spec, spec.cluster, errors)
        check_precision(spec, errors)
    if spec.parallel is not None and spec.cluster is None:
        errors.append(Diagnostic(spec.parallel.span, "a parallel plan needs a cluster block"))
    pipeline = None
    if topo is not None and (job := Job.of(spec, topo)) is not None and not errors:
        _check_parallel(job, errors)
        if not errors:
            pipeline = resolve_pipeline(job, errors)
        if pipeline is not None:
            check_plan(job.plan(pipeline), errors)
        _check_fit(job, errors)
    return topo, pipeline


_Named = DeviceSpec | NodeSpec | StageSpec


def _unique(nodes: Sequence[_Named], what: str, errors: list[Diagnostic]) -> None:
    seen: dict[str, _Named] = {}
    for n in nodes:
        if n.name in seen:
            errors.append(Diagnostic(n.span_of("name"), f"duplicate {what} '{n.name}'",
                                     notes=((seen[n.name].span_of("name"), "first defined here"),)))
        else:
            seen[n.name] = n


def _check_grad_dtype(m: ModelSpec, errors: list[Diagnostic]) -> None:
    """Gradients in fp32 or in the format the model keeps its tensors in (Note [gradient dtype])."""
    kept = storage_dtype(m.dtype)
    if m.grad_dtype is not None and m.grad_dtype not in (DType.FP32, kept):
        choices = " or ".join(sorted({DType.FP32.value, kept.value}))
        errors.append(Diagnostic(m.span_of("grad_dtype"), f"grad_dtype = {m.grad_dtype.value}: a model of dtype "
                                 f"{m.dtype.value} accumulates its gradients in {choices}"))


def check_model(m: ModelSpec, errors: list[Diagnostic]) -> None:
    """The model's own rules (heads divide hidden, rotary head sizes even, MoE top_k, pretrained weights)."""
    if m.hidden % m.heads and m.head_dim is None:
        errors.append(Diagnostic(m.span_of("hidden"), f"hidden ({m.hidden}) is not divisible by heads ({m.heads})"))
    if m.heads % m.num_kv_heads:
        errors.append(Diagnostic(m.span_of("kv_heads"), f"heads ({m.heads}) is not divisible by kv_heads "
                                 f"({m.num_kv_heads})"))
    if m.arch.value == "llama" and m.head_dim is None and (m.hidden // m.heads) % 2:
        errors.append(Diagnostic(m.span_of("heads"), f"the head size hidden / heads = {m.hidden} / {m.heads} = "
                                 f"{m.hidden // m.heads} must be even for rotary embeddings (llama)"))
    elif m.arch.value == "llama" and m.head_size % 2:
        errors.append(Diagnostic(m.span_of("head_dim"), f"head_dim ({m.head_size}) must be even for rotary "
                                 "embeddings (llama)"))
    _check_grad_dtype(m, errors)
    _check_init(m, errors)
    if m.moe is not None and m.moe.top_k > m.moe.experts:
        errors.append(Diagnostic(m.moe.span_of("top_k"), f"top_k ({m.moe.top_k}) exceeds the number of "
                                 f"experts ({m.moe.experts})"))


def _check_init(m: ModelSpec, errors: list[Diagnostic]) -> None:
    """Pretrained weights need an hf directory whose safetensors are exactly the model's (headers only)."""
    from hetc.hf.weights import hf_has_weights, model_weight_problems, pretrained_dir
    from hetc.ir.spec import InitKind

    if m.init is InitKind.PRETRAINED and not hf_has_weights(m):
        why = "the model has no hf directory" if not m.hf else f"'{m.hf}' holds no safetensors"
        errors.append(Diagnostic(m.span_of("init"), f"init = pretrained, but {why}"))
    elif (directory := pretrained_dir(m)) is not None:
        problems = model_weight_problems(m, directory)
        if problems:
            errors.append(Diagnostic(m.span_of("hf"), f"the safetensors in '{m.hf}' do not fit the model: "
                                     + "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "")))


def _check_train(spec: Spec, t: TrainSpec, base_dir: Path | None, errors: list[Diagnostic]) -> None:
    if t.global_batch % t.micro_batch:
        errors.append(Diagnostic(t.span_of("global_batch"), f"global_batch ({t.global_batch}) is not a multiple "
                                 f"of micro_batch ({t.micro_batch})"))
    elif t.global_batch // t.micro_batch > MAX_MICROBATCHES:
        errors.append(Diagnostic(t.span_of("global_batch"), f"global_batch / micro_batch = {t.global_batch} / "
                                 f"{t.micro_batch} = {t.global_batch // t.micro_batch} microbatches a step; hetc "
                                 f"schedules at most {MAX_MICROBATCHES}: raise micro_batch"))
    _check_lr_schedule(t, errors)
    _check_loss_scale(spec, t, errors)
    check_data(spec.model, t, base_dir, errors)


def _check_loss_scale(spec: Spec, t: TrainSpec, errors: list[Diagnostic]) -> None:
    """A loss scale is fp16's (runtime/loss_scale.py), and starts at or above its floor."""
    scale = t.loss_scale
    if t.written("loss_scale") and spec.model is not None and spec.model.dtype is not DType.FP16:
        errors.append(Diagnostic(t.span_of("loss_scale"), f"loss_scale scales fp16 gradients; the model trains "
                                 f"in {spec.model.dtype.value}, which needs none"))
    if scale.initial < scale.min:
        errors.append(Diagnostic(scale.span_of("initial"), f"initial = {scale.initial:g} is below min = "
                                 f"{scale.min:g}, the floor the scale never falls under"))


def _check_lr_schedule(t: TrainSpec, errors: list[Diagnostic]) -> None:
    """The schedule's keys must mean something for its kind, and a decay must not raise the rate (Megatron-LM
    asserts min_lr <= lr); runtime/optim.py `lr_at` computes it."""
    sched = t.lr_schedule
    kind = sched.kind
    if kind is not LrScheduleKind.WSD and sched.written("decay"):
        errors.append(Diagnostic(sched.span_of("decay"), f"decay shapes a wsd schedule's decay; lr_schedule "
                                 f"{kind.value} " + ("does not decay" if kind is LrScheduleKind.CONSTANT else
                                                     "decays as its name says (or write lr_schedule wsd)")))
    if kind in (LrScheduleKind.CONSTANT, LrScheduleKind.INVERSE_SQRT) and sched.written("decay_steps"):
        ends = "does not decay" if kind is LrScheduleKind.CONSTANT else "decays without an end"
        errors.append(Diagnostic(sched.span_of("decay_steps"), f"lr_schedule {kind.value} {ends}; decay_steps "
                                 "needs cosine, linear or wsd"))
    if kind is LrScheduleKind.CONSTANT:
        return
    if sched.min_lr > t.lr:
        errors.append(Diagnostic(sched.span_of("min_lr"), f"min_lr = {sched.min_lr:g} is above lr = {t.lr:g}: "
                                 "the decay would raise the learning rate"))
    if kind is not LrScheduleKind.WSD:
        return
    if sched.decay_steps == 0:
        errors.append(Diagnostic(sched.span, "lr_schedule wsd needs decay_steps = N: its last N steps decay from "
                                 "lr to min_lr"))
    elif sched.warmup + sched.decay_steps > t.steps:
        errors.append(Diagnostic(sched.span_of("decay_steps"), f"warmup + decay_steps = {sched.warmup} + "
                                 f"{sched.decay_steps} is more than the run's steps = {t.steps}: the decay "
                                 "would begin during warm-up"))


def _check_cluster(spec: Spec, c: ClusterSpec, errors: list[Diagnostic]) -> Topology | None:
    _unique(c.nodes, "node group", errors)
    names = [d.name for d in spec.devices]
    for n in c.nodes:
        if spec.device(n.device) is None:
            hint = did_you_mean(n.device, names) or (" (no device kinds are defined; add use \"catalog.het\")"
                                                     if not names else "")
            errors.append(Diagnostic(n.span_of("device"), f"unknown device kind '{n.device}'{hint}"))
    total = sum(n.count * n.gpus for n in c.nodes)
    if total > MAX_GPUS:
        errors.append(Diagnostic(c.span, f"the cluster has {total} GPUs; hetc plans at most {MAX_GPUS} (a bound "
                                 "of time and memory: planning and compiling grow with every GPU); split the "
                                 "job, or plan a part of the cluster"))
        return None
    if not c.nodes:
        errors.append(Diagnostic(c.span, "the cluster has no nodes"))
        return None
    topo = Topology(c, spec.devices)
    ends = topo.endpoints()
    seen: dict[frozenset[str], LinkSpec] = {}
    for link in c.links:
        for field_name, end in (("a", link.a), ("b", link.b)):
            if end not in ends:
                errors.append(Diagnostic(link.span_of(field_name), f"unknown link end '{end}'"
                                         f"{did_you_mean(end, ends)}; "
                                         "a link joins node groups, zones or regions"))
        key = frozenset((link.a, link.b))
        if key in seen:
            errors.append(Diagnostic(link.span, f"duplicate link {link.a} <-> {link.b}",
                                     notes=((seen[key].span, "first defined here"),)))
        seen[key] = link
    return topo


def _check_offload_targets(off: OffloadSpec, errors: list[Diagnostic]) -> None:
    """`nvme` is DeepSpeed's word, but hetc's runtime keeps offloaded state in host memory and the cost
    model charges the host link: a plan that says nvme would run and be costed as cpu, so it is refused."""
    for key in ("params", "optimizer", "activations"):
        if getattr(off, key) is OffloadTarget.NVME:
            errors.append(Diagnostic(off.span_of(key), f"{key} = nvme: hetc offloads to host memory only (the "
                                     f"runtime and the cost model have no NVMe path); write {key} = cpu"))


def _check_parallel(job: Job, errors: list[Diagnostic]) -> None:
    par, m = job.parallel, job.model
    _check_zero(par.zero, errors)
    for off in (par.offload, *(st.offload for st in (() if par.stages is AUTO else par.stages) if st.offload)):
        _check_offload_targets(off, errors)
    if par.stages is AUTO:
        return
    _unique(par.stages, "stage", errors)
    explicit = [st for st in par.stages if st.layers is not AUTO]
    for st in par.stages:
        if explicit and st.layers is AUTO:
            errors.append(Diagnostic(st.span, f"stage '{st.name}' has no layers; write layers = ... (or leave "
                                     "layers out of every stage to let the planner choose)"))
        if st.zero is not None:
            _check_zero(st.zero, errors)
        if st.tp is not AUTO:
            _check_tp_heads(m, st, errors)
        if st.cp is not AUTO and m.seq % st.cp:
            errors.append(Diagnostic(st.span_of("cp"), f"seq ({m.seq}) is not divisible by cp ({st.cp}) "
                                     f"in stage '{st.name}'"))
        elif st.tp is not AUTO and st.cp is not AUTO:
            _check_layout(m, st, LaneLayout(st.tp, st.cp, st.cp_kind, st.sequence_parallel), errors)
        if st.ep != 1:
            _check_experts(m, st, st.zero or par.zero, errors)
        _check_grad_accum(job.train, st, errors)


def _check_layout(m: ModelSpec, st: StageSpec, layout: LaneLayout, errors: list[Diagnostic]) -> None:
    """The stage's block layout must cut the sequence (and Ulysses the heads) into whole parts.

    Every border of the stage carries its layout (hetc/ir/layout.py); a layout
    the sequence cannot take leaves no transform to the other side.
    """
    problem = layout_problem(layout, m.seq)
    if problem is not None:
        field, why = problem
        errors.append(Diagnostic(st.span_of(field), f"{why}, but seq ({m.seq}) does not split so: stage "
                                 f"'{st.name}' has no block layout for its borders"))
    tp, cp = layout.tp, layout.cp
    if splits_experts(m, tp):
        errors.append(Diagnostic(st.span_of("tp"), f"stage '{st.name}' splits MoE blocks over tp ({tp}), which "
                                 "hetc does not implement; use tp = 1 with cp, lanes or ep (expert parallelism)"))
    if cp > 1 and layout.cp_kind is CPKind.ULYSSES and m.heads % tp == 0 and (m.heads // tp) % cp:
        errors.append(Diagnostic(st.span_of("cp"), f"Ulysses spreads the {m.heads // tp} query heads of each "
                                 f"tp rank over cp ({cp}) ranks in stage '{st.name}'; use ring attention "
                                 "or a cp that divides them"))
    if cp > 1 and layout.cp_kind is CPKind.RING and m.attention is AttentionKind.UNFUSED:
        errors.append(Diagnostic(st.span_of("cp"), f"stage '{st.name}' runs ring attention (cp = {cp}), which "
                                 "is blockwise flash attention, but the model says attention = unfused; use "
                                 "attention = flash, or cp_kind = ulysses (which runs the model's own core)"))
    if cp > 1 and layout.cp_kind is CPKind.RING and m.attention_dropout > 0:
        errors.append(Diagnostic(st.span_of("cp"), f"stage '{st.name}' runs ring attention (cp = {cp}), which "
                                 f"has no dropout, but the model sets attention_dropout ({m.attention_dropout:g}); "
                                 "use attention_dropout = 0, or cp_kind = ulysses (whose core drops out)"))


def _check_experts(m: ModelSpec, st: StageSpec, zero: ZeroSpec, errors: list[Diagnostic]) -> None:
    """Expert parallelism groups ep lanes of the stage; each holds experts / ep of every MoE block."""
    where = st.span_of("ep")
    if m.moe is None:
        errors.append(Diagnostic(where, f"stage '{st.name}' sets ep ({st.ep}), but the model has no experts; "
                                 "add a moe block to the model or leave ep at 1"))
        return
    if m.moe.experts % st.ep:
        errors.append(Diagnostic(where, f"the model's {m.moe.experts} experts do not split over ep ({st.ep}) in "
                                 f"stage '{st.name}'"))
    if st.lanes is not AUTO and st.lanes % st.ep:
        errors.append(Diagnostic(where, f"stage '{st.name}' has {st.lanes} lanes, which do not form groups of ep "
                                 f"({st.ep}): expert-parallel groups are made of whole lanes"))
    if zero.level is not AUTO and zero.level >= 3 or zero.shard is ZeroShard.NODE and zero.level != 0:
        what = "ZeRO-3" if zero.level is not AUTO and zero.level >= 3 else "hierarchical ZeRO (shard = node)"
        errors.append(Diagnostic(where, f"{what} with expert parallelism is not implemented (stage "
                                 f"'{st.name}'); use ZeRO ≤ 2 over all lanes"))


def _check_tp_heads(m: ModelSpec, st: StageSpec, errors: list[Diagnostic]) -> None:
    """tp splits the query and the key/value heads: one error naming the counts it does not divide and the
    degrees that would."""
    assert isinstance(st.tp, int)
    undivided = [f"{what} ({n})" for what, n in (("heads", m.heads), ("kv_heads", m.num_kv_heads)) if n % st.tp]
    if not undivided:
        return
    common = math.gcd(m.heads, m.num_kv_heads)
    degrees = [d for d in range(1, common + 1) if common % d == 0]
    verb = "is" if len(undivided) == 1 else "are"
    errors.append(Diagnostic(st.span_of("tp"), f"{' and '.join(undivided)} {verb} not divisible by tp ({st.tp}) "
                                               f"in stage '{st.name}'; tp can be {words(degrees)}"))


def _check_zero(z: ZeroSpec, errors: list[Diagnostic]) -> None:
    if z.across and z.shard is not ZeroShard.NODE:
        errors.append(Diagnostic(z.span_of("across"), "across applies between shard groups: set shard = node"))


def _check_grad_accum(t: TrainSpec, st: StageSpec, errors: list[Diagnostic]) -> None:
    if t.grad_accum is None or st.lanes is AUTO or st.microbatches is AUTO or \
            st.microbatches.kind.value == "counts":
        return
    total = t.micro_batch * t.grad_accum * st.lanes
    if total != t.global_batch:
        errors.append(Diagnostic(t.span_of("global_batch"), f"global_batch ({t.global_batch}) ≠ micro_batch "
                                 f"({t.micro_batch}) × grad_accum ({t.grad_accum}) × lanes ({st.lanes}) of stage "
                                 f"'{st.name}' = {total}"))


def _check_fit(job: Job, errors: list[Diagnostic]) -> None:
    """Model states must fit in the cluster's memory even fully sharded (ZeRO-3 over all GPUs)."""
    m, topo = job.model, job.topology
    phi = model_params(m)
    per_param = state_bytes_per_param(m)   # the cost model's bytes per parameter (DESIGN.md §3)
    need = phi * (per_param.params + per_param.grads + per_param.optimizer)
    gpu_memory = sum(g.device.memory for g in topo.gpus)
    off = job.parallel.offload
    offloads = off.params is not OffloadTarget.NONE or off.optimizer is not OffloadTarget.NONE
    host_memory = sum(n.host_memory * n.count for n in job.cluster.nodes) if offloads else 0.0
    if need > gpu_memory + host_memory:
        host = f" and {host_memory / 2**30:.1f} GiB of host memory for offload" if host_memory else ""
        errors.append(Diagnostic(m.span, f"the model's parameters, gradients and optimizer state need "
                                 f"{need / 2**30:.1f} GiB ({human_count(phi)} parameters) but even fully sharded "
                                 f"the cluster has {gpu_memory / 2**30:.1f} GiB on {topo.num_gpus} GPUs{host}"))
