"""Build one rank's runtime state from a verified plan: modules, buffers, groups.

Everything here follows the program: the ministages this rank owns are the
ones its `shard` lines name, their sharding is what the lines say, and the
groups are the program's group table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetc.pipeline import Pipeline
from hetc.program import Program, Shard
from hetc.runtime.buffers import GroupPos, MinistageBuffers
from hetc.runtime.comm import Comm
from hetc.runtime.data import DataSource
from hetc.runtime.interpreter import Interpreter
from hetc.runtime.model import build_ministage, compute_dtype
from hetc.spec import Spec

__all__ = ["RankRuntime", "build_rank"]


@dataclass
class RankRuntime:
    rank: int
    interpreter: Interpreter
    buffers: dict[int, MinistageBuffers]


def _pos(program: Program, name: str | None, rank: int) -> GroupPos:
    if name is None:
        return GroupPos()
    ranks = program.group(name).ranks
    return GroupPos(ranks.index(rank), len(ranks))


def build_buffers(spec: Spec, pipeline: Pipeline, program: Program, rank: int,
                  device: torch.device) -> dict[int, MinistageBuffers]:
    rp = program.ranks[rank]
    dtype = compute_dtype(spec.model.dtype)
    out = {}
    for shard in rp.shards:
        out[shard.ms] = _ministage(spec, pipeline, program, rank, shard, dtype, device)
    return out


def _ministage(spec: Spec, pipeline: Pipeline, program: Program, rank: int, shard: Shard,
               dtype: torch.dtype, device: torch.device) -> MinistageBuffers:
    m = pipeline.ministages[shard.ms]
    module = build_ministage(spec.model, m.layers, seed=spec.train.seed, device=device)
    return MinistageBuffers(module, shard, _pos(program, shard.group, rank), _pos(program, shard.outer, rank),
                            spec.model.optimizer, dtype, device)


def build_rank(spec: Spec, pipeline: Pipeline, program: Program, rank: int, groups: dict[str, object],
               data: DataSource, device: torch.device) -> RankRuntime:
    buffers = build_buffers(spec, pipeline, program, rank, device)
    comm = Comm(groups, pipeline.num_microbatches, compute_dtype(spec.model.dtype), device)
    firsts = {m.index: m.first_layer for m in pipeline.ministages}
    stops = {m.index: m.stop_layer for m in pipeline.ministages}
    interp = Interpreter(spec, program.ranks[rank], buffers, comm, data, pipeline.num_microbatches, device,
                         firsts, stops)
    return RankRuntime(rank, interp, buffers)
