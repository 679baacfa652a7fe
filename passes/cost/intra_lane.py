"""Which intra-lane layouts a lane of GPUs can take: the planner's hook for TP and CP degrees.

A lane's tp × cp ranks are ordered cp-major (hetc/ir/pipeline.py): each run of
`tp` consecutive GPUs is one TP group. TP's all-reduces sit on the critical
path of every block (4·δbSH per layer, survey II.II) and cannot be hidden,
so TP pays only inside a fast domain (II.IV: "TP never leaves a node");
context parallelism tolerates slower links (ring attention's p2p hides
behind the attention, Ulysses' all-to-all does not). `tp_degrees` lists the
tp values whose every TP group stays on one node over links at least
`min_bandwidth` fast and splits the model's heads evenly (GQA groups
whole); `lane_layouts` the tp × cp layouts of a whole lane that the
sequence and heads allow. A planner that chooses tp per stage enumerates
these for each candidate lane and prices them with `CostModel`
(`compute_time` includes the TP/CP communication). The planner in
passes/plan/ does not call this yet: its stages have tp = 1 unless the
spec writes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetc.ir.layout import layout_problem
from hetc.ir.spec import CPKind, ModelSpec
from hetc.ir.topology import Gpu, Topology

__all__ = ["LaneLayout", "lane_layouts", "splits_experts", "tp_allowed", "tp_degrees"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fast_group(topology: Topology, gpus: Sequence[Gpu], min_bandwidth: float) -> bool:
    if len({g.host for g in gpus}) > 1:
        return False
    return all(topology.link(a, b).bandwidth >= min_bandwidth for a in gpus for b in gpus if a.id != b.id)


def splits_experts(model: ModelSpec, tp: int) -> bool:
    """Whether tensor parallelism of `tp` would split `model`'s MoE blocks, which hetc does not implement (the
    validator says so; the planner and its baselines never propose it)."""
    return tp > 1 and model.moe is not None


def tp_allowed(model: ModelSpec, tp: int) -> bool:
    """`tp` divides the query and key/value heads and splits no MoE block."""
    return not (model.heads % tp or model.num_kv_heads % tp or splits_experts(model, tp))


def tp_degrees(model: ModelSpec, topology: Topology, lane: Sequence[Gpu], min_bandwidth: float = 0.0
               ) -> tuple[int, ...]:
    """The tp sizes for a lane on `lane` (its GPUs in lane order) that keep each TP group in one fast domain."""
    n = len(lane)
    return tuple(tp for tp in _divisors(n) if tp_allowed(model, tp)
                 and all(_fast_group(topology, lane[i:i + tp], min_bandwidth) for i in range(0, n, tp)))


@dataclass(frozen=True)
class LaneLayout:
    """One intra-lane layout (what a stage's `tp`, `cp`, `cp_kind`, `sequence_parallel` write)."""

    tp: int
    cp: int
    cp_kind: CPKind = CPKind.RING
    sequence_parallel: bool = False


def lane_layouts(model: ModelSpec, topology: Topology, lane: Sequence[Gpu], min_bandwidth: float = 0.0,
                 kinds: Sequence[CPKind] = (CPKind.RING, CPKind.ULYSSES)) -> tuple[LaneLayout, ...]:
    """Every tp × cp = len(lane) layout with TP inside fast domains that the sequence and heads allow.

    Sequence parallelism goes with every tp > 1 that can split the tokens
    (it only saves memory and border traffic, survey III.III).
    """
    out = []
    for tp in tp_degrees(model, topology, lane, min_bandwidth):
        cp = len(lane) // tp
        for kind in kinds if cp > 1 else kinds[:1]:
            for sp in ((True, False) if tp > 1 else (False,)):
                layout = LaneLayout(tp, cp, kind, sp)
                if layout_problem(layout, model.seq) is None and \
                        not (cp > 1 and kind is CPKind.ULYSSES and (model.heads // tp) % cp):
                    out.append(layout)
                    break
    return tuple(out)
