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

Measured layer times carry the concurrency they were measured under
(`hetc profile` runs as many ranks at once as the node will run and
records it with the machine's cores); the profile reader divides that
measurement's slowdown out (`core_slowdown`), and the cost model applies
the plan's. When the plan runs as many ranks on as many cores as the
profile did, the two cancel and the measured time is used as measured.
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


def host_slowdowns(gpus: Iterable[Gpu], cores_by_group: Mapping[str, int],
                   cluster_cores: int = 0) -> dict[tuple[str, int], float]:
    """Per node (host) of the plan's `gpus` (one per rank): its ranks' slowdown (Note [shared cores])."""
    running = Counter(g.host for g in gpus)
    everywhere = core_slowdown(sum(running.values()), cluster_cores)
    return {host: max(everywhere, core_slowdown(n, cores_by_group.get(host[0], 0))) for host, n in running.items()}
