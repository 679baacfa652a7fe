"""MFU and HFU of a plan: over the GPUs it uses, and over the whole cluster.

Note [utilization]: model FLOPs are the training FLOPs of the tokens of
one step without any recomputation (forward + backward = 3 × forward,
`model_flops_per_token`); hardware FLOPs add what the plan recomputes:
activation checkpointing (a `full` block reruns its forward, `selective`
its attention core) and `offload activations` (the stage keeps only its
ministages' boundary inputs and reruns each ministage's forward in
backward, hetc/ir/program.py's Shard). MFU = model FLOPs / (step time × peak),
HFU = hardware FLOPs / (step time × peak). The peak is the sum of the
datasheet peaks, in the training dtype, of the GPUs the plan gives a rank
(`used`); idle GPUs do no work and would only dilute the figure, so the
cluster-wide figure (every GPU the spec declares) is reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.jsontypes import JsonObject
from hetc.passes.cost.shapes import LayerKind, layer_flops, layer_kind, model_flops_per_token
from hetc.ir.pipeline import Pipeline
from hetc.ir.spec import Checkpointing, ModelSpec, OffloadTarget
from hetc.ir.topology import Topology

__all__ = ["FlopCounts", "Utilization", "flop_counts", "used_peak_flops", "utilization"]


@dataclass(frozen=True, slots=True)
class FlopCounts:
    """FLOPs of one training step: the model's, and what the hardware runs (recomputation included)."""

    model: float
    hardware: float


@dataclass(frozen=True, slots=True)
class Utilization:
    """Note [utilization]: MFU and HFU over the used GPUs' peak and over the cluster's."""

    mfu: float
    hfu: float
    cluster_mfu: float
    cluster_hfu: float
    used_peak_flops: float      # FLOP/s of the GPUs that hold a rank
    cluster_peak_flops: float   # FLOP/s of every GPU the spec declares, idle ones included
    used_gpus: int
    cluster_gpus: int

    def to_json(self) -> JsonObject:
        return {"mfu": self.mfu, "hfu": self.hfu, "cluster_mfu": self.cluster_mfu, "cluster_hfu": self.cluster_hfu,
                "peak_flops": self.used_peak_flops, "cluster_peak_flops": self.cluster_peak_flops,
                "used_gpus": self.used_gpus, "cluster_gpus": self.cluster_gpus}


def used_peak_flops(model: ModelSpec, pipeline: Pipeline) -> float:
    """FLOP/s of the GPUs that hold a rank, at the dtype the model runs (MFU's denominator, per second)."""
    return sum(g.device.peak.for_dtype(model.dtype) for g in pipeline.world)


def flop_counts(model: ModelSpec, pipeline: Pipeline) -> FlopCounts:
    """Note [utilization]: the step's model FLOPs and hardware FLOPs."""
    tokens = pipeline.num_microbatches * pipeline.micro_batch * model.seq
    flops = model_flops_per_token(model) * tokens
    return FlopCounts(flops, flops + _recompute(model, pipeline))


def _recompute(model: ModelSpec, pipeline: Pipeline) -> float:
    """Forward FLOPs the plan runs a second time, over every microbatch of the step."""
    b = pipeline.micro_batch
    per_mb = 0.0
    for stage in pipeline.stages:
        layers = [i for ms in stage.ministages for i in pipeline.ministages[ms].layers]
        if stage.offload.activations is not OffloadTarget.NONE:   # every layer's forward again
            per_mb += sum(layer_flops(model, i, b).forward for i in layers)
        per_mb += sum(_checkpoint_extra(model, i, b, stage.checkpoint) for i in layers)
    return per_mb * pipeline.num_microbatches


def _checkpoint_extra(model: ModelSpec, idx: int, micro_batch: int, checkpoint: Checkpointing) -> float:
    """The forward FLOPs a block's backward repeats under its stage's activation checkpointing."""
    if checkpoint is Checkpointing.NONE or layer_kind(model, idx) != LayerKind.BLOCK:
        return 0.0
    block = layer_flops(model, idx, micro_batch)
    return block.forward if checkpoint is Checkpointing.FULL else block.attention


def utilization(model: ModelSpec, pipeline: Pipeline, topology: Topology, step_time_s: float) -> Utilization:
    """Note [utilization] for a plan whose step takes `step_time_s`."""
    flops = flop_counts(model, pipeline)
    used = used_peak_flops(model, pipeline)
    everyone = sum(g.device.peak.for_dtype(model.dtype) for g in topology.gpus)

    def share(work: float, peak: float) -> float:
        return work / (step_time_s * peak) if peak > 0 and step_time_s > 0 else 0.0

    return Utilization(share(flops.model, used), share(flops.hardware, used), share(flops.model, everyone),
                       share(flops.hardware, everyone), used, everyone, len(pipeline.world), len(topology.gpus))
