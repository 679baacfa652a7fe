"""The cost model's primitives for any GPU of a cluster, as the planner reads them.

The planner reads thousands of candidates class by class
(passes/plan/candidate_stage.py) before any of them is a Pipeline.
Every time here is the cluster's `Hardware` (passes/cost/hardware.py,
ranks = GPU ids), which needs no plan; this class memoises it on what a
candidate's classes of lanes share (a layer's kind, a lane's device kinds)
and adds the bytes a candidate's stages hold.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from hetc.passes.cost import Profiles
from hetc.passes.cost.hardware import Hardware
from hetc.passes.cost.transfers import Engine
from hetc.passes.cost.compute import LayerCost
from hetc.passes.cost.cores import Computing, rank_slowdowns
from hetc.passes.cost.memory import context_reserve, state_bytes_per_param
from hetc.passes.cost.shapes import LayerKind, activation_elements, params_per_rank
from hetc.ir.program import Collective, Phase
from hetc.ir.spec import Checkpointing, ModelSpec, TrainSpec
from hetc.ir.topology import Gpu
from hetc.ir.plan import Job

__all__ = ["Primitives"]


class Primitives:
    """Cost-model arithmetic for one spec, cluster and micro-batch size."""

    def __init__(self, job: Job, profiles: Profiles | None, micro_batch: int, fill: float = 1.0,
                 options_to_fill: bool = False):
        train = replace(job.train, micro_batch=micro_batch)
        # the share of each device's memory a plan may fill, and whether stage options are built to it or to
        # the whole device (Note [planning headroom])
        self.fill, self.options_to_fill = fill, options_to_fill
        self.topo = job.topology
        self.model: ModelSpec = job.model
        self.train: TrainSpec = train
        self.micro_batch = micro_batch
        self.num_microbatches = train.global_batch // micro_batch
        self.hardware = Hardware(job, profiles, micro_batch)
        self.engine = Engine.HETC   # the planner plans for hetc's own programs
        self.delta = self.hardware.delta
        self.states = state_bytes_per_param(self.model)
        # the activation at a border (every tp rank holds it all: no sequence parallelism)
        self.boundary = self.hardware.hidden_bytes
        self.egress_prices: dict[tuple[str, str], float] = {}
        self.layer_cost = lru_cache(maxsize=None)(self._layer_cost)
        self.lane_compute = lru_cache(maxsize=None)(self._lane_compute)
        self.params = lru_cache(maxsize=None)(self._params)
        self.activations = lru_cache(maxsize=None)(self._activations)
        self._slowdowns: dict[tuple[Computing, ...], tuple[float, ...]] = {}
        cluster = self.topo.cluster
        self.cores_shared = cluster.cores > 0 or any(n.cores > 0 for n in cluster.nodes)

    # ------------------------------------------------------------ per layer

    def _params(self, idx_kind: LayerKind, tp: int) -> float:
        return params_per_rank(self.model, _index(self.model, idx_kind), tp)

    def _activations(self, idx_kind: LayerKind, tp: int, checkpoint: Checkpointing) -> float:
        """Bytes one microbatch leaves stashed in this layer on one rank (cp = 1) under `checkpoint`."""
        elems, extra = activation_elements(self.model, _index(self.model, idx_kind), self.micro_batch,
                                           checkpoint=checkpoint, tp=tp)
        return elems * self.delta + extra

    def _layer_cost(self, device: str, idx_kind: LayerKind, tp: int, tp_group: tuple[int, ...],
                    rerun: bool, checkpoint: Checkpointing) -> LayerCost:
        """`Hardware.layer_cost` for a lane with cp = 1, memoised on the layer's kind."""
        return self.hardware.layer_cost(device, _index(self.model, idx_kind), tp, 1, tp_group, rerun, checkpoint)

    def _lane_compute(self, devices: tuple[str, ...], tp: int, tp_group: tuple[int, ...], rerun: bool,
                      checkpoint: Checkpointing, units: tuple[int, int, int],
                      slowdown: float = 1.0) -> tuple[float, float, float]:
        """(F, I, W) of one microbatch through (embed, blocks, head) units on a lane whose ranks compute
        `slowdown` times slower (`LayerCost.phase`): its slowest kind per phase."""
        best = (0.0, 0.0, 0.0)
        for device in dict.fromkeys(devices):
            costs = [self.layer_cost(device, k, tp, tp_group, rerun, checkpoint) for k in _KINDS]
            f, i, w = (sum((n * c.phase(phase, slowdown) for n, c in zip(units, costs) if n), 0.0)
                       for phase in (Phase.FORWARD, Phase.INPUT_GRAD, Phase.WEIGHT_GRAD))
            best = (max(best[0], f), max(best[1], i), max(best[2], w))
        return best

    # ------------------------------------------------------------ links

    def ring(self, kind: Collective, ranks: tuple[int, ...], nbytes: float, concurrent: int = 1) -> float:
        """`Hardware.collective_time` over GPU ids `ranks`."""
        return self.hardware.collective_time(kind, ranks, nbytes, concurrent)

    def p2p(self, src: Gpu, dst: Gpu, nbytes: float, concurrent: int = 1) -> float:
        """`Hardware.p2p_time` between two GPUs."""
        return self.hardware.p2p_time(src.id, dst.id, nbytes, concurrent)

    def copy(self, gpu: Gpu, nbytes: float) -> float:
        return self.hardware.copy_time(gpu.id, nbytes)

    def overhead(self, gpu: Gpu) -> float:
        return self.hardware.microbatch_overhead(gpu.id)

    def optimizer(self, gpu: Gpu, numel: float, on_host: bool) -> float:
        return self.hardware.optimizer_time(gpu.id, numel, on_host)

    def rank_slowdowns(self, ranks: tuple[Computing, ...]) -> tuple[float, ...]:
        """`cores.rank_slowdowns` of a plan's ranks (all 1 when no node and not the cluster shares cores),
        memoised on them (every stage of a candidate asks for its plan's)."""
        if not self.cores_shared:   # no node and not the cluster share cores: nobody is slowed
            return (1.0,) * len(ranks)
        got = self._slowdowns.get(ranks)
        if got is None:
            cluster = self.topo.cluster
            got = self._slowdowns[ranks] = tuple(rank_slowdowns(ranks, {n.name: n.cores for n in cluster.nodes},
                                                                cluster.cores, self.hardware.profiles.shared))
        return got

    def context(self, gpu: Gpu) -> float:
        return context_reserve(gpu.device.memory, gpu.device.is_cpu)

    def spare(self, gpu: Gpu) -> float:
        """Bytes of `gpu` a stage option leaves unfilled beyond its reserve (Note [planning headroom])."""
        return (1.0 - self.fill) * gpu.device.memory if self.options_to_fill else 0.0


_KINDS = (LayerKind.EMBED, LayerKind.BLOCK, LayerKind.HEAD)


def _index(m: ModelSpec, kind: LayerKind) -> int:
    return {LayerKind.EMBED: 0, LayerKind.BLOCK: 1, LayerKind.HEAD: m.layers + 1}[kind]
