"""Build one rank's runtime state from a verified plan: modules, buffers, groups.

Everything here follows the program: the ministages this rank owns are the
ones its `shard` lines name, their sharding is what the lines say (with the
tp/cp/ep groups their compute talks over, and the experts' own buffer under
expert parallelism), and the groups are the program's group table. The rank's place in its lane (runtime/lane.py) decides its
tensor-parallel slice of the weights and the tokens it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetc.hf.weights import wants_pretrained
from hetc.pipeline import Pipeline
from hetc.program import Program, Shard
from hetc.runtime.buffers import GroupPos, MinistageBuffers
from hetc.runtime.comm import Comm, nccl_order
from hetc.runtime.data import DataSource
from hetc.runtime.hf_load import load_hf_weights
from hetc.runtime.interpreter import Interpreter
from hetc.runtime.lane import LanePlace, place_ministage
from hetc.runtime.nccl_order import NcclEmulation
from hetc.runtime.nn.model import build_ministage, compute_dtype
from hetc.runtime.nn.moe import ExpertShard, is_expert_param
from hetc.runtime.unit_buffers import Buffers, UnitBuffers
from hetc.spec import Checkpointing, Spec

__all__ = ["RankRuntime", "build_buffers", "build_rank", "build_rank_buffers", "lane_place"]


@dataclass
class RankRuntime:
    rank: int
    interpreter: Interpreter
    buffers: dict[int, Buffers]


def _pos(program: Program, name: str | None, rank: int) -> GroupPos:
    if name is None:
        return GroupPos()
    ranks = program.group(name).ranks
    return GroupPos(ranks.index(rank), len(ranks))


def lane_place(spec: Spec, pipeline: Pipeline, program: Program, rank: int,
               groups: dict[str, object] | None = None) -> LanePlace:
    """This rank's place in its lane, with the process groups its shard lines name (when `groups` is given)."""
    stage, lane = pipeline.stage_of_rank[rank], pipeline.lane_of_rank[rank]
    pos = lane.ranks.index(rank)
    shards = program.ranks[rank].shards      # every ministage of a rank names the same tp/cp groups
    ep = next((sh.ep_group for sh in shards if sh.ep_group), None)    # those with MoE blocks the same ep group
    assert spec.model is not None   # a checked spec

    def group(name: str | None) -> object | None:
        return None if name is None or groups is None else groups[name]
    return LanePlace(stage, pos, spec.model.seq, group(shards[0].tp_group if shards else None),
                     group(shards[0].cp_group if shards else None), lane.ranks[pos % stage.tp::stage.tp],
                     group(ep), ExpertShard(lane.index % stage.ep, stage.ep))


def build_buffers(spec: Spec, pipeline: Pipeline, program: Program, rank: int, device: torch.device,
                  place: LanePlace | None = None, initialise: bool = True) -> dict[int, Buffers]:
    """This rank's ministages and their buffers; `initialise=False` gives them no values, for a loader to
    fill (Note [Ranks that load their weights] in runtime/buffers.py)."""
    rp = program.ranks[rank]
    place = place or lane_place(spec, pipeline, program, rank)
    assert spec.model is not None   # a checked spec
    dtype = compute_dtype(spec.model.dtype)
    out = {}
    for shard in rp.shards:
        out[shard.ms] = _ministage(spec, pipeline, program, rank, shard, place, dtype, device, initialise)
    return out


def _ministage(spec: Spec, pipeline: Pipeline, program: Program, rank: int, shard: Shard, place: LanePlace,
               dtype: torch.dtype, device: torch.device, initialise: bool) -> Buffers:
    ministage = pipeline.ministages[shard.ms]
    ckpt = pipeline.stages[ministage.stage].checkpoint   # the stage's activation checkpointing
    if shard.units:     # one module and one set of buffers per unit (runtime/unit_buffers.py)
        return UnitBuffers(shard, {u: _buffers(spec, program, rank, shard, place, u.layers, ckpt, dtype, device,
                                               initialise) for u in shard.units})
    return _buffers(spec, program, rank, shard, place, ministage.layers, ckpt, dtype, device, initialise)


def _buffers(spec: Spec, program: Program, rank: int, shard: Shard, place: LanePlace, layers: range,
             ckpt: Checkpointing, dtype: torch.dtype, device: torch.device, initialise: bool) -> MinistageBuffers:
    """The module of `layers` (a ministage's, or a unit's) under its stage's checkpointing, and its flat buffers."""
    assert spec.model is not None and spec.train is not None   # a checked spec
    module = build_ministage(spec.model, layers, seed=spec.train.seed, shard=place.shard, device=device,
                             experts=place.experts, initialise=initialise, checkpoint=ckpt)
    place_ministage(module, place, device)
    opt = spec.model.optimizer
    if shard.experts is None:
        return MinistageBuffers(module, shard, _pos(program, shard.group, rank), _pos(program, shard.outer, rank),
                                opt, dtype, device, tp=place.shard)
    names = [n for n, _ in module.named_parameters()]
    dense = MinistageBuffers(module, shard, _pos(program, shard.group, rank), _pos(program, shard.outer, rank),
                             opt, dtype, device, [n for n in names if not is_expert_param(n)], tp=place.shard)
    dense.experts = MinistageBuffers(module, shard.experts, _pos(program, shard.expert_group, rank), GroupPos(),
                                     opt, dtype, device, [n for n in names if is_expert_param(n)], tp=place.shard)
    return dense


def build_rank(spec: Spec, pipeline: Pipeline, program: Program, rank: int, groups: dict[str, object],
               data: DataSource, device: torch.device, resumes: bool = False,
               emulation: NcclEmulation | None = None) -> RankRuntime:
    """One rank's runtime state. `resumes`: a checkpoint will be loaded (runtime/checkpoint.py), so the
    rank gives its parameters no values of their own; see Note [Ranks that load their weights].
    `emulation`: hold gloo's communication to NCCL's order (Note [NCCL order on gloo])."""
    place = lane_place(spec, pipeline, program, rank, groups)
    buffers = build_rank_buffers(spec, pipeline, program, rank, device, place, resumes)
    assert spec.model is not None   # a checked spec
    comm = Comm(groups, pipeline.num_microbatches, compute_dtype(spec.model.dtype), device,
                nccl_order(rank, emulation))
    firsts = {m.index: m.first_layer for m in pipeline.ministages}
    stops = {m.index: m.stop_layer for m in pipeline.ministages}
    interp = Interpreter(spec, program.ranks[rank], buffers, comm, data, pipeline.num_microbatches, device,
                         firsts, stops, place, pin_memory=pipeline.stage_of_rank[rank].offload.pin_memory)
    return RankRuntime(rank, interp, buffers)


def build_rank_buffers(spec: Spec, pipeline: Pipeline, program: Program, rank: int, device: torch.device,
                       place: LanePlace | None = None, resumes: bool = False) -> dict[int, Buffers]:
    """The buffers a rank starts from: random, or its share of the Hugging Face weights; none given values
    when a checkpoint will fill them (`resumes`)."""
    assert spec.model is not None   # a checked spec
    pretrained = wants_pretrained(spec.model) and not resumes
    buffers = build_buffers(spec, pipeline, program, rank, device, place,
                            initialise=not (pretrained or resumes))
    if pretrained:     # the validator checked the tensors against the model
        hf_dir = spec.model.hf_dir()
        assert hf_dir is not None   # pretrained weights come from an hf directory
        load_hf_weights(buffers, hf_dir)
    return buffers
