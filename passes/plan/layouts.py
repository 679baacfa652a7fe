"""Stage layouts: which GPUs form each pipeline stage, in pipeline order.

A layout starts from a level of the bandwidth hierarchy (`partition`): each
domain becomes one or more consecutive stages, so data-parallel rings stay
inside a domain and pipeline borders cross between domains. A domain with
p stages is cut one of two ways:

- `mixed`: every node group of the domain is split into p equal parts and
  stage j takes part j of each (lanes of different kinds share a stage;
  microbatch routing balances them: Zorse's many-to-many pipeline);
- `by kind`: the domain's node groups, fastest first, get consecutive
  stages in proportion to their compute (Sailor's and HexiScale's shape).

The number of stages per domain follows the domains' compute shares; the
pipeline depths tried thin out as they grow (`stage_counts`).
Domains are ordered every way when there are at most `MAX_PERMUTED`,
otherwise fastest first and slowest first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from hetc.passes.plan.candidate import GpuBlock, StageGpus, split_evenly
from hetc.passes.plan.partition import Domains
from hetc.ir.spec import DType
from hetc.ir.topology import Topology

__all__ = ["MAX_PERMUTED", "Layout", "gpu_run", "group_size", "group_speed", "layouts", "split_group",
           "stage_counts", "whole_group"]

Layout = tuple[StageGpus, ...]
MAX_PERMUTED = 2


def group_size(topo: Topology, group: str) -> int:
    """The GPUs of a node group."""
    g = topo.groups[group]
    return g.count * g.gpus


def group_speed(topo: Topology, group: str, dtype: DType) -> float:
    """Effective FLOP/s of a whole node group (datasheet peak × efficiency)."""
    device = topo.gpu_at(group, 0, 0).device
    return group_size(topo, group) * device.peak.for_dtype(dtype) * device.efficiency


def whole_group(topo: Topology, group: str) -> tuple[GpuBlock, ...]:
    """Every GPU of a node group as one run (split_group into one part, which always exists)."""
    parts = split_group(topo, group, 1)
    assert parts is not None   # a node group has a GPU
    return parts[0]


def split_group(topo: Topology, group: str, parts: int) -> list[tuple[GpuBlock, ...]] | None:
    """Cut a node group into `parts` runs of GPUs: by whole nodes when it has enough, else inside nodes."""
    g = topo.groups[group]
    if parts > group_size(topo, group):
        return None
    out: list[tuple[GpuBlock, ...]] = []
    start = 0
    if g.count >= parts:
        for size in split_evenly(g.count, parts):
            out.append((GpuBlock(group, start, start + size, 0, g.gpus),))
            start += size
        return out
    for size in split_evenly(group_size(topo, group), parts):
        out.append(gpu_run(group, g.gpus, start, start + size))
        start += size
    return out


def gpu_run(group: str, per_node: int, lo: int, hi: int) -> tuple[GpuBlock, ...]:
    """GPUs lo..hi-1 in node-major order as blocks: a partial node, whole nodes, a partial node."""
    blocks = []
    while lo < hi:
        node, gpu = divmod(lo, per_node)
        if gpu == 0 and hi - lo >= per_node:
            nodes = (hi - lo) // per_node
            blocks.append(GpuBlock(group, node, node + nodes, 0, per_node))
            lo += nodes * per_node
        else:
            stop = min(per_node, gpu + hi - lo)
            blocks.append(GpuBlock(group, node, node + 1, gpu, stop))
            lo += stop - gpu
    return tuple(blocks)


def _shares(weights: list[float], total: int, floor: int = 1) -> list[int] | None:
    """`total` split in proportion to `weights`, each at least `floor` (largest remainder)."""
    n = len(weights)
    if total < floor * n:
        return None
    spare = total - floor * n
    exact = [spare * w / sum(weights) for w in weights]
    out = [floor + int(e) for e in exact]
    for i in sorted(range(n), key=lambda i: (-(exact[i] - int(exact[i])), i))[: total - sum(out)]:
        out[i] += 1
    return out


def _mixed(topo: Topology, groups: tuple[str, ...], parts: int) -> list[StageGpus] | None:
    splits = [s for g in groups if (s := split_group(topo, g, parts)) is not None]
    if len(splits) < len(groups):
        return None
    return [StageGpus(tuple(b for s in splits for b in s[j])) for j in range(parts)]


def _by_kind(topo: Topology, groups: tuple[str, ...], parts: int, dtype: DType) -> list[StageGpus] | None:
    ordered = sorted(groups, key=lambda g: -group_speed(topo, g, dtype) / group_size(topo, g))
    counts = _shares([group_speed(topo, g, dtype) for g in ordered], parts)
    if counts is None:
        return None
    out = []
    for g, p in zip(ordered, counts):
        split = split_group(topo, g, p)
        if split is None:
            return None
        out += [StageGpus(blocks) for blocks in split]
    return out


def layouts(topo: Topology, partitions: list[Domains], max_stages: int, dtype: DType) -> list[Layout]:
    """Every layout of up to `max_stages` stages the partitions give, without repeats, fewest stages first."""
    seen: dict[Layout, None] = {}
    for domains in partitions:
        speeds = [sum(group_speed(topo, g, dtype) for g in d) for d in domains]
        orders = _orders(len(domains), speeds)
        for total in stage_counts(len(domains), max_stages):
            per_domain = _shares(speeds, total)
            if per_domain is None:
                continue
            for cut in (_mixed, _by_kind):
                cuts = [_cut(cut, topo, d, p, dtype) for d, p in zip(domains, per_domain)]
                parts = [p for p in cuts if p is not None]
                if len(parts) < len(cuts):
                    continue
                for order in orders:
                    seen.setdefault(tuple(st for i in order for st in parts[i]), None)
    return sorted(seen, key=len)


def stage_counts(least: int, most: int) -> list[int]:
    """Pipeline depths tried: every depth up to 6, then about a third apart (8, 10, 12, 16, 20, ...)."""
    depths, d = [], 1
    while d <= most:
        depths.append(d)
        d = d + 1 if d < 6 else d + max(2, d // 3 // 2 * 2)
    return [d for d in depths if d >= least] or ([least] if least <= most else [])


def _cut(cut: Callable[..., list[StageGpus] | None], topo: Topology, domain: tuple[str, ...], parts: int,
         dtype: DType) -> list[StageGpus] | None:   # `_mixed` takes no dtype, the other cuts do
    return cut(topo, domain, parts) if cut is _mixed else cut(topo, domain, parts, dtype)


def _orders(n: int, speeds: list[float]) -> list[tuple[int, ...]]:
    if n <= MAX_PERMUTED:
        return list(itertools.permutations(range(n)))
    fast = tuple(sorted(range(n), key=lambda i: (-speeds[i], i)))
    return [fast, fast[::-1]]
