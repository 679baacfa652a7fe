"""`CostModel`: memory in bytes and time in seconds for one resolved plan.

The contract lowering, the verifier, the timeline simulator and the planner
build on. Ranks are world ranks of `pipeline.world`; `ms` is a global
ministage index (`pipeline.ministages`). Memory methods return what one
rank holds; time methods what one rank spends, for one microbatch where a
microbatch is involved. The times that need no plan (a layer, a message, a
ring, a copy) are its `Hardware`'s (Note [hardware and plan] in hardware.py),
over the plan's ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from hetc.ir.memo import cached_property
from hetc.ir.layout import gathers_at_border, held_fraction
from hetc.passes.cost.compute import LayerCost
from hetc.passes.cost.cores import BlockingCall, Computing, busy_share, rank_slowdowns
from hetc.passes.cost.experts import ep_comm_time
from hetc.passes.cost.hardware import Hardware
from hetc.passes.cost.memory import (
    ShardFactors,
    context_reserve,
    shard_factors,
    state_bytes_per_param,
    transfer_buffers,
)
from hetc.passes.cost.links import groups_at_once
from hetc.passes.cost.profiles import Profiles
from hetc.passes.cost.params import expert_params, tied_copy_params
from hetc.passes.cost.plan_time import border_crossings
from hetc.passes.cost.shapes import (LayerKind, activation_elements, layer_flops, layer_kind,
                                    params_per_rank)
from hetc.passes.cost.schedule import Grouping
from hetc.passes.cost.transfers import Engine
from hetc.ir.pipeline import Ministage, Pipeline, Stage
from hetc.ir.plan import Plan
from hetc.ir.program import Collective, Phase, Unit
from hetc.ir.spec import (CPKind, OffloadTarget, ZeroShard)
from hetc.ir.topology import Gpu

if TYPE_CHECKING:     # they import this module
    from hetc.passes.cost.classes import ClassEstimate
    from hetc.passes.cost.estimate import Estimate

__all__ = ["PHASES", "CostModel", "computing_ranks"]

PHASES = tuple(Phase)


class CostModel:
    def __init__(self, plan: Plan, profiles: Profiles | None = None,
                 engine: Engine = Engine.HETC, measured_slowdown: Mapping[int, float] | None = None,
                 measured_link_slowdown: Mapping[tuple[int, int], float] | None = None):
        """`engine`: whose programs are timed, hetc's own (what `hetc compile` builds) unless the plan is
        one another engine ran (Sailor's measured Megatron-DeepSpeed runs, Note [async sends]).
        `measured_slowdown`: rank -> how many times slower it computes than it did (a running job's
        measurement, Note [live rebalancing] in runtime/rebalance.py), on top of `slowdown`'s own;
        `measured_link_slowdown`: (rank, rank), lower first -> how many times slower messages between the
        two cross their link than they did (Note [link transit] in runtime/links.py)."""
        self.plan = plan
        spec, pipeline = plan.spec, plan.pipeline
        self.spec, self.pipeline, self.topology = spec, pipeline, plan.topology
        self.engine = engine
        self.model, self.train = plan.model, plan.train
        self.hardware = Hardware(plan, profiles, pipeline.micro_batch, pipeline.world, measured_link_slowdown)
        self.profiles, self.compute = self.hardware.profiles, self.hardware.compute
        self.delta, self.hidden_bytes = self.hardware.delta, self.hardware.hidden_bytes
        self.states = state_bytes_per_param(self.model)
        self.geometry = plan.geometry
        self._routes: dict[int, dict[int, int]] = {}
        self._peers: dict[tuple[int, int], tuple[int, ...]] = {}
        self._compute_times: dict[tuple[int, int, Phase, Unit | None], float] = {}
        self._numels: dict[tuple[int, int, int, int], float] = {}
        self._layer_costs: dict[tuple[int, int], LayerCost] = {}   # (rank, layer): every phase asks
        self._layer_costs_of: dict[tuple[object, ...], LayerCost] = {}   # by `layer_cost`'s arguments
        self._at_once: dict[tuple[tuple[int, ...], tuple[str, int]], int] = {}
        self._on_host: dict[int, dict[tuple[str, int], int]] = {}
        # Note [shared cores]: the plan's ranks on a node with fewer cores than ranks compute slower
        cluster = spec.cluster
        node_cores = {n.name: n.cores for n in cluster.nodes} if cluster else {}
        ranks = computing_ranks(pipeline)
        self._slowdown = dict(zip(ranks, rank_slowdowns(list(ranks.values()), node_cores, cluster.cores,
                                                        self.profiles.shared))) if cluster else {}
        for rank, factor in (measured_slowdown or {}).items():
            self._slowdown[rank] = self._slowdown.get(rank, 1.0) * factor

    # ------------------------------------------------------------ structure

    def stage_of(self, rank: int) -> Stage:
        return self.pipeline.stage_of_rank[rank]

    def gpu(self, rank: int) -> Gpu:
        return self.pipeline.world[rank]

    def ministage(self, ms: int) -> Ministage:
        return self.pipeline.ministages[ms]

    def lane_of_microbatch(self, stage: int) -> dict[int, int]:
        """microbatch -> index of the lane of `stage` that serves it."""
        table = self._routes.get(stage)
        if table is None:
            table = {mb: lane.index for lane in self.pipeline.stages[stage].lanes for mb in lane.microbatches}
            self._routes[stage] = table
        return table

    def peer_lanes(self, stage: int, other: int) -> tuple[int, ...]:
        """Per lane of `stage`, the lane of `other` serving most of its microbatches (`plan_time.peer_lanes`)."""
        got = self._peers.get((stage, other))
        if got is None:
            from hetc.passes.cost.plan_time import peer_lanes
            m = range(self.pipeline.num_microbatches)
            mine, theirs = self.lane_of_microbatch(stage), self.lane_of_microbatch(other)
            got = self._peers[(stage, other)] = peer_lanes([mine[mb] for mb in m], [theirs[mb] for mb in m],
                                                           len(self.pipeline.stages[stage].lanes))
        return got

    def tp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks of this rank's lane that share its sequence part (its TP group)."""
        return self.geometry.tp_members(self.geometry.place(rank))

    def cp_group(self, rank: int) -> tuple[int, ...]:
        return self.geometry.cp_members(self.geometry.place(rank))

    def node_streams(self, rank: int) -> int:
        """Ranks of this rank's stage on its node. Its lanes run the same phase at once and each rank sends its
        border piece, so they share the node's link: a border is timed at this concurrency (Note [node links])."""
        return self._stage_on_host(self.stage_of(rank).index)[self.gpu(rank).host]

    def border_gather_time(self, rank: int) -> float:
        """The all-gather over this rank's tp group that rebuilds a boundary tensor it received as its tp part
        (Note [scatter-gather borders] in hetc/ir/layout.py); 0 where it receives the tensor whole."""
        stage = self.stage_of(rank)
        if not gathers_at_border(stage, self.model.seq):
            return 0.0
        return self.collective_time(Collective.ALL_GATHER, self.tp_group(rank), self.hidden_bytes / stage.cp)

    def message_time(self, src: int, dst: int, nbytes: float) -> float:
        """A border message of `nbytes` from `src` to `dst`: the transfer while the sender's lane ranks on its
        node send theirs (`node_streams`). What the simulator and lowering charge a message."""
        return self.p2p_time(src, dst, nbytes, self.node_streams(src))

    def border_gathers(self, rank: int, ms: int, phase: Phase, unit: Unit | None = None) -> float:
        """What a compute op spends gathering the boundary tensor it consumes from another stage
        (`border_gather_time`): a forward of ministage `ms` (of its first unit) takes the activation, an
        input-gradient or whole backward (of its last unit) the gradient. The gather runs where the runtime
        runs it, inside the consumer's compute, so a receive posted one op ahead (Note [p2p placement])
        does not hide it."""
        into, back = self.border_crossings(ms)
        layers = self.ministage(ms).layers
        if phase is Phase.FORWARD:
            crosses = into and (unit is None or unit.first == layers[0])
        elif phase in (Phase.INPUT_GRAD, Phase.BACKWARD):
            crosses = back and (unit is None or unit.stop == layers[-1] + 1)
        else:
            crosses = False
        return self.border_gather_time(rank) if crosses else 0.0

    def border_crossings(self, ms: int) -> tuple[int, int]:
        """`plan_time.border_crossings` of ministage `ms` in this pipeline."""
        mss = self.pipeline.ministages
        return border_crossings(ms, mss[ms].stage, lambda k: mss[k].stage, len(mss))

    def groups_at_once(self, rank: int, members: Sequence[int]) -> int:
        """Groups like `members` (a group of this rank's stage) crossing this rank's node link at once: every
        lane position's runs beside it (`links.groups_at_once`, Note [node links]). The estimate and the
        simulator time a stage's collectives at this concurrency."""
        host = self.gpu(rank).host
        key = (tuple(members), host)
        got = self._at_once.get(key)
        if got is None:
            on_node = self._stage_on_host(self.stage_of(rank).index).get(host, 0)
            got = self._at_once[key] = groups_at_once(on_node, sum(1 for r in members if self.gpu(r).host == host))
        return got

    def _stage_on_host(self, stage: int) -> dict[tuple[str, int], int]:
        got = self._on_host.get(stage)
        if got is None:
            got = self._on_host[stage] = dict(Counter(self.gpu(r).host for r in self.pipeline.stages[stage].ranks))
        return got

    def zero_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same parameters: this rank's tp slice in every lane and cp rank of the stage
        (the DP/ZeRO group; Megatron's dp × cp group, Note [rank geometry] in hetc/ir/geometry.py)."""
        return self.geometry.replicas(self.geometry.place(rank))

    def node_group(self, rank: int) -> tuple[int, ...]:
        return self.geometry.node_replicas(self.geometry.place(rank))

    def shard(self, rank: int) -> ShardFactors:
        """The fraction of each model state this rank keeps under its stage's ZeRO."""
        zero = self.stage_of(rank).zero
        node = len(self.node_group(rank)) if zero.shard is ZeroShard.NODE else None
        return shard_factors(zero, len(self.zero_group(rank)), node)

    # ------------------------------------------------------------ memory (bytes, one rank)

    def numel(self, ms: int, rank: int) -> float:
        """Parameters of ministage `ms` one rank of its TP and EP groups holds (before ZeRO sharding)."""
        return self.layers_numel(self.ministage(ms).layers, rank)

    def layers_numel(self, layers: range, rank: int) -> float:
        """`numel` of some layers of the rank's stage: a ministage's, or a ZeRO-3 unit's."""
        stage = self.stage_of(rank)
        key = (layers.start, layers.stop, stage.tp, stage.ep)   # memoised: lowering and the verifier ask per rank
        got = self._numels.get(key)
        if got is None:
            got = self._numels[key] = sum(params_per_rank(self.model, i, stage.tp, stage.ep) for i in layers) + \
                tied_copy_params(self.model, layers) / stage.tp     # split like the untied head's matrix
        return got

    def unit_param_bytes(self, unit: Unit, rank: int) -> float:
        """The full parameters of one ZeRO-3 unit (Note [units] in hetc/ir/program.py)."""
        return self.layers_numel(unit.layers, rank) * self.states.params

    def unit_grad_bytes(self, unit: Unit, rank: int) -> float:
        """The full gradients of one ZeRO-3 unit (its buffer while it is reduced, Note [gradient buffer
        release] in passes/lower/zero.py)."""
        return self.layers_numel(unit.layers, rank) * self.states.grads

    def unit_activation_bytes(self, unit: Unit, rank: int) -> float:
        """What a forward of one unit stashes for one microbatch."""
        return self.layers_activation_bytes(unit.layers, rank)

    def expert_fraction(self, ms: int, rank: int) -> float:
        """The share of `numel` that is expert parameters in their own buffer (expert parallelism), else 0."""
        stage = self.stage_of(rank)
        if stage.ep == 1:
            return 0.0
        blocks = sum(1 for i in self.ministage(ms).layers if layer_kind(self.model, i) == LayerKind.BLOCK)
        return blocks * expert_params(self.model) / stage.ep / self.numel(ms, rank)

    def param_bytes(self, ms: int, rank: int) -> float:
        return self.numel(ms, rank) * self.states.params

    def grad_bytes(self, ms: int, rank: int) -> float:
        return self.numel(ms, rank) * self.states.grads

    def optimizer_bytes(self, ms: int, rank: int) -> float:
        return self.numel(ms, rank) * self.states.optimizer

    def activation_bytes(self, ms: int, rank: int) -> float:
        return self.layers_activation_bytes(self.ministage(ms).layers, rank)

    def layers_activation_bytes(self, layers: range, rank: int) -> float:
        stage = self.stage_of(rank)
        total = 0.0
        for i in layers:
            elems, extra = activation_elements(self.model, i, self.pipeline.micro_batch,
                                               checkpoint=stage.checkpoint, tp=stage.tp, cp=stage.cp,
                                               sequence_parallel=stage.sequence_parallel)
            total += elems * self.delta + extra
        return total

    @cached_property
    def tied_bytes(self) -> float:
        """The gradient of a tied embedding's copy, V·H elements in the gradients' dtype: what `all_reduce
        tied` sums (Note [tied gradients] in hetc/ir/program.py); every rank holding a copy reduces it whole."""
        return float(self.model.vocab * self.model.hidden * self.states.grads)

    @cached_property
    def tied_time(self) -> float:
        """The step's sum of the tied embedding's copies over the ranks holding them (0 without copies): after
        their last backward, before the steps, beside the step's other closing collectives."""
        ranks = self.pipeline.tied_ranks(self.model)
        return self.collective_time(Collective.ALL_REDUCE, ranks, self.tied_bytes) if ranks else 0.0

    def held_boundary_bytes(self, ms: int, stage: Stage) -> float:
        """What one rank of `stage` holds of the activation leaving `ms` (its tokens, hetc/ir/layout.py)."""
        return self.boundary_bytes(ms) * held_fraction(stage)

    def boundary_bytes(self, ms: int) -> float:
        """The activation leaving ministage `ms` for one microbatch (none after the last)."""
        return 0.0 if ms == len(self.pipeline.ministages) - 1 else self.hidden_bytes

    def largest_held_boundary(self, stage: Stage) -> float:
        """The largest activation a rank of `stage` holds at one of its borders."""
        return max((self.held_boundary_bytes(ms, stage) for ms in stage.ministages), default=0.0)

    def reserve_bytes(self, rank: int) -> float:
        """What the verifier reserves beside the allocations it follows: the runtime's context and a gradient
        bucket being reduced. Not the border buffers of `transfer_buffers`: it follows each receive's buffer
        from its `recv` to its use (a send sends the output it was given, no copy), where the estimate, which
        counts no instructions, takes a send and a receive buffer."""
        device = self.gpu(rank).device
        stage = self.stage_of(rank)
        grads = sum(self.grad_bytes(ms, rank) for ms in stage.ministages) * self.shard(rank).grads
        return context_reserve(device.memory, device.is_cpu) + \
            transfer_buffers(0.0, grads, len(stage.lanes), self.states.grads)

    # ------------------------------------------------------------ time (seconds)

    def compute_time(self, rank: int, ms: int, phase: Phase, unit: Unit | None = None) -> float:
        """One microbatch through ministage `ms` on `rank` (through its layers `unit` only, when given: a
        ZeRO-3 unit, Note [units] in hetc/ir/program.py): F, B = I + W, I (input-grad), W (weight-grad)."""
        key = (rank, ms, phase, unit)
        got = self._compute_times.get(key)
        if got is None:
            if phase not in PHASES:
                raise ValueError(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
            layers = self.ministage(ms).layers if unit is None else unit.layers
            slowdown = self.slowdown(rank)
            got = sum(self._layer_cost(rank, i).phase(phase, slowdown) for i in layers) + \
                self.border_gathers(rank, ms, phase, unit)
            self._compute_times[key] = got
        return got

    def op_time(self, rank: int, ms: int, phase: Phase, unit: Unit | None = None) -> float:
        """A compute op's time: `compute_time`, and on a forward the share of the engine's per-microbatch
        overhead it carries (`forward_overhead`). What the simulator and lowering's timed schedule charge."""
        got = self.compute_time(rank, ms, phase, unit)
        return got + self.forward_overhead(rank, ms, unit) if phase is Phase.FORWARD else got

    def forward_overhead(self, rank: int, ms: int, unit: Unit | None = None) -> float:
        """The engine's per-microbatch seconds outside the layers (`microbatch_overhead`) that a forward
        through ministage `ms` (through its `unit`) carries: spread evenly over the stage's ministages, or all
        on the stage's first unit where the stage gathers per block, as the estimate places it
        (plan_time.unit_lane, lane_unit_ops)."""
        overhead = self.microbatch_overhead(rank)
        if overhead == 0.0:
            return 0.0
        stage = self.stage_of(rank)
        if unit is None:
            return overhead / len(stage.ministages)
        return overhead if unit.first == self.ministage(stage.ministages[0]).layers[0] else 0.0

    def compute_key(self, rank: int) -> tuple[object, ...]:
        """What every `op_time` of `rank` follows from (any ministage, phase or unit of its stage): two ranks
        of one stage with equal keys compute alike (lowering by class, passes/lower/classes.py)."""
        layers = [i for ms in self.stage_of(rank).ministages for i in self.ministage(ms).layers]
        return (self.slowdown(rank), self.microbatch_overhead(rank), *(self._layer_cost(rank, i) for i in layers))

    def slowdown(self, rank: int) -> float:
        """How many times slower this rank computes for sharing its node's cores with the ranks computing
        beside it (Notes [shared cores], [ranks computing at once])."""
        return self._slowdown.get(rank, 1.0)

    def _layer_cost(self, rank: int, idx: int) -> LayerCost:
        got = self._layer_costs.get((rank, idx))
        if got is None:
            got = self._layer_costs[(rank, idx)] = self._rank_layer_cost(rank, idx)
        return got

    def _rank_layer_cost(self, rank: int, idx: int) -> LayerCost:
        stage = self.stage_of(rank)
        block = layer_kind(self.model, idx) == LayerKind.BLOCK
        args = (self.gpu(rank).device.name, idx, stage.tp, stage.cp, self.tp_group(rank),
                stage.offload.activations is not OffloadTarget.NONE, stage.checkpoint,
                ep_comm_time(self, rank) if block else 0.0,
                self.cp_comm_time(rank) if block else (0.0, 0.0), stage.sequence_parallel)
        got = self._layer_costs_of.get(args)   # the ranks of a lane ask alike
        if got is None:
            got = self._layer_costs_of[args] = self.hardware.layer_cost(*args)
        return got

    def tp_comm_time(self, rank: int) -> float:
        stage = self.stage_of(rank)
        return self.hardware.tp_all_reduce_time(self.tp_group(rank), stage.cp, stage.sequence_parallel)

    def cp_comm_time(self, rank: int) -> tuple[float, float]:
        """(forward, backward) exposed context-parallel communication per block."""
        stage = self.stage_of(rank)
        group = self.cp_group(rank)
        if len(group) < 2:
            return 0.0, 0.0
        kv = self.model.num_kv_heads / self.model.heads
        full = self.hidden_bytes
        if stage.cp_kind is CPKind.ULYSSES:
            # two all-to-alls each way (q/k/v in, output back), blocking; 4(N_kv/N_q + 1)·δbSH/N_SP per rank
            fwd = self.collective_time(Collective.ALL_TO_ALL, group, (2 * kv + 1) * full / stage.tp) + \
                self.collective_time(Collective.ALL_TO_ALL, group, full / stage.tp)
            return fwd, fwd
        # ring attention: K and V go around forward, K, V, dK, dV backward; overlapped with attention, but
        # for each shift's wait for a core (Note [core wait]): cp − 1 forward, (cp − 1) + cp backward
        ring = self.p2p_transfer_time(group[0], group[1 % len(group)], 2 * kv * full / stage.cp / stage.tp)
        wait = self.call_wait(group, BlockingCall.EXCHANGE)   # Note [exchange wait]: per shift
        steps = len(group) - 1
        attn = layer_flops(self.model, 1, self.pipeline.micro_batch).attention
        core = attn / max(layer_flops(self.model, 1, self.pipeline.micro_batch).forward, 1.0)
        measured = self.compute.layer(self.gpu(rank).device.name, LayerKind.BLOCK,
                                      self.pipeline.micro_batch, stage.tp)
        overlap = measured.forward / stage.cp * core
        return (max(0.0, steps * ring - overlap) + steps * wait,
                max(0.0, 2 * steps * ring - 2 * overlap) + (2 * steps + 1) * wait)

    def optimizer_time(self, rank: int, numel: float) -> float:
        on_host = self.stage_of(rank).offload.optimizer is not OffloadTarget.NONE
        return self.hardware.optimizer_time(rank, numel, on_host) * self.slowdown(rank)

    # the hardware's, over the plan's ranks (Note [hardware and plan] in hardware.py)

    def p2p_time(self, src: int, dst: int, nbytes: float, concurrent: int = 1) -> float:
        return self.hardware.p2p_time(src, dst, nbytes, concurrent)

    def p2p_transfer_time(self, src: int, dst: int, nbytes: float, concurrent: int = 1) -> float:
        return self.hardware.p2p_transfer_time(src, dst, nbytes, concurrent)

    def collective_time(self, kind: Collective, ranks: Sequence[int], nbytes: float, concurrent: int = 1) -> float:
        return self.hardware.collective_time(kind, ranks, nbytes, concurrent)

    def call_wait(self, ranks: Sequence[int], call: BlockingCall = BlockingCall.COLLECTIVE) -> float:
        return self.hardware.call_wait(ranks, call)

    def microbatch_overhead(self, rank: int) -> float:
        return self.hardware.microbatch_overhead(rank)

    def copy_time(self, rank: int, nbytes: float) -> float:
        return self.hardware.copy_time(rank, nbytes)

    # ------------------------------------------------------------ the whole plan

    @cached_property
    def evaluation(self) -> ClassEstimate:
        """The step's composition over this pipeline (classes.py), its memory left to `estimate`."""
        from hetc.passes.cost.pipeline_stage import evaluate_pipeline
        return evaluate_pipeline(self, memory=False)

    @property
    def in_flight_limits(self) -> dict[int, int]:
        """Per stage, the microbatches a lane keeps in flight (Note [in-flight limit]): what lowering's
        schedule holds each lane to and the estimate counts activations with."""
        return self.evaluation.limits

    @property
    def interleaved_grouping(self) -> Grouping:
        """Interleaved 1F1B's groups (Note [interleaved groups]): what lowering's schedule cuts each lane's
        queues by and the estimate counts its stash with."""
        return self.evaluation.grouping

    def estimate(self) -> Estimate:
        from hetc.passes.cost.estimate import build_estimate
        return build_estimate(self)


def computing_ranks(pipeline: Pipeline) -> dict[int, Computing]:
    """The pipeline's ranks as Note [ranks computing at once] reads them (passes/cost/cores.py); the planner
    reads a candidate alike (passes/plan/candidate_stage.py `StageCosts._slowdowns`)."""
    if not pipeline.stages:
        return {}
    most = max(len(lane.microbatches) for s in pipeline.stages for lane in s.lanes)
    chunks = max(len(s.ministages) for s in pipeline.stages)
    return {r: Computing(pipeline.world[r].host, pipeline.world[r].device.name, s.index,
                         busy_share(pipeline.schedule, len(pipeline.stages), len(lane.microbatches), most, chunks))
            for s in pipeline.stages for lane in s.lanes for r in lane.ranks}
