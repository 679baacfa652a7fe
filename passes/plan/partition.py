"""Bandwidth domains: the cluster's machines cut into data-parallel groups by min k-cuts.

Zorse's planner cuts the cluster's bandwidth graph with SPLIT, a greedy min
k-cut, so that fast links stay inside data-parallel (ZeRO) groups and
pipeline borders cross the slow ones. Here the cut comes from a Gomory–Hu
tree (networkx `gomory_hu_tree`): removing its k−1 lightest edges gives a
min k-cut within 2 − 2/k of optimal (Saran & Vazirani), for every k from
one tree; the cuts are nested, so k = 1..G is a hierarchy of domains.

Two choices make the cut mean what the planner needs and scale:

- The graph is over machines, with twins merged: the machines of a node
  group have the same device and the same links to everyone, so the graph
  has one vertex per node group and an edge's capacity sums its machine
  pairs. Splitting a node group among stages is the search's job (by node
  counts), and the graph stays tiny at thousands of GPUs.
- A ring collective runs at its slowest link, so a domain should avoid slow
  links outright rather than minimise their summed bandwidth (a sum would
  rather cut off the smallest group). Capacities are therefore tiered:
  bandwidths within `TIER_RATIO` of each other form one tier, and one
  machine pair of a faster tier outweighs every pair of slower tiers. The
  min k-cut then cuts the slowest tier first, and the fewest pairs within it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from hetc.ir.topology import Topology

if TYPE_CHECKING:   # imported where a cut is computed: networkx takes a third of a second to import
    import networkx as nx

__all__ = ["TIER_RATIO", "Domains", "bandwidth_domains", "group_bandwidth"]

# Bandwidths closer than this factor count as one tier.
TIER_RATIO = 1.5

Domains = tuple[tuple[str, ...], ...]   # node-group names per domain, in declaration order


def group_bandwidth(topo: Topology, a: str, b: str) -> float:
    """Bandwidth between a machine of node group `a` and one of node group `b` (a ≠ b)."""
    return topo.link(topo.gpu_at(a, 0, 0), topo.gpu_at(b, 0, 0)).bandwidth


def _tiers(values: list[float]) -> dict[float, int]:
    """Tier index of each bandwidth: 0 for the slowest tier."""
    tier, out, low = -1, {}, None
    for v in sorted(set(values)):
        if low is None or v > low * TIER_RATIO:
            tier, low = tier + 1, v
        out[v] = tier
    return out


def _graph(topo: Topology, groups: list[str]) -> nx.Graph:
    import networkx as nx

    pairs = {}
    for a, b in itertools.combinations(groups, 2):
        pairs[(a, b)] = (topo.groups[a].count * topo.groups[b].count, group_bandwidth(topo, a, b))
    tiers = _tiers([bw for _, bw in pairs.values()])
    weight = 1 + sum(n for n, _ in pairs.values())   # one faster pair outweighs all slower ones
    graph = nx.Graph()
    graph.add_nodes_from(groups)
    for (a, b), (n, bw) in pairs.items():
        graph.add_edge(a, b, capacity=n * weight ** tiers[bw])
    return graph


def bandwidth_domains(topo: Topology, groups: list[str]) -> list[Domains]:
    """Nested partitions of `groups` into k = 1..len(groups) domains, by Gomory–Hu min k-cuts."""
    if len(groups) == 1:
        return [(tuple(groups),)]
    if len(groups) == 2:   # the tree is the one edge (every capacity is positive): both, then each alone
        return [(tuple(groups),), tuple((g,) for g in groups)]
    import networkx as nx

    return _cut_levels(nx.gomory_hu_tree(_graph(topo, groups)), groups)


def _cut_levels(tree: nx.Graph, groups: list[str]) -> list[Domains]:
    """The k = 1..len(groups) domains of a Gomory–Hu tree: its k−1 lightest edges removed."""
    import networkx as nx

    order = {g: i for i, g in enumerate(groups)}
    edges = sorted(tree.edges(data="weight"), key=lambda e: (e[2], sorted((order[e[0]], order[e[1]]))))
    out = []
    for k in range(1, len(groups) + 1):
        forest = tree.copy()
        forest.remove_edges_from((a, b) for a, b, _ in edges[:k - 1])
        parts = [tuple(sorted(c, key=lambda n: order[n])) for c in nx.connected_components(forest)]
        out.append(tuple(sorted(parts, key=lambda p: order[p[0]])))
    return out
