"""Ranks that share a node's CPU cores run their compute slower: the rule, once.

Note [shared cores]: a node may say how many CPU cores its ranks share
(`node { cores = N }`; 0, the default: every rank has its own). A rank's
compute (forward, backward, the optimizer step on the host) is CPU work
when the ranks are CPU processes, and the host side of every launch when
they are GPUs; when more ranks compute at once than there are cores, the
operating system shares the cores out evenly, so each rank runs at
cores / running of its own speed. The ranks running at once on a node are
the plan's ranks placed on it: under a pipeline every stage works beside
the others in the steady state, so all of them count (the bubble, where
fewer run, is the small part of a step). A cluster may say the same of all
its ranks (`cluster { cores = N }`): a local run puts every "node" of the
spec on one machine, whose cores all the plan's ranks share; a rank then
slows by the larger of the two rules.

`hetc profile` times the layers alone and, with as many processes at once
as the spec's cluster runs on the machine, measures how many times slower
each ran (`Profiles.shared`). Where the plan runs that many ranks at once on
shared cores of that device kind, the measured slowdown replaces the rule:
measured, not assumed; elsewhere the rule transfers it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from hetc.topology import Gpu

__all__ = ["core_slowdown", "host_slowdowns"]


def core_slowdown(running: int, cores: int) -> float:
    """How many times slower each of `running` ranks computes on `cores` shared cores (0 cores: not shared)."""
    if cores <= 0 or running <= cores:
        return 1.0
    return running / cores


def host_slowdowns(gpus: Iterable[Gpu], cores_by_group: Mapping[str, int], cluster_cores: int = 0,
                   measured: Mapping[str, tuple[int, float]] | None = None) -> dict[tuple[str, int], float]:
    """Per node (host) of the plan's `gpus` (one per rank): its ranks' slowdown (Note [shared cores]).

    `measured`: device kind -> (ranks at once, their measured slowdown), used where the plan shares cores
    among exactly that many ranks.
    """
    gpus = list(gpus)
    running = Counter(g.host for g in gpus)
    kinds = {g.host: g.device.name for g in gpus}
    out = {}
    for host, n in running.items():
        pools = [(n, cores_by_group.get(host[0], 0)), (len(gpus), cluster_cores)]
        out[host] = max(_pool_slowdown(at_once, cores, (measured or {}).get(kinds[host])) for at_once, cores in pools)
    return out


def _pool_slowdown(at_once: int, cores: int, measured: tuple[int, float] | None) -> float:
    """`at_once` ranks sharing `cores` (0: not shared): the measured slowdown of as many ranks, else the rule."""
    if cores <= 0:
        return 1.0
    if measured is not None and measured[0] == at_once:
        return measured[1]
    return core_slowdown(at_once, cores)
