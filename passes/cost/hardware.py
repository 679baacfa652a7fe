"""`Hardware`: what any GPU of a cluster costs, with no plan: layers, messages, collectives, copies.

The half of the cost model that needs no pipeline (Note [hardware and plan]). Its ranks number
`gpus`: every GPU of the cluster by default (rank = GPU id), which is what the planner reads
before any candidate is a Pipeline (passes/plan/primitives.py); a plan's `CostModel` numbers its
own world (`pipeline.world`). The GPUs numbered are also the ranks that run: where ranks
outnumber a node's cores, each blocking call waits for one (Note [core wait]).

Note [hardware and plan]: a time that follows from a GPU's kind, its node and its links (a layer
at a tp size, a message between two GPUs, a ring over some, a host copy) is asked of `Hardware`;
a question about a plan (which stage a rank serves, its groups, what it holds, the step) is asked
of `CostModel(plan, profiles)`, which builds its `Hardware` over the plan's world and adds what
the plan decides: the stage's tp, cp and checkpointing, the ranks' shared cores, their groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from hetc.ir.plan import Job
from hetc.ir.program import Collective
from hetc.ir.spec import DTYPE_BYTES, Arch, Checkpointing
from hetc.ir.topology import Gpu
from hetc.passes.cost.compute import ComputeModel, LayerCost, streaming_bandwidth
from hetc.passes.cost.memory import state_bytes_per_param
from hetc.passes.cost.cores import BlockingCall, host_waits
from hetc.passes.cost.links import NodeSplit, hierarchical_time, node_split
from hetc.passes.cost.network import Bandwidth, ring_chunk, ring_steps, tree_all_reduce_time
from hetc.passes.cost.profiles import Profiles
from hetc.passes.cost.shapes import LayerFlops, LayerKind, layer_flops, layer_kind

__all__ = ["ALL_PAIRS_LIMIT", "CPU_OPTIMIZER_BYTES_PER_S", "INTRA_NODE_NCCL_FRACTION", "Hardware", "ring_pair_kinds"]

# Host-side Adam (DeepSpeed's CPUAdam) streams the states through the CPU's memory.
CPU_OPTIMIZER_BYTES_PER_S = 10e9
# all-to-all over more ranks than this uses the ring's neighbours to find the slowest link.
ALL_PAIRS_LIMIT = 64

# Note [NCCL inside a node]
# A node's `intra` bandwidth is its link's rate per direction (NVLink: H100 SXM 450 GB/s, A100 SXM 300 GB/s),
# which NCCL's kernels do not reach: its all-gathers and all-reduces over 8 H100s on NVSwitch reach a bus
# bandwidth of 360 GB/s at large sizes, "exactly what we'd expect on H100" by NCCL's maintainers
# (NVIDIA/nccl-tests issue 326), and 8 A100s about 200-235 of 300 (nccl-tests issues 149 and 178). A declared
# link inside a node moves INTRA_NODE_NCCL_FRACTION of its rate; a measured fit is what it measured, links
# between nodes keep their rate (NCCL over InfiniBand runs near the line rate), and so does a node of `cpu`
# ranks (gloo over shared memory: its own rate, which `hetc profile` measures).
INTRA_NODE_NCCL_FRACTION = 0.8
# a ring's kinds of pair as its time depends on them: (node group, node group, same host, GPUs of the node)
_PairSignature = tuple[tuple[str, str, bool, int], ...]


class Hardware:
    """Seconds on the GPUs `gpus` (every GPU of `job`'s cluster unless given) for microbatches of
    `micro_batch` sequences. `link_slowdown`: (rank, rank), lower first -> how many times slower messages
    between the two cross their link than they did (a running job's measurement, Note [link transit] in
    runtime/links.py)."""

    def __init__(self, job: Job, profiles: Profiles | None, micro_batch: int,
                 gpus: tuple[Gpu, ...] | None = None,
                 link_slowdown: Mapping[tuple[int, int], float] | None = None):
        self.topology = job.topology
        self.model = job.model
        self.micro_batch = micro_batch
        self.gpus = job.topology.gpus if gpus is None else gpus
        self.profiles = profiles or Profiles()
        self.devices = {d.name: d for d in job.spec.devices}
        self.compute = ComputeModel(self.model, self.profiles, self.devices)
        self.delta = DTYPE_BYTES[self.model.dtype]
        # b·S·H·δ: one microbatch's hidden states, the PP message and the TP all-reduce's buffer
        self.hidden_bytes = float(micro_batch * self.model.seq * self.model.hidden * self.delta)
        self._link_slowdown = dict(link_slowdown or {})
        cluster = job.spec.cluster
        # Note [core wait]: every blocking call between ranks of such a node waits for a core once
        self._waits = host_waits(self.gpus, {n.name: n.cores for n in cluster.nodes}, cluster.cores,
                                 self.profiles.core_wait) if cluster else {}
        # memo keys: what the time depends on (kinds of pair: node groups, same host, GPUs of the node)
        self._collectives: dict[tuple[Collective, int, float, int, _PairSignature], float] = {}
        self._ring_kinds: dict[tuple[bool, tuple[int, ...]],
                               tuple[tuple[tuple[Gpu, Gpu, int], ...], _PairSignature]] = {}
        self._p2p: dict[tuple[str, str, bool, float, int], float] = {}
        self._fits: dict[tuple[str, str, bool, int, int], Bandwidth | None] = {}
        self._splits: dict[tuple[int, ...], NodeSplit | None] = {}

    # ------------------------------------------------------------ a layer

    def layer_cost(self, device: str, idx: int, tp: int, cp: int, tp_group: tuple[int, ...], rerun: bool,
                   checkpoint: Checkpointing, expert_comm: float = 0.0, cp_comm: tuple[float, float] = (0.0, 0.0),
                   sequence_parallel: bool = False) -> LayerCost:
        """Layer `idx` on a rank of `device` for one microbatch, its lane split tp × cp: the measured (or
        arithmetic) time, the exposed TP all-reduces over `tp_group`, a block's expert and (forward,
        backward) context-parallel communication, and the forward work the backward repeats (`rerun`:
        activations offloaded, so the ministage runs again; `checkpoint`: the stage's activation
        checkpointing). With `sequence_parallel` the TP calls are
        Megatron-SP's (`tp_all_reduce_time`, `sp_norm_grad_time`)."""
        kind = layer_kind(self.model, idx)
        measured = self.compute.layer(device, kind, self.micro_batch, tp)
        flops = layer_flops(self.model, idx, self.micro_batch)
        share_i = flops.input_grad / flops.backward if flops.backward else 0.0
        block = kind == LayerKind.BLOCK
        tp_comm = measured.needs_tp_comm and block
        comm = self.tp_all_reduce_time(tp_group, cp, sequence_parallel) if tp_comm else 0.0
        comm += expert_comm
        # the replicated norm weights' gradients, summed over the TP group in backward only
        backward_comm = comm + (self.sp_norm_grad_time(tp_group) if tp_comm and sequence_parallel else 0.0)
        forward = measured.forward / cp + comm + cp_comm[0]
        # the recomputed forward repeats its communication too (`_recompute` is linear in the forward)
        input_grad_comm = backward_comm + cp_comm[1] + \
            _recompute(kind, comm + cp_comm[0], flops, rerun, checkpoint)
        return LayerCost(forward,
                         measured.backward / cp * share_i + backward_comm + cp_comm[1] +
                         _recompute(kind, forward, flops, rerun, checkpoint),
                         measured.backward / cp * (1.0 - share_i), comm + cp_comm[0], input_grad_comm)

    def tp_all_reduce_time(self, group: tuple[int, ...], cp: int, sequence_parallel: bool = False) -> float:
        """Two all-reduces (attention out, FFN out) of b·S·H/cp per block and pass over `group`; under
        Megatron-SP an all-gather in and a reduce-scatter out of each instead: the same bytes in twice the
        calls, each blocking on its own (runtime/nn/tensor_parallel.py `GroupTP`; Note [core wait])."""
        if len(group) < 2:
            return 0.0
        nbytes = self.hidden_bytes / cp
        if sequence_parallel:
            return 2 * (self.collective_time(Collective.ALL_GATHER, group, nbytes) +
                        self.collective_time(Collective.REDUCE_SCATTER, group, nbytes))
        return 2 * self.collective_time(Collective.ALL_REDUCE, group, nbytes)

    def sp_norm_grad_time(self, group: tuple[int, ...]) -> float:
        """Under Megatron-SP, a block's backward all-reduces each replicated norm parameter's gradient over
        `group` (`GroupTP.replicated`): two norms a block, a weight each (llama's RMSNorm) or a weight and a
        bias (gpt's LayerNorm)."""
        tensors = 2 * (1 if self.model.arch is Arch.LLAMA else 2)
        return tensors * self.collective_time(Collective.ALL_REDUCE, group, self.model.hidden * self.delta)

    # ------------------------------------------------------------ messages and collectives

    def p2p_time(self, src: int, dst: int, nbytes: float, concurrent: int = 1) -> float:
        """Send `nbytes` from `src` to `dst` while `concurrent` such transfers share each node's link: the
        transfer, and the message's wait for a core where the ranks share cores (Note [core wait])."""
        if nbytes <= 0 or src == dst:
            return 0.0
        return self.p2p_transfer_time(src, dst, nbytes, concurrent) + self.call_wait((src, dst), BlockingCall.MESSAGE)

    def p2p_transfer_time(self, src: int, dst: int, nbytes: float, concurrent: int = 1) -> float:
        """`p2p_time` without the wait for a core: latency and bytes over the link.

        A link depends on the two node groups and whether they share a host
        (`link`), so the time is memoised on those, not on the ranks.
        """
        if nbytes <= 0 or src == dst:
            return 0.0
        a, b = self.gpus[src], self.gpus[dst]
        key = (a.group, b.group, a.host == b.host, nbytes, concurrent)
        got = self._p2p.get(key)
        if got is None:
            rate, latency = self.link(a, b, nbytes, 2, concurrent)
            got = self._p2p[key] = latency + nbytes / rate
        return got * self._link_slowdown.get((min(src, dst), max(src, dst)), 1.0)    # memoised per kind of link

    def collective_time(self, kind: Collective, ranks: Sequence[int], nbytes: float, concurrent: int = 1) -> float:
        """A collective over `ranks` (in ring order) of the full buffer `nbytes`, while `concurrent` groups
        like it cross each node's link (`groups_at_once`): the flat ring, or over several nodes the faster
        of it and the node-by-node form (Note [hierarchical collectives] in links.py).
        Where the ranks share cores the call waits for one once (Note [core wait])."""
        if ring_steps(kind, len(ranks)) == 0 or nbytes <= 0:
            return 0.0
        ranks = tuple(ranks)
        got = self._flat_time(kind, ranks, nbytes, concurrent)
        split = self._split(kind, ranks)
        if split is not None:
            got = min(got, hierarchical_time(
                kind, nbytes, split,
                lambda k, b, _: max(self._flat_time(k, node, b, 1) for node in split.nodes),
                lambda k, b, g: self._flat_time(k, split.across, b, concurrent * g)))
        return got + self.call_wait(ranks)

    def _split(self, kind: Collective, ranks: tuple[int, ...]) -> NodeSplit | None:
        if kind == Collective.ALL_TO_ALL:
            return None
        if ranks not in self._splits:
            self._splits[ranks] = node_split(ranks, lambda r: self.gpus[r].host)
        return self._splits[ranks]

    def _flat_time(self, kind: Collective, ranks: tuple[int, ...], nbytes: float, concurrent: int) -> float:
        """One ring over all of `ranks`; an all-reduce across nodes may run as NCCL's tree instead.

        A ring runs as fast as its slowest pair, and pairs alike in kind
        (`ring_pair_kinds`) time alike, so the time is memoised on the
        ring's size and kinds of pair: rings of other ranks over the same
        kinds of link (other lanes, other candidate plans) cost a lookup.
        """
        n = len(ranks)
        steps = ring_steps(kind, n)
        if steps == 0 or nbytes <= 0:
            return 0.0
        kinds, signature = self._pair_kinds(kind, ranks)
        key = (kind, n, nbytes, concurrent, signature)
        got = self._collectives.get(key)
        if got is None:
            chunk = ring_chunk(nbytes, n)
            worst = max(chunk / rate + latency for rate, latency in
                        (self.link(a, b, chunk, size, concurrent) for a, b, size in kinds))
            got = steps * worst
            if kind == Collective.ALL_REDUCE and any(a.host != b.host for a, b, _ in kinds):
                # or NCCL's double binary tree, whichever is faster (network.py)
                links = [self.link(a, b, nbytes, size, concurrent) for a, b, size in kinds]
                got = min(got, tree_all_reduce_time(n, nbytes, min(r for r, _ in links), max(t for _, t in links)))
            self._collectives[key] = got
        return got

    def call_wait(self, ranks: Sequence[int], call: BlockingCall = BlockingCall.COLLECTIVE) -> float:
        """One blocking call's wait for a core over `ranks`: the largest measured
        at a node of theirs whose ranks outnumber its cores; 0 elsewhere (Note [core wait])."""
        if not self._waits:
            return 0.0
        waits = [w for w in (self._waits.get(self.gpus[r].host) for r in ranks) if w is not None]
        return max((w.seconds(call, len(ranks)) for w in waits), default=0.0)

    def _pair_kinds(self, kind: Collective,
                    ranks: tuple[int, ...]) -> tuple[tuple[tuple[Gpu, Gpu, int], ...], _PairSignature]:
        """The ring's kinds of pair, and what of them its time depends on (the memo's key)."""
        key = (kind is Collective.ALL_TO_ALL, ranks)   # the ring collectives use the same pairs
        got = self._ring_kinds.get(key)
        if got is None:
            kinds = tuple(ring_pair_kinds(kind, tuple(self.gpus[r] for r in ranks)))
            got = self._ring_kinds[key] = (kinds, tuple((a.group, b.group, a.host == b.host, size)
                                                         for a, b, size in kinds))
        return got

    # ------------------------------------------------------------ a GPU and its links

    def microbatch_overhead(self, rank: int) -> float:
        """Seconds this rank's engine spends per microbatch outside the layers (measured, else 0)."""
        return self.profiles.overhead.get(self.gpus[rank].device.name, 0.0)

    def copy_time(self, rank: int, nbytes: float) -> float:
        device = self.gpus[rank].device
        rate = self.profiles.copy.get(device.name) or device.host_link
        return nbytes / rate if nbytes > 0 else 0.0

    def optimizer_time(self, rank: int, numel: float, on_host: bool) -> float:
        """One optimizer step over `numel` parameters: memory-bound (reads and writes every state), on the
        host (DeepSpeed's CPUAdam) when `on_host`."""
        delta_opt = DTYPE_BYTES[self.model.optimizer.master_dtype]
        per_param = state_bytes_per_param(self.model)
        states = per_param.optimizer / delta_opt  # n_opt + master
        master = states - self.model.optimizer.num_states
        # the gradient read, the parameter written, every state read and written
        moved = numel * (per_param.grads + self.delta + 2 * states * delta_opt + (0 if master else self.delta))
        if on_host:
            return moved / CPU_OPTIMIZER_BYTES_PER_S
        return moved / streaming_bandwidth(self.gpus[rank].device)

    def link(self, a: Gpu, b: Gpu, nbytes: float, ring_size: int, concurrent: int) -> tuple[float, float]:
        """(bytes/s for one stream, latency) between two GPUs for messages of `nbytes`, `concurrent` streams
        sharing the node link (Note [node links] in links.py): each gets 1/concurrent of the node pair's rate,
        at most 1/nics of it (one stream goes through one NIC).

        The measured fit (if any) is looked up once per kind of pair: node
        groups, same host, ring size on the node, streams sharing the link.
        """
        fit = self.measured_link(a, b, ring_size, concurrent)
        same_host = a.host == b.host
        share = 1 if same_host else concurrent
        if fit is not None:
            return fit.rate(nbytes) / share, 0.0
        link = self.topology.link(a, b)
        if same_host:   # Note [NCCL inside a node]; a `cpu` kind's ranks run gloo, not NCCL
            return link.bandwidth * (1.0 if a.device.is_cpu else INTRA_NODE_NCCL_FRACTION), link.latency
        return link.bandwidth / max(share, self._nics(a, b)), link.latency

    def _nics(self, a: Gpu, b: Gpu) -> int:
        """Note [node links]: a stream between two nodes leaves through one NIC and arrives through one, so it
        moves at most 1/nics of the node pair's link, the more NICs of the two ends."""
        groups = self.topology.groups
        return max(groups[a.group].nics, groups[b.group].nics)

    def measured_link(self, a: Gpu, b: Gpu, ring_size: int, concurrent: int) -> Bandwidth | None:
        """The profiles' fit for this kind of pair, which `link` prefers over the spec's declared link."""
        same_host = a.host == b.host
        key = (a.group, b.group, same_host, ring_size, concurrent)
        if key not in self._fits:
            net = self.profiles.network
            self._fits[key] = net.intra_rate(a.device.name, ring_size) if same_host else \
                net.inter_rate(a.zone, a.device.name, b.zone, b.device.name, concurrent)
        return self._fits[key]


def _recompute(kind: str, forward: float, flops: LayerFlops, rerun: bool, ckpt: Checkpointing) -> float:
    """Forward work the backward repeats: activation checkpointing (`ckpt`, the stage's), and with
    activations offloaded the whole ministage once more (only its boundary input was kept; the runtime
    reruns it)."""
    ministage = forward if rerun else 0.0
    if ckpt is Checkpointing.FULL and kind == LayerKind.BLOCK:
        return ministage + forward
    if ckpt is Checkpointing.SELECTIVE and flops.forward:
        return ministage + forward * flops.attention / flops.forward
    return ministage


def ring_pair_kinds(kind: Collective, gpus: tuple[Gpu, ...]) -> list[tuple[Gpu, Gpu, int]]:
    """One (sender, receiver, GPUs of the ring on the sender's node) per kind of link a ring uses.

    A ring runs as fast as its slowest pair, and pairs of the same node
    groups, host sharing and per-node count are alike, so one of each is
    enough (an all-to-all uses every pair; small ones are listed in full).
    """
    n = len(gpus)
    per_node = Counter(g.host for g in gpus)
    if kind == Collective.ALL_TO_ALL and n <= ALL_PAIRS_LIMIT:
        pairs = [(a, b) for a in gpus for b in gpus if a.id != b.id]
    else:
        pairs = [(gpus[i], gpus[(i + 1) % n]) for i in range(n)]
    kinds: dict[tuple[str, str, bool, int], tuple[Gpu, Gpu, int]] = {}
    for a, b in pairs:
        kinds.setdefault((a.group, b.group, a.host == b.host, per_node[a.host]), (a, b, per_node[a.host]))
    return list(kinds.values())
