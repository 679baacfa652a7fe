"""The cost model's primitives, for the planner: per-layer times, links, collectives, bytes.

The planner scores thousands of candidates, so it cannot build a Pipeline
and run `CostModel.estimate()` for each (at 2048 ranks one estimate takes
seconds). It evaluates plans class by class (`evaluate`) from the same
primitives the cost model composes, taken here from a *probe* `CostModel`
whose world is every GPU of the cluster (world rank = GPU id), so that its
link, copy and layer-time methods answer for any GPU.

Two primitives are memoised on what they depend on rather than on ranks:
a ring collective depends on the ring's size and on the kinds of its
consecutive pairs (node groups, same host, GPUs of the ring on the sender's
node), a point-to-point transfer on the two node groups and whether they
share a host. `CostModel.collective_time` recomputes every pair's link,
which at 1024 ranks with measured network fits costs tens of milliseconds.

Links, kinds of ring pairs and optimizer steps come from the cost model
itself (`CostModel.link`, `ring_pair_kinds`, `optimizer_seconds`); only the
memo keys differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from hetc.passes.cost import CostModel, Profiles
from hetc.passes.cost.memory import context_reserve, state_bytes_per_param
from hetc.passes.cost.model import optimizer_seconds, ring_pair_kinds
from hetc.passes.cost.network import ring_chunk, ring_steps
from hetc.passes.cost.shapes import LayerKind, activation_elements, layer_flops, params_per_rank
from hetc.pipeline import Pipeline
from hetc.spec import DTYPE_BYTES, Checkpointing, ModelSpec, ScheduleKind, Spec, TrainSpec
from hetc.topology import Gpu, Topology

__all__ = ["LayerCost", "Primitives"]




@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer on one rank for one microbatch: forward, input-grad, weight-grad seconds."""

    forward: float
    input_grad: float
    weight_grad: float


class Primitives:
    """Cost-model arithmetic for one spec, cluster and micro-batch size."""

    def __init__(self, spec: Spec, topo: Topology, profiles: Profiles | None, micro_batch: int):
        assert spec.model is not None and spec.train is not None   # a checked spec
        train = replace(spec.train, micro_batch=micro_batch)
        self.spec = replace(spec, train=train)
        self.topo = topo
        self.model: ModelSpec = spec.model
        self.train: TrainSpec = train
        self.micro_batch = micro_batch
        self.num_microbatches = train.global_batch // micro_batch
        probe_world = Pipeline((), (), topo.gpus, self.num_microbatches, micro_batch,
                               ScheduleKind.ONE_F_ONE_B, 1)
        self.probe = CostModel(self.spec, probe_world, topo, profiles)
        self.delta = DTYPE_BYTES[self.model.dtype]
        self.states = state_bytes_per_param(self.model)
        # b·S·H·δ: the activation at a border (every tp rank holds it all: no sequence parallelism) and
        # the TP all-reduce's buffer
        self.boundary = float(micro_batch * self.model.seq * self.model.hidden * self.delta)
        self._rings: dict = {}
        self._p2p: dict = {}
        self.egress_prices: dict[tuple[str, str], float] = {}
        self.layer_cost = lru_cache(maxsize=None)(self._layer_cost)
        self.lane_compute = lru_cache(maxsize=None)(self._lane_compute)
        self.params = lru_cache(maxsize=None)(self._params)
        self.activations = lru_cache(maxsize=None)(self._activations)

    # ------------------------------------------------------------ per layer

    def _params(self, idx_kind: str, tp: int) -> float:
        return params_per_rank(self.model, _index(self.model, idx_kind), tp)

    def _activations(self, idx_kind: str, tp: int) -> float:
        """Bytes one microbatch leaves stashed in this layer on one rank (cp = 1)."""
        elems, extra = activation_elements(self.model, _index(self.model, idx_kind), self.micro_batch, tp=tp)
        return elems * self.delta + extra

    def _layer_cost(self, device: str, idx_kind: str, tp: int, tp_group: tuple[int, ...],
                    rerun: bool) -> LayerCost:
        """Mirrors CostModel._layer_time for cp = 1: measured or arithmetic time, TP all-reduces, and the
        forward work the backward repeats (checkpointing; `rerun`: offloaded activations rerun the
        ministage)."""
        m = self.model
        measured = self.probe.compute.layer(device, idx_kind, self.micro_batch, tp)
        flops = layer_flops(m, _index(m, idx_kind), self.micro_batch)
        share_i = flops.input_grad / flops.backward if flops.backward else 0.0
        comm = 0.0
        if measured.needs_tp_comm and idx_kind == LayerKind.BLOCK and len(tp_group) > 1:
            comm = 2 * self.ring("all_reduce", tp_group, self.boundary)
        forward = measured.forward + comm
        recompute = forward if rerun else 0.0
        if m.activation_checkpoint is Checkpointing.FULL and idx_kind == LayerKind.BLOCK:
            recompute += forward
        elif m.activation_checkpoint is Checkpointing.SELECTIVE and flops.forward:
            recompute += forward * flops.attention / flops.forward
        return LayerCost(forward, measured.backward * share_i + comm + recompute,
                         measured.backward * (1.0 - share_i))

    def _lane_compute(self, devices: tuple[str, ...], tp: int, tp_group: tuple[int, ...], rerun: bool,
                      units: tuple[int, int, int]) -> tuple[float, float, float]:
        """(F, I, W) of one microbatch through (embed, blocks, head) units on a lane: its slowest kind
        per phase."""
        best = (0.0, 0.0, 0.0)
        for device in dict.fromkeys(devices):
            costs = [self.layer_cost(device, k, tp, tp_group, rerun) for k in _KINDS]
            mine = tuple(sum(n * getattr(c, a) for n, c in zip(units, costs) if n)
                         for a in ("forward", "input_grad", "weight_grad"))
            best = tuple(max(a, b) for a, b in zip(best, mine))
        return best

    # ------------------------------------------------------------ links

    def ring(self, kind: str, ranks: tuple[int, ...], nbytes: float, concurrent: int = 1) -> float:
        """`CostModel.collective_time` over GPU ids `ranks`, memoised on the ring's kinds of pair."""
        n = len(ranks)
        steps = ring_steps(kind, n)
        if steps == 0 or nbytes <= 0:
            return 0.0
        chunk = ring_chunk(nbytes, n)
        kinds = self._pair_kinds(kind, ranks)
        key = (kind, n, nbytes, concurrent, tuple((a.group, b.group, a.host == b.host, size) for a, b, size in kinds))
        got = self._rings.get(key)
        if got is None:
            worst = max(chunk / rate + latency for rate, latency in
                        (self.link(a, b, chunk, size, concurrent) for a, b, size in kinds))
            got = self._rings[key] = steps * worst
        return got

    @lru_cache(maxsize=4096)  # noqa: B019 - one Primitives per plan; rings repeat across candidates
    def _pair_kinds(self, kind: str, ranks: tuple[int, ...]) -> tuple:
        return tuple(ring_pair_kinds(kind, tuple(self.topo.gpus[r] for r in ranks)))

    def p2p(self, src: Gpu, dst: Gpu, nbytes: float, concurrent: int = 1) -> float:
        """`CostModel.p2p_time` between two GPUs, memoised on their node groups."""
        if nbytes <= 0 or src.id == dst.id:
            return 0.0
        key = (src.group, dst.group, src.host == dst.host, nbytes, concurrent)
        got = self._p2p.get(key)
        if got is None:
            rate, latency = self.link(src, dst, nbytes, 2, concurrent)
            got = self._p2p[key] = latency + nbytes / rate
        return got

    def link(self, a: Gpu, b: Gpu, nbytes: float, ring_size: int, concurrent: int) -> tuple[float, float]:
        return self.probe.link(a, b, nbytes, ring_size, concurrent)

    def copy(self, gpu: Gpu, nbytes: float) -> float:
        return self.probe.copy_time(gpu.id, nbytes)

    def overhead(self, gpu: Gpu) -> float:
        return self.probe.microbatch_overhead(gpu.id)

    def optimizer(self, gpu: Gpu, numel: float, on_host: bool) -> float:
        return optimizer_seconds(self.model, gpu.device, numel, on_host)

    def context(self, gpu: Gpu) -> float:
        return context_reserve(gpu.device.memory, gpu.device.is_cpu)


_KINDS = (LayerKind.EMBED, LayerKind.BLOCK, LayerKind.HEAD)


def _index(m, kind: str) -> int:
    return {LayerKind.EMBED: 0, LayerKind.BLOCK: 1, LayerKind.HEAD: m.layers + 1}[kind]
