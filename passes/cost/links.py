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
- a pipeline border counts its own lane's ranks on the node
  (`CostModel.node_streams`): each sends its 1/tp slice at once (Note
  [scatter-gather borders] in hetc/ir/layout.py), in the estimate, the
  planner and each message of the compiled programs (`message_time`:
  at the streams of the message's sender). The
  other lanes of the stage are not counted. Counting every lane's ranks on
  the node (the stage's ranks there, in `node_streams` and the planner's
  `ResolvedStage.concurrent` alike) was tried twice. When hetc's programs
  still sent every tp rank the whole activation, tp pipelines whose borders
  cross nodes became transfer-bound and the closed form's overlap of border
  transfers (Note [async sends] in transfers.py) read them 14-35 % short of
  the compiled programs. With 1/tp parts (2026-12-05) and GPipe's first
  backward counted as compiled (Note [GPipe backward peak] in memory.py),
  154 of the 158 agreement tests (tests/test_plan_agreement.py) still held;
  the planner's new choices failed the rest: deep job 13 explained −11.5 %
  of its compiled step (the same overlap: its 8 stages of 2 tp-4 lanes, a
  node each, send 8 slices at once, 178 us each; rechecked 2026-12-05, its
  last stage, 592 us of ops a microbatch, ran a 668 us cycle: its next
  activation waited behind the gradient it sent on the pair's NCCL line,
  where the closed form overlaps both with its backward); random
  jobs 22 and 65 +18.5 % and +11.8 % of their compiled memory (explain
  now prints the compiled peaks, Note [one step time], but the planner
  searches with the closed form; slower borders raise a ZB lane's
  in-flight limit to all three of its microbatches, which the estimate
  holds, while the compiled order holds two); and the three-kind
  Llama-3-8B job on 2 + 2 + 4 GPUs left its L4s idle. deep13's cause, the
  pair's one NCCL line, is gone since each direction has a communicator of
  its own (Note [one communicator per direction] in runtime/comm.py).
  Rerun 2026-12-06 after that: 154 of 158 again, deep13 passing; failing
  were jobs 22 and 65 (the same memory), the idle L4s, and random job 19
  (interleaved 1F1B, two lanes of a node per stage: explain +11.9 % of its
  compiled step, its border transfers 21.7 ms each at half the link, which
  the compiled chunks overlap better than the closed form counts). Both
  causes are closed since 2026-12-07: job 22's lanes held fewer than
  their limit because the limits of the lanes that fed them cap what they
  are sent (`schedule.chain_held`, Note [in-flight limit]), and job 19's
  lanes line up stage to stage, so their transfers overlap as one lane's
  do (`schedule.in_steady_order`, Note [async sends]). With them, all 158
  agreement tests hold with sharing counted, but other tests fail. One:
  on Llama-3-70B over 8 H100 + 8 A100-40 + 96 L4 (tests/
  test_plan_idle.py) `hetc plan` found nothing that fits: its plan before
  (ZB-H1, twelve L4 stages of 8 lanes, a node each, then four A100 stages
  of 2 lanes on one node) explained 74.3 s and compiled to 90.0 s with
  sharing counted. Traced 2026-12-07: the closed form timed the borders a
  lane receives at its own lane's streams, the simulator each message at
  its sender's; the A100 lanes' activations, sent by eight L4 lanes of a
  node at once, took 0.288 s in the compiled programs and 0.086 s in the
  closed form. Both now time a message at its sender's streams
  (`plan_time.border_time`, the planner's `StageCosts.border`), which
  matters without sharing too wherever the two sides' lanes differ in tp;
  with it that plan explains 89.6 s of its 90.0 s and the planner finds
  plans again. What still fails with sharing counted: random job 27's
  interleaved plan (four lanes of 4 microbatches feeding lanes of 1, 1, 7
  and 7, not lined up) runs 1.13 × its lower bound
  (tests/test_plan_lockstep.py), an exhaustive search of a small cluster
  beats the planner by 1.6 % (tests/test_planner_optimality.py seed 6: a
  Zorse plan of one lane and four, its second stage under ZeRO-3, 0.0989
  s; the planner configures that layout with ZeRO-1, 0.1186 s, and
  refines only the best Zorse plan of two stages with lanes, one lane and
  two at 0.1026 s: `search._to_refine`), a step tests/test_profiles_cli.py
  pins moves, and the plans far from the bound change (docs/costmodel.md).
  So sharing is not built.

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
