"""Ranks that share a node's CPU cores run their compute slower: the rule, once.

Note [shared cores]: a node may say how many CPU cores its ranks share
(`node { cores = N }`; 0, the default: every rank has its own). A rank's
compute (forward, backward, the optimizer step on the host) is CPU work
when the ranks are CPU processes, and the host side of every launch when
they are GPUs; when more ranks compute at once than there are cores, the
operating system shares the cores out evenly, so each rank runs at
cores / running of its own speed. Which ranks run at once is Note [ranks
computing at once]. A cluster may say the same of all its ranks
(`cluster { cores = N }`): a local run puts every "node" of the spec on one
machine, whose cores all the plan's ranks share; a rank then slows by the
larger of the two rules.

`hetc profile` times the layers alone and, with as many processes at once
as the spec's cluster runs on the machine, measures how many times slower
each ran (`Profiles.shared`): n processes s times slower ran as if on n / s
cores of their own, the machine's effective cores (its other load and its
shared caches and memory included). Where the plan shares cores of that
device kind among that many ranks, k ranks computing at once run
k / (n / s) times slower (s itself when all n compute): measured, not
assumed; elsewhere the node's declared cores stand in for the effective ones.

Note [ranks computing at once]: a rank's compute is slowed by the ranks of
its pool that compute while it does, not by all the pool's ranks. In data
parallelism all of them compute together. In a pipeline a stage waits for
its neighbours in the fill and the drain, so only part of the step it
computes: with P stages and a lane of m of the plan's most M microbatches
per lane (v chunks each under interleaved 1F1B), m·v of the pipeline's
M·v + P − 1 slots (a third of the P − 1 under ZB, whose weight-gradients
fill most of the bubble): its busy share (`busy_share`). While a rank
computes, the ranks of its own stage compute too (they run the same
microbatch cycle; one with fewer microbatches than it for its share of
them), and each rank of another stage for its busy share (the stages'
phases taken as independent), so it computes beside
1 + Σ those shares ranks (`rank_slowdowns`). The share is the schedule's,
not the timeline's, so that the estimate, the planner's score and the
simulator, which all read `CostModel.slowdown` (the planner its mirror in
candidate_stage.py), charge every compute op alike: one number per rank,
derived from the plan's shape before anything is timed. GPipe over four
one-rank stages with four microbatches: each rank computes beside
1 + 3 · 4/7 ≈ 2.7 ranks, not 4.

Note [core wait]: sharing cores also costs every blocking call between
ranks (a collective, a message) a wait of its own. A rank blocked in a
collective sleeps; when its peer's data arrives it must be scheduled again,
and while the node's other ranks compute on every core that takes a
scheduler slot, once per call, whatever its size (a tp2 step's all-reduces
inside the layers took about 9 ms each on two shared cores, against 2 ms
back to back). The profile's collectives and messages, timed back to back,
do not see it. `hetc profile` measures it (runtime/core_wait.py): as many
processes as the cluster runs here, in pairs that compute a layer and then
synchronise, so some compute while others wait; the wait is how much longer
a call takes from its last member's arrival than the same call back to back
(`CoreWait`). The cost model adds it once to every collective and message
whose ranks' node shares its cores among more ranks than it has (either
pool above), wherever that call's time is formed (`CostModel.collective_time`,
`p2p_time`): also the tp, cp and ep collectives inside a layer. Nothing is
assumed where nothing was measured, and nodes that do not share cores (GPU
clusters, which declare none) pay nothing.

Note [exchange wait]: ring attention's shifts inside a layer wait longer
than a message. A shift posts four operations at once (K and V to the next
rank, the previous rank's back: `Ring.shift` in runtime/nn/ring_attention.py)
and waits for all four, and a layer makes several (cp − 1 forward, 2cp − 1
backward), so a step makes many; what they cost is the mean of their
waits, long tail and all, not the median call. Measured inside
`hetc run --local` of ring2 on two shared cores (load about 2): 32 shifts a
rank and step, 2.6 ms posting and 2.3 ms waiting each, about 150 ms of a
300 ms step, against a message's measured wait of 0.5 ms. `hetc profile`
times that very shift (runtime/core_wait.py, the same `Ring.shift`) beside
computing processes and records the mean extra over back to back as
`exchange_s`; the cost model charges it per shift. A profile without it
charges the message wait, as before it was measured.

A collective over every rank the node runs (a ZeRO-3 group of all four
local ranks) needs each of them scheduled in turn, not two: its wait is
measured apart, an all-reduce over all the profile's processes
(`world_collective_s`, the mean). Collectives over as many ranks as were
measured at once wait that; smaller groups the pairs' `collective_s`; a
profile without it charges the pairs' wait to all.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from hetc.ir.spec import ScheduleKind
from hetc.ir.topology import Gpu

__all__ = ["BlockingCall", "Computing", "CoreWait", "busy_share", "core_slowdown", "host_waits", "oversubscribed",
           "rank_slowdowns"]

_Host = tuple[str, int]


class BlockingCall(Enum):
    """The kinds of blocking call whose wait for a core the profile measures."""

    COLLECTIVE = "collective"
    MESSAGE = "message"              # one send and its receive
    EXCHANGE = "exchange"            # a ring-attention shift: sends and receives both ways, all waited


@dataclass(frozen=True, slots=True)
class CoreWait:
    """What `hetc profile` measured of one blocking call's wait for a core (Note [core wait]): with `ranks`
    processes on `cores` cores, a collective waited `collective_s` and a message `p2p_s` more than back to
    back."""

    ranks: int
    cores: int
    collective_s: float
    p2p_s: float
    exchange_s: float | None = None    # a ring-attention shift's (Note [exchange wait]); None: not measured
    world_collective_s: float | None = None   # a collective's over all `ranks` (Note [exchange wait])

    def __post_init__(self) -> None:
        optional = [0.0 if x is None else x for x in (self.exchange_s, self.world_collective_s)]
        if self.ranks < 1 or not all(x >= 0 for x in (self.collective_s, self.p2p_s, *optional)):   # rejects NaN
            raise ValueError(f"a core wait needs at least 1 rank and waits of at least 0 s, not {self.ranks}, "
                             f"{self.collective_s}, {self.p2p_s} and {self.exchange_s}")

    def seconds(self, call: BlockingCall, size: int = 2) -> float:
        """The wait of one blocking call of the kind over `size` ranks (a shift not measured waits as a
        message; a collective over fewer ranks than were measured at once, or not measured so, as a pair's)."""
        if call is BlockingCall.EXCHANGE and self.exchange_s is not None:
            return self.exchange_s
        if call is BlockingCall.COLLECTIVE and size >= self.ranks and self.world_collective_s is not None:
            return self.world_collective_s
        return self.collective_s if call is BlockingCall.COLLECTIVE else self.p2p_s


def core_slowdown(running: float, cores: float) -> float:
    """How many times slower each of `running` ranks computes on `cores` shared cores (0 cores: not shared)."""
    return running / cores if oversubscribed(running, cores) else 1.0


def oversubscribed(running: float, cores: float) -> bool:
    """Whether `running` ranks outnumber the `cores` they share (0 cores: each rank has its own)."""
    return 0 < cores < running


@dataclass(frozen=True, slots=True)
class Computing:
    """One rank as Note [ranks computing at once] reads it: its node, device kind, stage, and the share of
    the step its lane computes (`busy_share`)."""

    host: _Host
    kind: str
    stage: int
    busy: float


def busy_share(schedule: ScheduleKind, num_stages: int, microbatches: int, most: int, chunks: int = 1) -> float:
    """The share of the step a lane of `microbatches` computes in a pipeline of `num_stages` stages whose
    lanes take at most `most` microbatches (`chunks` per stage under interleaved 1F1B): Note [ranks
    computing at once]."""
    v = chunks if schedule is ScheduleKind.INTERLEAVED else 1
    bubble = (num_stages - 1) / (3 if schedule is ScheduleKind.ZB else 1)
    slots = most * v + bubble
    return min(1.0, microbatches * v / slots) if slots > 0 else 1.0


def rank_slowdowns(ranks: Sequence[Computing], cores_by_group: Mapping[str, int], cluster_cores: int = 0,
                   measured: Mapping[str, tuple[int, float]] | None = None) -> list[float]:
    """Per rank of `ranks` (a plan's, in order): how many times slower it computes for the ranks of its
    pools that compute beside it (Notes [shared cores], [ranks computing at once]), the larger of its
    node's and the cluster's.

    `measured`: device kind -> (ranks at once, their measured slowdown), the effective cores of a pool
    that shares cores among exactly that many ranks.
    """
    pools: dict[tuple[str, int] | None, list[int]] = defaultdict(list)
    for i, r in enumerate(ranks):
        if cores_by_group.get(r.host[0], 0) > 0:
            pools[r.host].append(i)
        if cluster_cores > 0:
            pools[None].append(i)
    out = [1.0] * len(ranks)
    for key, members in pools.items():
        cores = cluster_cores if key is None else cores_by_group[key[0]]
        for i, seen in _beside(ranks, members).items():
            slow = _pool_slowdown(seen, len(members), cores, (measured or {}).get(ranks[i].kind))
            out[i] = max(out[i], slow)
    return out


def _beside(ranks: Sequence[Computing], members: list[int]) -> dict[int, float]:
    """Per member of one pool: the ranks of the pool computing while it computes, itself included (Note
    [ranks computing at once]); members alike in stage and share are counted once."""
    shares: dict[int, Counter[float]] = defaultdict(Counter)
    for i in members:
        shares[ranks[i].stage][ranks[i].busy] += 1
    busy_total = sum(b * n for per_stage in shares.values() for b, n in per_stage.items())
    seen: dict[tuple[int, float], float] = {}
    for stage, per_stage in shares.items():
        others = busy_total - sum(b * n for b, n in per_stage.items())
        for mine in per_stage:
            seen[(stage, mine)] = others + sum(n * (1.0 if b >= mine else b / mine) for b, n in per_stage.items())
    return {i: seen[(ranks[i].stage, ranks[i].busy)] for i in members}


def host_waits(gpus: Iterable[Gpu], cores_by_group: Mapping[str, int], cluster_cores: int,
               measured: Mapping[str, CoreWait]) -> dict[_Host, CoreWait]:
    """The nodes of the plan's `gpus` whose ranks outnumber the cores they share (either pool), each with
    the wait measured for its device kind (Note [core wait]); the others, and kinds never measured, are
    left out: they pay none."""
    gpus = list(gpus)
    if not measured:
        return {}
    kinds = {g.host: g.device.name for g in gpus}
    return {host: measured[kinds[host]] for host, pools in _pools(gpus, cores_by_group, cluster_cores).items()
            if kinds[host] in measured and any(oversubscribed(at_once, cores) for at_once, cores in pools)}


def _pools(gpus: list[Gpu], cores_by_group: Mapping[str, int], cluster_cores: int) -> dict[_Host, list[tuple[int, int]]]:
    """Per node of the plan: the (ranks at once, cores) of each pool its ranks share, the node's and the
    cluster's (Note [shared cores]; 0 cores: not shared)."""
    running = Counter(g.host for g in gpus)
    return {host: [(n, cores_by_group.get(host[0], 0)), (len(gpus), cluster_cores)] for host, n in running.items()}


def _pool_slowdown(beside: float, ranks: int, cores: int, measured: tuple[int, float] | None) -> float:
    """A rank computing beside `beside` ranks (itself included) of a pool of `ranks` sharing `cores`: its
    slowdown on the pool's effective cores, measured for as many ranks, else its cores (Note [shared cores])."""
    if cores <= 0:
        return 1.0
    effective = measured[0] / measured[1] if measured is not None and measured[0] == ranks else cores
    return core_slowdown(beside, effective)
