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

from hetc.hf.weights import pretrained_dir
from hetc.ir.plan import Plan
from hetc.ir.program import Program, Shard
from hetc.runtime.buffers import GroupPos, MinistageBuffers
from hetc.runtime.comm import Comm, nccl_order
from hetc.runtime.data import DataSource
from hetc.runtime.hf_load import load_hf_weights
from hetc.runtime.interpreter import Interpreter
from hetc.runtime.lane import LanePlace, place_ministage
from hetc.runtime.nccl_order import NcclEmulation
from hetc.runtime.nn.model import build_ministage, compute_dtype, grad_dtype
from hetc.runtime.nn.moe import ExpertShard, is_expert_param
from hetc.runtime.unit_buffers import Buffers, UnitBuffers
from hetc.ir.spec import Checkpointing

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


def lane_place(program: Program, plan: Plan, rank: int, groups: dict[str, object] | None = None) -> LanePlace:
    """This rank's place in its lane, with the process groups its shard lines name (when `groups` is given)."""
    place = plan.geometry.place(rank)
    stage, lane, pos = place.stage, place.lane, place.pos
    shards = program.ranks[rank].shards      # every ministage of a rank names the same tp/cp groups
    ep = next((sh.ep_group for sh in shards if sh.ep_group), None)    # those with MoE blocks the same ep group

    def group(name: str | None) -> object | None:
        return None if name is None or groups is None else groups[name]
    return LanePlace(stage, pos, plan.model.seq, group(shards[0].tp_group if shards else None),
                     group(shards[0].cp_group if shards else None), plan.geometry.cp_members(place),
                     group(ep), ExpertShard(lane.index % stage.ep, stage.ep))


def build_buffers(program: Program, plan: Plan, rank: int, device: torch.device,
                  place: LanePlace | None = None, initialise: bool = True) -> dict[int, Buffers]:
    """This rank's ministages and their buffers; `initialise=False` gives them no values, for a loader to
    fill (Note [Ranks that load their weights] in runtime/buffers.py)."""
    place = place or lane_place(program, plan, rank)
    dtype = compute_dtype(plan.model.dtype)
    return {shard.ms: _ministage(program, plan, rank, shard, place, dtype, device, initialise)
            for shard in program.ranks[rank].shards}


def _ministage(program: Program, plan: Plan, rank: int, shard: Shard, place: LanePlace, dtype: torch.dtype,
               device: torch.device, initialise: bool) -> Buffers:
    ministage = plan.pipeline.ministages[shard.ms]
    ckpt = plan.pipeline.stages[ministage.stage].checkpoint   # the stage's activation checkpointing
    if shard.units:     # one module and one set of buffers per unit (runtime/unit_buffers.py)
        return UnitBuffers(shard, {u: _buffers(program, plan, rank, shard, place, u.layers, ckpt, dtype, device,
                                               initialise) for u in shard.units})
    return _buffers(program, plan, rank, shard, place, ministage.layers, ckpt, dtype, device, initialise)


def _buffers(program: Program, plan: Plan, rank: int, shard: Shard, place: LanePlace, layers: range,
             ckpt: Checkpointing, dtype: torch.dtype, device: torch.device, initialise: bool) -> MinistageBuffers:
    """The module of `layers` (a ministage's, or a unit's) under its stage's checkpointing, and its flat buffers."""
    module = build_ministage(plan.model, layers, seed=plan.train.seed, shard=place.shard, device=device,
                             experts=place.experts, initialise=initialise, checkpoint=ckpt)
    place_ministage(module, place, device)
    opt, grads = plan.model.optimizer, grad_dtype(plan.model)
    if shard.experts is None:
        return MinistageBuffers(module, shard, _pos(program, shard.group, rank), _pos(program, shard.outer, rank),
                                opt, dtype, device, tp=place.shard, grad_dtype=grads)
    names = [n for n, _ in module.named_parameters()]
    dense = MinistageBuffers(module, shard, _pos(program, shard.group, rank), _pos(program, shard.outer, rank),
                             opt, dtype, device, [n for n in names if not is_expert_param(n)], tp=place.shard,
                             grad_dtype=grads)
    dense.experts = MinistageBuffers(module, shard.experts, _pos(program, shard.expert_group, rank), GroupPos(),
                                     opt, dtype, device, [n for n in names if is_expert_param(n)], tp=place.shard,
                                     grad_dtype=grads)
    return dense


def build_rank(program: Program, plan: Plan, rank: int, groups: dict[str, object], data: DataSource,
               device: torch.device, resumes: bool = False, emulation: NcclEmulation | None = None) -> RankRuntime:
    """One rank's runtime state. `resumes`: a checkpoint will be loaded (runtime/checkpoint.py), so the
    rank gives its parameters no values of their own; see Note [Ranks that load their weights].
    `emulation`: hold gloo's communication to NCCL's order (Note [NCCL order on gloo])."""
    place = lane_place(program, plan, rank, groups)
    buffers = build_rank_buffers(program, plan, rank, device, place, resumes)
    comm = Comm(groups, plan.pipeline.num_microbatches, compute_dtype(plan.model.dtype), device,
                nccl_order(rank, emulation))
    interp = Interpreter(program.ranks[rank], plan, buffers, comm, data, device, place)
    return RankRuntime(rank, interp, buffers)


def build_rank_buffers(program: Program, plan: Plan, rank: int, device: torch.device,
                       place: LanePlace | None = None, resumes: bool = False) -> dict[int, Buffers]:
    """The buffers a rank starts from: random, or its share of the Hugging Face weights; none given values
    when a checkpoint will fill them (`resumes`)."""
    hf_dir = None if resumes else pretrained_dir(plan.model)
    buffers = build_buffers(program, plan, rank, device, place, initialise=not (hf_dir or resumes))
    if hf_dir is not None:     # the validator checked the tensors against the model
        load_hf_weights(buffers, hf_dir)
    return buffers
