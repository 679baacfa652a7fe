"""Which collectives share a node's link to other nodes at once, and collectives over several nodes.

Note [node links]: a `link` (or the cluster's `inter_bandwidth`) is the
bandwidth of a node pair; k streams crossing it at once each get 1/k of it
(`CostModel.link`). What runs at once is counted the same way for the
estimate, the simulator and the planner:

- the ZeRO collectives of a stage (`groups_at_once`): every lane position's
  group reduces (or gathers) at once, so alike groups of the stage cross each
  node's link together: the stage's ranks on the node, over the ones of this
  group there (which the collective counts itself: its node-local members
  send their pieces over the link at once, `hierarchical_time`). Eight tp
  ranks of a node, each in its own data-parallel group, share the node's
  link eight ways;
- a pipeline border counts the stage's ranks on the node
  (`CostModel.node_streams`): every lane of a stage runs the same phase at
  once, and each of its ranks sends its 1/tp slice (Note [scatter-gather
  borders] in hetc/ir/layout.py), in the estimate, the planner
  (`ResolvedStage.concurrent`) and each message of the compiled programs
  (`message_time`), each message at the streams of its sender
  (`plan_time.border_time` and the planner's `StageCosts.border` time the
  borders a lane receives so). Two lanes of a node each sending at the
  whole link were 2x optimistic. Counting the lane's own ranks only was
  what the agreement family (tests/test_plan_agreement.py) held until
  2026-12-07; counting the stage's moved the planner to plans that exposed
  gaps, each closed at its cause:
  - random job 22's lanes held fewer microbatches than their limit, the
    limits of the lanes that fed them capping what they are sent
    (`schedule.chain_held`, Note [in-flight limit]): explain's memory was
    +18.5 % of the compiled peak;
  - random job 19's interleaved lanes line up stage to stage, so their
    transfers overlap as one lane's do (`schedule.in_steady_order`, Note
    [async sends]): explained +11.9 % of its compiled step;
  - the closed form timed a border a lane receives at its own lane's
    streams, the simulator at the sender's: on Llama-3-70B over 8 H100 +
    8 A100-40 + 96 L4 (tests/test_plan_idle.py) eight L4 lanes of a node
    send to two A100 lanes, 0.288 s an activation compiled against 0.086 s
    explained; its plan explained 74.3 s and compiled to 90.0 s, and
    `hetc plan` then found nothing that fits;
  - the planner's refinement of small searches took one structure per
    schedule, depth and whether a stage has lanes (`search._to_refine`);
    on the optimality family's seed 6 it refined a Zorse plan of one lane
    and two and left one lane and four under the ZeRO-1 its assignment
    chose (0.1186 s; under ZeRO-3 it runs 0.0989 s, an exhaustive search's
    best): it now takes one per schedule and lanes of each stage;
  - deep job 13's pair's one NCCL line, gone with a communicator a
    direction (Note [one communicator per direction] in runtime/comm.py).
  Other stages' traffic on the same link is not counted.

A node group's `nics` (1 unless declared) bound one stream: it leaves
through one NIC and arrives through one, so k streams between two nodes
each move at 1/max(k, nics) of the pair's link (`Hardware.link`, the more
NICs of the two ends). On rail-optimized boards (a DGX's eight NICs, one
per GPU) one GPU's border or ring step reaches an eighth of the node's
bandwidth, eight at once all of it; with one NIC one stream has the whole
link, as before. Only specs that declare `nics` change: the published runs'
DGX nodes (docs/benchmarks.md "Published runs": the three data-parallel
rows' flat rings slow, 0.3-0.6 % on their steps; the pipelined ones run
tp 8, eight streams a node, and do not move).

Measured network fits (Sailor's) are the aggregate rate of `count` GPUs of
a node sending at once; they are looked up at the same stream count.

Note [hierarchical collectives]: a ring collective over ranks of several
nodes, with g > 1 ranks on every node, is timed as NCCL's topology-aware
algorithms move it: a reduce-scatter inside each node over NVLink (X over g
ranks), then the g node-local positions each reduce their X/g piece with the
same position on the other m nodes at once (g streams per node over the
link), then an all-gather inside the node; a reduce-scatter is the first two
steps, an all-gather the last two. The flat ring over all n ranks is kept
as the other candidate and the faster is taken (a collective over one node,
or with one rank per node, is flat). Across nodes an all-reduce is a ring or
NCCL's double binary tree, whichever is faster (`tree_all_reduce_time` in
network.py: the tree for small buffers over many nodes, such as the gradient
norm's and the loss's); reduce-scatters and all-gathers are rings. (The tree
once made random job 81's planner pick an interleaved plan of ZeRO-3 lanes fed
by a stage of fewer lanes, 10 % short of its compiled programs; the planner no
longer proposes such plans, Note [interleaved lanes] in
passes/plan/structures.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetc.ir.program import Collective

__all__ = ["NodeSplit", "groups_at_once", "hierarchical_time", "node_split"]

# (kind, bytes, streams of this kind at once on each node) -> seconds of a collective over one part of a split
PartTime = Callable[[Collective, float, int], float]


def groups_at_once(stage_on_node: int, members_on_node: int) -> int:
    """Alike groups of a stage crossing one node's link at once: the stage's ranks on the node, over this
    group's own members there (Note [node links])."""
    return max(1, stage_on_node // max(members_on_node, 1))


@dataclass(frozen=True, slots=True)
class NodeSplit:
    """A group over several nodes with the same number of ranks on each (Note [hierarchical collectives])."""

    per_node: int                            # g: the group's ranks on every node
    nodes: tuple[tuple[int, ...], ...]       # one node's members per kind of node (node group), in group order
    across: tuple[int, ...]                  # the first member of every node: one position's ring across nodes


def node_split(ranks: Sequence[int], host_of: Callable[[int], tuple[str, int]]) -> NodeSplit | None:
    """How `ranks` split by node, or None where the collective stays flat: one node, one rank per node,
    or nodes holding different numbers of the group's ranks."""
    by_host: dict[tuple[str, int], list[int]] = {}
    for r in ranks:
        by_host.setdefault(host_of(r), []).append(r)
    sizes = {len(members) for members in by_host.values()}
    if len(by_host) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    kinds: dict[str, tuple[int, ...]] = {}
    for host, members in by_host.items():
        kinds.setdefault(host[0], tuple(members))
    return NodeSplit(sizes.pop(), tuple(kinds.values()), tuple(members[0] for members in by_host.values()))


def hierarchical_time(kind: Collective, nbytes: float, split: NodeSplit, intra: PartTime, inter: PartTime) -> float:
    """A collective of the full buffer `nbytes` as node-local and cross-node steps (Note [hierarchical
    collectives]): `intra(kind, bytes, 1)` over a node's members, `inter(kind, bytes, g)` over one position's
    ranks across nodes while the node's g positions run theirs."""
    g = split.per_node
    piece = nbytes / g
    if kind == Collective.ALL_REDUCE:
        return intra(Collective.REDUCE_SCATTER, nbytes, 1) + inter(Collective.ALL_REDUCE, piece, g) + \
            intra(Collective.ALL_GATHER, nbytes, 1)
    if kind == Collective.REDUCE_SCATTER:
        return intra(Collective.REDUCE_SCATTER, nbytes, 1) + inter(Collective.REDUCE_SCATTER, piece, g)
    if kind == Collective.ALL_GATHER:
        return inter(Collective.ALL_GATHER, piece, g) + intra(Collective.ALL_GATHER, nbytes, 1)
    raise ValueError(f"no node-by-node form of '{kind}'")
