"""Dollars per step for bytes that cross priced links (egress between zones and regions).

Pipeline borders move one activation forward and one gradient back per
microbatch between the lanes that serve it; a ZeRO ring moves each rank's
per-step bytes (`traffic.zero_bytes`) to its ring successor. A link's
`egress` ($/GB, GB = 1e9 bytes) prices what crosses it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from hetc.passes.cost.traffic import zero_bytes
from hetc.ir.topology import Gpu
from hetc.passes.plan.primitives import Primitives
from hetc.passes.plan.candidate_view import PlanView

if TYPE_CHECKING:
    from hetc.passes.plan.candidate_stage import StageCosts

__all__ = ["egress_per_step", "has_egress"]

GB = 1e9


def has_egress(prims: Primitives) -> bool:
    return any(link.egress > 0 for link in prims.topo.cluster.links)


def egress_per_step(prims: Primitives, plan: PlanView, costs: list[StageCosts]) -> float:
    if not has_egress(prims):
        return 0.0
    return _borders(prims, plan) + sum(_ring(prims, plan, sc) for sc in costs)


def _price(prims: Primitives, a: Gpu, b: Gpu) -> float:
    """$/GB between two GPUs: their node groups' link (none inside a host)."""
    if a.host == b.host:
        return 0.0
    key = (a.group, b.group)
    got = prims.egress_prices.get(key)
    if got is None:
        got = prims.egress_prices[key] = prims.topo.link(a, b).egress
    return got


def _borders(prims: Primitives, plan: PlanView) -> float:
    total = 0.0
    for ms in range(len(plan.ministages) - 1):
        sa, sb = plan.ministages[ms][2], plan.ministages[ms + 1][2]
        if sa == sb:
            continue
        a, b = plan.stages[sa], plan.stages[sb]
        pairs = Counter(zip(a.lane_of_microbatch, b.lane_of_microbatch))
        for (la, lb), n in pairs.items():
            total += n * 2 * prims.boundary * _price(prims, a.lanes[la][0], b.lanes[lb][0]) / GB
    return total


def _ring(prims: Primitives, plan: PlanView, sc: StageCosts) -> float:
    st = sc.s
    n = len(st.lanes)
    if n < 2:
        return 0.0
    sent = zero_bytes(st.zero.resolved_level, plan.schedule, sc.numel() * prims.delta, n, max(st.counts),
                      prims.states)
    gpus = [lane[0] for lane in st.lanes]  # the ring of every lane position looks alike
    edges = sum(_price(prims, gpus[i], gpus[(i + 1) % n]) for i in range(n))
    return sent * edges * st.tp / GB
