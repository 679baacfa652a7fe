"""Expert parallelism in the cost model: its groups, its all-to-all time, expert states under ZeRO.

A stage with ep > 1 splits every MoE block's experts over EP groups of ep
lanes (passes/lower/context.py): a rank holds 1/ep of them
(`CostModel.numel`), exchanges its tokens with its lane position in the
group's other lanes, and keeps its experts' states in sync with the ranks
at the same EP rank of the other groups (the expert group), not with the
stage's whole ZeRO group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetc.passes.cost.memory import ShardFactors, shard_factors
from hetc.ir.program import Collective

if TYPE_CHECKING:     # the cost model imports this module
    from hetc.passes.cost.model import CostModel

__all__ = ["ep_comm_time", "ep_group", "expert_group", "expert_shard", "sharded_numel"]


def ep_group(cm: CostModel, rank: int) -> tuple[int, ...]:
    """The ranks this rank's MoE blocks exchange tokens with: its lane position in its EP group's lanes."""
    stage, lane = cm.stage_of(rank), cm.pipeline.lane_of_rank[rank]
    pos, first = lane.ranks.index(rank), lane.index - lane.index % stage.ep
    return tuple(other.ranks[pos] for other in stage.lanes[first:first + stage.ep])


def expert_group(cm: CostModel, rank: int) -> tuple[int, ...]:
    """Ranks holding this rank's experts (expert data parallelism): its EP rank's lanes, every position."""
    stage, lane = cm.stage_of(rank), cm.pipeline.lane_of_rank[rank]
    return tuple(r for other in stage.lanes[lane.index % stage.ep::stage.ep] for r in other.ranks)


def expert_shard(cm: CostModel, rank: int) -> ShardFactors:
    """The fraction of each expert state this rank keeps under its stage's ZeRO (over `expert_group`)."""
    return shard_factors(cm.stage_of(rank).zero, len(expert_group(cm, rank)))


def sharded_numel(cm: CostModel, ms: int, rank: int, state: str) -> float:
    """`cm.numel` times the fraction of `state` (params, grads, optimizer) ZeRO leaves this rank, the
    expert parameters sharded over their own group."""
    experts = cm.expert_fraction(ms, rank)
    kept: float = getattr(cm.shard(rank), state) * (1.0 - experts)
    if experts:
        kept += getattr(expert_shard(cm, rank), state) * experts
    return cm.numel(ms, rank) * kept


def ep_comm_time(cm: CostModel, rank: int) -> float:
    """Dispatch and combine all-to-alls of one MoE block and pass over the EP group, each carrying the
    top-k copies of the rank's tokens, K·b·S·H·δ / cp (4δ·K·bSH per block, forward and backward)."""
    if cm.model.moe is None or cm.stage_of(rank).ep == 1:
        return 0.0
    nbytes = cm.model.moe.top_k * cm.hidden_bytes / cm.stage_of(rank).cp
    return 2 * cm.collective_time(Collective.ALL_TO_ALL, ep_group(cm, rank), nbytes)
