"""The analytic estimate of a whole plan: step time, throughput, memory per rank, traffic per group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import asdict, dataclass, replace

from hetc.ir.jsontypes import JsonObject
from hetc.ir.layout import border_copies
from hetc.passes.cost import traffic
from hetc.passes.cost.experts import ep_comm_time, ep_group, expert_group
from hetc.passes.cost.classes import PlanTime, throughput, tokens_per_step
from hetc.passes.cost.memory import RankMemory
from hetc.passes.cost.pipeline_stage import pipeline_stages
from hetc.passes.cost.plan_time import border_time, stage_sync_time, unit_numels, zorse_unit
from hetc.passes.cost.provenance import Provenance, provenance
from hetc.passes.cost.schedule import LaneTiming
from hetc.passes.cost.shapes import LayerKind, layer_kind
from hetc.passes.cost.transfers import Engine
from hetc.passes.cost.utilization import Utilization, flop_counts, utilization
from hetc.ir.pipeline import Stage
from hetc.ir.program import Collective
from hetc.ir.spec import MoESpec, ScheduleKind

if TYPE_CHECKING:     # the cost model imports this module
    from hetc.passes.cost.model import CostModel

__all__ = ["Estimate", "GroupTraffic", "RankMemory", "build_estimate", "with_simulated_step"]


@dataclass(frozen=True)
class GroupTraffic:
    kind: str                  # dp, pp, tp, cp, ep, emb (a tied embedding's copies)
    group: str
    ranks: tuple[int, ...]     # one representative group
    bytes_per_step: float      # sent by one rank (pp: the whole border)
    seconds_per_step: float    # spent in these transfers by one rank, overlapped or not
    note: str = ""


@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    tokens_per_step: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    utilization: Utilization
    time: PlanTime
    memory: tuple[RankMemory, ...]
    traffic: tuple[GroupTraffic, ...]
    schedule: str
    engine: Engine            # whose point-to-point behaviour was timed (Note [async sends])
    provenance: Provenance   # where the layer times and link rates came from; profiles left unused
    # the closed form's own step where `step_time_s` is the compiled program's simulated one (Note [one step
    # time] in passes/simulated_step.py); None: `step_time_s` is the closed form's
    closed_form_s: float | None = None
    # the closed form's memory where `memory` is the compiled programs' peaks (the same note); None: `memory` is
    # the closed form's
    closed_form_memory: tuple[RankMemory, ...] | None = None

    @property
    def tokens_per_s(self) -> float:
        return throughput(self.tokens_per_step, self.step_time_s)

    @property
    def closed_form_step_s(self) -> float:
        """The closed form's step, whichever step `step_time_s` is (what the planner's score mirrors)."""
        return self.step_time_s if self.closed_form_s is None else self.closed_form_s

    @property
    def closed_form_ranks(self) -> tuple[RankMemory, ...]:
        """The closed form's memory per rank, whichever memory `memory` is."""
        return self.memory if self.closed_form_memory is None else self.closed_form_memory

    @property
    def mfu(self) -> float:
        """Over the GPUs the plan uses (Note [utilization])."""
        return self.utilization.mfu

    @property
    def hfu(self) -> float:
        return self.utilization.hfu

    @property
    def peak_flops(self) -> float:
        """The used GPUs' peak FLOP/s in the training dtype."""
        return self.utilization.used_peak_flops

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    def to_json(self) -> JsonObject:
        t = self.time
        return {
            "step_time_s": self.step_time_s, "step_source": "estimate" if self.closed_form_s is None else "simulated",
            "estimate_step_s": self.closed_form_step_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s, **self.utilization.to_json(),
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step, "schedule": self.schedule,
            "engine": self.engine,
            "time": {"pipeline_s": t.pipeline, "bubble_s": t.bubble, "tail_s": t.tail,
                     "bottleneck": list(t.bottleneck) if t.bottleneck else None},
            "fits": self.fits,
            "memory_source": "estimate" if self.closed_form_memory is None else "compiled",
            "memory": [{**asdict(m), "total": m.total, "fits": m.fits, "estimate_total": closed.total}
                       for m, closed in zip(self.memory, self.closed_form_ranks, strict=True)],
            "traffic": [{**asdict(g), "ranks": list(g.ranks)} for g in self.traffic],
            "lanes": [{"stage": x.stage, "lane": x.lane, "microbatches": x.microbatches,
                       "forward_s": x.forward, "backward_s": x.backward, "p2p_s": x.p2p,
                       "p2p_wait_s": x.p2p_wait, "overlapped_s": x.overlapped} for x in t.lanes],
            **self.provenance.to_json(),
        }


def build_estimate(cm: CostModel) -> Estimate:
    p, m = cm.pipeline, cm.model
    timing = cm.evaluation.time
    tokens = tokens_per_step(p.num_microbatches, p.micro_batch, m.seq)
    flops = flop_counts(m, p)
    memory = sorted((mem for s in pipeline_stages(cm)
                     for mem, _ in s.memory_classes(cm.in_flight_limits[s.index], cm.interleaved_grouping)),
                    key=lambda mem: mem.rank)
    return Estimate(timing.step, tokens, flops.model, flops.hardware, utilization(m, p, cm.topology, timing.step),
                    timing, tuple(memory), tuple(_traffic(cm, timing)), p.schedule.value, cm.engine,
                    provenance(cm))


def with_simulated_step(estimate: Estimate, cm: CostModel, step: float, memory: tuple[RankMemory, ...]) -> Estimate:
    """`estimate` with the compiled program's simulated `step` as its step time (throughput and utilization
    follow) and its ranks' compiled `memory`, its own kept as `closed_form_s` and `closed_form_memory` (Note
    [one step time] in passes/simulated_step.py)."""
    return replace(estimate, step_time_s=step, utilization=utilization(cm.model, cm.pipeline, cm.topology, step),
                   closed_form_s=estimate.closed_form_step_s, memory=memory,
                   closed_form_memory=estimate.closed_form_ranks)


# ------------------------------------------------------------------ traffic


def _traffic(cm: CostModel, timing: PlanTime) -> list[GroupTraffic]:
    out: list[GroupTraffic] = []
    p, m = cm.pipeline, cm.model
    lanes = {(t.stage, t.lane): t for t in timing.lanes}
    for stage in p.stages:
        rank = stage.lanes[0].ranks[0]
        n_mb = max(len(lane.microbatches) for lane in stage.lanes)
        blocks = sum(1 for ms in stage.ministages for i in cm.ministage(ms).layers
                     if layer_kind(m, i) == LayerKind.BLOCK)
        replicas = len(cm.zero_group(rank))      # lanes × cp ranks
        if replicas > 1:
            dense = (cm.numel(ms, rank) * (1 - cm.expert_fraction(ms, rank)) for ms in stage.ministages)
            nbytes = sum(dense) * cm.delta
            level = stage.zero.resolved_level
            sent = traffic.zero_bytes(level, p.schedule, nbytes, replicas, n_mb, cm.states)
            if p.schedule is ScheduleKind.ZORSE:  # gathered for the forward and the backward, reduced once
                seconds = sum(2 * u.fetch + u.sync for u in (zorse_unit(cm, stage, ms) for ms in stage.ministages))
            else:
                seconds = stage_sync_time(cm, stage, rank) + n_mb * lanes[(stage.index, 0)].overlapped
            over = f"{len(stage.lanes)} lanes" + (f" x cp {stage.cp}" if stage.cp > 1 else "")
            units = len(unit_numels(cm, stage, rank))    # Note [zero-3 units]
            over += f", gathered per layer ({units} units)" if units else ""
            out.append(GroupTraffic("dp", f"stage {stage.name}: ZeRO-{level} over {over}",
                                    cm.zero_group(rank), sent, seconds))
        if stage.tp > 1 and blocks:
            sent = traffic.tp_bytes(stage.tp, p.micro_batch, m.seq // stage.cp, m.hidden, cm.delta)
            seconds = 2 * cm.tp_comm_time(rank)
            measured = not cm.compute.layer(cm.gpu(rank).device.name, LayerKind.BLOCK, p.micro_batch,
                                            stage.tp).needs_tp_comm
            out.append(GroupTraffic("tp", f"stage {stage.name}: tp {stage.tp}", cm.tp_group(rank),
                                    sent * blocks * n_mb, seconds * blocks * n_mb,
                                    "inside the measured layer times" if measured else ""))
        out += _border_gathers(cm, stage, rank, n_mb)
        if stage.ep > 1 and blocks and m.moe is not None:   # ep > 1: the model has experts (validated)
            out += _expert_traffic(cm, m.moe, stage, rank, blocks, n_mb)
        if stage.cp > 1 and blocks:
            sent = _cp_bytes(cm, stage)
            f, b = cm.cp_comm_time(rank)
            out.append(GroupTraffic("cp", f"stage {stage.name}: {stage.cp_kind.value} cp {stage.cp}",
                                    cm.cp_group(rank), sent * blocks * n_mb, (f + b) * blocks * n_mb))
    out += _borders(cm, lanes)
    out += _tied(cm)
    return out


def _tied(cm: CostModel) -> list[GroupTraffic]:
    """The sum of a tied embedding's copies on the first and the last stage, once a step (Megatron-LM's
    embedding group; Note [tied gradients] in hetc/ir/program.py)."""
    p = cm.pipeline
    ranks = p.tied_ranks(cm.model)
    if not ranks:
        return []
    names = " and ".join(p.stages[p.ministages[ms].stage].name for ms in p.tied_ministages(cm.model))
    return [GroupTraffic("emb", f"tied embedding and head: stages {names}", ranks,
                         traffic.all_reduce_bytes(len(ranks), cm.tied_bytes), cm.tied_time)]


def _expert_traffic(cm: CostModel, moe: MoESpec, stage: Stage, rank: int, blocks: int,
                    n_mb: int) -> list[GroupTraffic]:
    """The MoE blocks' dispatch and combine (EP), and the experts' own gradient reduction."""
    m, b = cm.model, cm.pipeline.micro_batch
    sent = traffic.ep_bytes(stage.ep, moe.top_k, b, m.seq // stage.cp, m.hidden, cm.delta)
    out = [GroupTraffic("ep", f"stage {stage.name}: ep {stage.ep}", ep_group(cm, rank), sent * blocks * n_mb,
                        2 * ep_comm_time(cm, rank) * blocks * n_mb)]
    replicas = expert_group(cm, rank)
    if len(replicas) > 1:
        nbytes = sum(cm.numel(ms, rank) * cm.expert_fraction(ms, rank) for ms in stage.ministages) * cm.delta
        level = stage.zero.resolved_level
        per_mb = level == 2 and cm.pipeline.schedule is not ScheduleKind.ZORSE
        grads = cm.states.collective(Collective.REDUCE_SCATTER, nbytes)
        seconds = cm.collective_time(Collective.ALL_REDUCE, replicas, grads) if level < 2 else \
            cm.collective_time(Collective.REDUCE_SCATTER, replicas, grads) * (n_mb if per_mb else 1) + \
            cm.collective_time(Collective.ALL_GATHER, replicas, nbytes)
        out.append(GroupTraffic("dp", f"stage {stage.name}: experts' ZeRO-{level} over {len(replicas)} ranks",
                                replicas, traffic.zero_bytes(level, cm.pipeline.schedule, nbytes, len(replicas),
                                                             n_mb, cm.states), seconds))
    return out


def _border_gathers(cm: CostModel, stage: Stage, rank: int, n_mb: int) -> list[GroupTraffic]:
    """The tp group's all-gathers of the boundary tensors its ranks receive in parts (Note [scatter-gather
    borders] in hetc/ir/layout.py): one per microbatch and border crossed each way."""
    gather = cm.border_gather_time(rank)
    if gather == 0.0:
        return []
    count = n_mb * sum(sum(cm.border_crossings(ms)) for ms in stage.ministages)
    sent = traffic.gather_bytes(stage.tp, cm.hidden_bytes / stage.cp)
    return [GroupTraffic("tp", f"stage {stage.name}: tp {stage.tp}, border tensors gathered", cm.tp_group(rank),
                         sent * count, gather * count)]


def _cp_bytes(cm: CostModel, stage: Stage) -> float:
    m, b = cm.model, cm.pipeline.micro_batch
    args = (m.num_kv_heads, m.heads, b, m.seq, m.hidden // stage.tp, cm.delta)
    if stage.cp_kind.value == "ulysses":
        return traffic.ulysses_bytes(stage.cp, *args)
    return traffic.ring_attention_bytes(stage.cp, *args)


def _borders(cm: CostModel, lanes: dict[tuple[int, int], LaneTiming]) -> list[GroupTraffic]:
    p, m = cm.pipeline, cm.model
    out = []
    for a, b in zip(p.ministages, p.ministages[1:]):
        if a.stage == b.stage:
            continue
        sa, sb = p.stages[a.stage], p.stages[b.stage]
        sent = traffic.pp_bytes(p.micro_batch, m.seq, m.hidden, cm.delta, p.num_microbatches,
                                replicas=(border_copies(sb, m.seq), border_copies(sa, m.seq)))
        seconds = max(2 * len(lane.microbatches) * border_time(cm, sa, lane, sb, a.index)
                      for lane in sa.lanes)
        ranks = (sa.lanes[0].ranks[0], sb.lanes[0].ranks[0])
        out.append(GroupTraffic("pp", f"{sa.name} -> {sb.name} ({m.layer_name(a.stop_layer - 1)} | "
                                f"{m.layer_name(b.first_layer)})", ranks, sent, seconds))
    return out
