"""Memory formulas: model states per ZeRO level, activations in flight, reserve.

Model states for Φ parameters whose replicas are kept in sync by a ZeRO
group of N ranks (DESIGN.md §3, survey I.I), with δ the training dtype's
bytes, δ_opt the optimizer's and n_opt its state tensors:

    ZeRO 0: (2δ + (n_opt + m)·δ_opt)·Φ
    ZeRO 1: (2δ + (n_opt + m)·δ_opt / N)·Φ
    ZeRO 2: (δ + δ/N + (n_opt + m)·δ_opt / N)·Φ
    ZeRO 3: (2δ/N + (n_opt + m)·δ_opt / N)·Φ

where m = 1 for the fp32 master copy when δ ≠ δ_opt and 0 otherwise (so
AdamW with δ = δ_opt = 4 is 4δΦ at ZeRO 0). Hierarchical ZeRO shards over
the N_node lanes of one node and replicates across nodes; `across = 1`
further shards the optimizer state over all N lanes (ZeRO-1 across groups).

Activations in flight per rank depend on the schedule (see `in_flight`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from hetc.passes.cost.schedule import Grouping, group_width
from hetc.ir.program import Collective
from hetc.ir.spec import DTYPE_BYTES, ModelSpec, OffloadSpec, OffloadTarget, ScheduleKind, ZeroSpec
from hetc.ir.topology import Gpu

__all__ = [
    "GRAD_BUCKET_PARAMS",
    "BackwardPeak",
    "RankMemory",
    "ShardFactors",
    "StateBytes",
    "StateMemory",
    "StatesHeld",
    "ZorseGathers",
    "ZorseParams",
    "activation_memory",
    "context_reserve",
    "even_groups",
    "forwards_first",
    "gpipe_backward_peak",
    "in_flight",
    "interleaved_group",
    "interleaved_peak",
    "interleaved_update",
    "interleaved_warmup",
    "offloaded",
    "rank_headroom",
    "rank_memory",
    "resident_params",
    "resident_window",
    "shard_factors",
    "state_bytes_per_param",
    "state_memory",
    "transfer_buffers",
    "zorse_backward_peak",
    "zorse_gathers",
]

# Megatron's default DDP bucket (40M parameters): gradients are reduced bucket by bucket.
GRAD_BUCKET_PARAMS = 40_000_000
# CUDA context, cuBLAS/cuDNN workspaces and NCCL's channels: what nvidia-smi shows on an idle
# training process before the first tensor. A CPU rank (a local run) needs little.
GPU_CONTEXT_BYTES = 1.0 * 2**30
CPU_CONTEXT_BYTES = 64 * 2**20
# The caching allocator cannot use every byte: fragmentation keeps a share unusable.
FRAGMENTATION = 0.05


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes per parameter, unsharded: weights, gradients, optimizer (master copy + states)."""

    params: float
    grads: float
    optimizer: float

    def collective(self, kind: Collective, param_bytes: float) -> float:
        """The bytes a ZeRO collective over a buffer of `param_bytes` parameters moves: a gather its
        parameters, a reduction its gradients (Note [gradient dtype] in hetc/ir/spec.py)."""
        return param_bytes if kind is Collective.ALL_GATHER else param_bytes * self.grads / self.params


def state_bytes_per_param(model: ModelSpec) -> StateBytes:
    delta = DTYPE_BYTES[model.dtype]
    delta_opt = DTYPE_BYTES[model.optimizer.master_dtype]
    master = 1 if delta != delta_opt else 0
    grads = DTYPE_BYTES[model.gradient_dtype]    # fp32 main gradients for bf16 (Note [gradient dtype])
    return StateBytes(delta, grads, (model.optimizer.num_states + master) * delta_opt)


@dataclass(frozen=True, slots=True)
class ShardFactors:
    """The fraction of each unsharded state one rank keeps."""

    params: float
    grads: float
    optimizer: float
    reduced: float = 0.0     # the reduced gradient shard ZeRO-1 to 3 hold until the step (Note [reduced shard])


def shard_factors(zero: ZeroSpec, group: int, node_group: int | None = None) -> ShardFactors:
    """Fractions kept per rank under `zero` for a ZeRO group of `group` lanes.

    `node_group`: lanes of that group on this rank's node (hierarchical ZeRO,
    `shard = node`); None for plain ZeRO over the whole group.
    """
    level = zero.resolved_level
    shard = group if node_group is None else node_group
    opt_shard = group if (node_group is None or zero.across >= 1) else node_group
    return ShardFactors(
        params=1.0 / shard if level >= 3 else 1.0,
        grads=1.0 / shard if level >= 2 else 1.0,
        optimizer=1.0 / opt_shard if level >= 1 else 1.0,
        reduced=1.0 / shard if level >= 1 and shard > 1 else 0.0,    # a group of one reduces nothing
    )


def offloaded(offload: OffloadSpec) -> tuple[bool, bool]:
    """(parameters, optimizer state) kept on the host."""
    return offload.params is not OffloadTarget.NONE, offload.optimizer is not OffloadTarget.NONE


def interleaved_update(schedule: ScheduleKind, grad_clip: float) -> bool:
    """Each ministage reduces and steps right after its backward (Zorse without clipping; with clipping
    every step waits for the global gradient norm at the end: passes/lower/zero.py)."""
    return schedule is ScheduleKind.ZORSE and not grad_clip


def resident_window(k: int, count: int, prefetch: int, regathers: bool, ops: int = 1) -> range:
    """The ministages (of `count`, in forward order) whose offloaded parameters are on the device as Zorse's
    interleaved update runs the first backward op of ministage k, each ministage's backward `ops` ops (its
    microbatches) (Note [parameter residency] in passes/lower/offload.py): k, the `prefetch` before it (its
    backward runs them next), and those after it whose updates overlap that op. A ministage stays for two ops
    after its last backward op: its step after the first, its offload waited one op later; three where
    ZeRO-1/2 gathers it back after its step, that gather waited one op after the step (Note [regathers of
    offloaded parameters] in passes/lower/zero.py). With one microbatch a lane that is two or three
    ministages behind k, with two or more one."""
    behind = (2 if regathers else 1) // max(ops, 1) + 1
    return range(max(0, k - prefetch), min(count, k + 1 + behind))


def resident_params(schedule: ScheduleKind, grad_clip: float, params: Sequence[float], prefetch: int,
                    regathers: bool) -> float:
    """Bytes of offloaded parameters on the device at a rank's peak (Note [parameter residency] in
    passes/lower/offload.py): under Zorse's interleaved update the heaviest `resident_window`;
    per-microbatch schedules interleave every ministage's ops (forwards of one microbatch, backwards of
    another, weight gradients of a third), and steps at the end bring every ministage back, so lowering's
    windows overlap and it keeps them all."""
    if interleaved_update(schedule, grad_clip):
        prefix = _prefix(params)
        return max(_window_sum(prefix, resident_window(k, len(params), prefetch, regathers)) for k in range(len(params)))
    return sum(params)


def _prefix(values: Sequence[float]) -> list[float]:
    """0 and the running sums of `values`: a window's sum in one subtraction (`_window_sum`)."""
    return [0.0, *accumulate(values)]


def _window_sum(prefix: Sequence[float], window: range) -> float:
    return prefix[window.stop] - prefix[window.start] if window else 0.0


def in_flight(schedule: ScheduleKind, stage: int, num_stages: int, microbatches: int,
              chunks: int = 1, limit: int | None = None, group: int | None = None,
              later: Sequence[int] | None = None) -> float:
    """Microbatches' worth of one stage's activations a rank holds at its peak.

    GPipe keeps every microbatch until the backward; 1F1B (and ZB-H1, which
    keeps the 1F1B peak) at most its in-flight `limit` (`schedule.in_flight_limits`,
    Note [in-flight limit]; by default the stages ahead of it, itself included);
    interleaved 1F1B with v chunks warms up `interleaved_warmup` chunk-steps
    (the lane's `group`, `interleaved_group`; p by default; `later`) and each chunk
    holds 1/v of the stage (with v = 1 too: lowering keeps that warm-up, not
    1F1B's p − s). Zorse runs one ministage at a time (handled by the caller).
    """
    if schedule is ScheduleKind.GPIPE:
        return float(microbatches)
    ahead = num_stages - stage
    if schedule is ScheduleKind.INTERLEAVED:
        warmup = interleaved_warmup(stage, num_stages, chunks, num_stages if group is None else group, later)
        return min(float(microbatches * chunks), float(warmup)) / chunks
    return float(min(microbatches, ahead if limit is None else limit))


def interleaved_group(num_stages: int, first_lanes: int, microbatches: int, num_microbatches: int,
                      grouping: Grouping = Grouping.DEPTH_FIRST) -> int:
    """Microbatches of a lane serving `microbatches` of `num_microbatches` in each group of interleaved 1F1B
    (Note [interleaved groups]): a group is p microbatches of every lane of the first stage (of
    `first_lanes`), so p on every lane where the lanes line up, more on a lane of a narrower stage; all of
    them breadth-first (`schedule.interleaved_grouping`)."""
    if grouping is Grouping.BREADTH_FIRST:
        return microbatches
    width = group_width(num_stages, -(-num_microbatches // max(first_lanes, 1)))
    return max(1, round(width * first_lanes * microbatches / max(num_microbatches, 1)))


def interleaved_warmup(stage: int, num_stages: int, chunks: int, group: int,
                       later: Sequence[int] | None = None) -> int:
    """Chunk-steps a lane of interleaved 1F1B runs ahead: Megatron's 2(p−s−1) + (v−1)·g + 1 for a lane with g
    microbatches in each group (`interleaved_group`; g = p in a grid), the round trip 2(p−s−1) taken
    g/p times where g < p (Note [interleaved warm-up], passes/lower/schedule.py); with `later`, the
    chunks each later stage holds after this one's last (`Pipeline.chunks_after`; Megatron's loop: one
    each), 2(k−1)·g more for each later stage of k.

    Note [chunks after a stage]: Megatron's chunks loop (stage s holds
    virtual stages s, s + p, ...), so after a stage's last chunk a
    microbatch meets one chunk of each later stage and its gradient comes
    back: two chunk-steps a stage. Where a later stage holds k contiguous
    chunks (hetc's `ministages` under interleaved 1F1B), it runs its first
    chunk for the whole group before its second, so the round trip through
    it is (k−1)·g + 1 chunk-steps each way; and no gradient returns before
    this stage has sent the whole group through its last chunk. With
    Megatron's count the strict order stuck before such a stage until
    lowering lifted the limits (Note [lifting a limit]) one microbatch at a
    time, on a schedule the estimate did not know: hetero64 with one stage
    of three chunks, −18 % of the compiled peak; Zorse's cluster B Llama 7B
    as interleaved 1F1B with 4 and 3 chunks, −28.6 % (536 lifts).
    """
    later = (1,) * (num_stages - stage - 1) if later is None else later
    trip = 2 * len(later)
    if group < num_stages:
        trip = -(-trip * group // num_stages)
    trip += sum(2 * (k - 1) * group for k in later)
    return trip + (chunks - 1) * group + 1


def even_groups(microbatches: int, group: int) -> tuple[int, ...]:
    """`microbatches` in groups of `group`, the last one partial: a lane's interleaved groups where the lanes
    line up (`pipeline_stage.lane_groups` cuts them where they do not)."""
    full, rest = divmod(microbatches, group)
    return (group,) * full + ((rest,) if rest else ())


@lru_cache(maxsize=4096)
def interleaved_peak(per_chunk: tuple[float, ...], groups: tuple[int, ...], warmup: int) -> float:
    """Most activation bytes a lane of interleaved 1F1B stashes: chunk c stashes `per_chunk[c]` per microbatch,
    and Megatron's strict order (passes/lower/schedule.py: the lane's `groups` of microbatches, chunk by
    chunk, backwards in reverse chunk order) runs a forward while fewer than `warmup` chunk-steps are in
    flight, else a backward. The chunks need not stash alike (the last stage's holds the head), so the peak
    is counted chunk by chunk along that order, not as `warmup` / v microbatches of the whole stage.

    Forward i runs once backwards 0..i−warmup are done, so what is held after it is the first i + 1
    forwards' stash less the first i − warmup + 1 backwards' (prefix sums; every stash is ≥ 0, so the
    peak is at or after the warm-up's last forward). Note [interleaved peak is periodic]: over whole
    groups of one size both sums grow by a group's stash every group, so what is held repeats with the
    group's period; the peak needs only enough of them for the warm-up and one period, then the rest.
    """
    alike = next((i for i, g in enumerate(groups) if g != groups[0]), len(groups))
    keep = min(alike, -(-(warmup - 1) // (groups[0] * len(per_chunk))) + 1) if groups else 0
    groups = groups[:keep] + groups[alike:]   # dropping alike groups in between keeps every value
    forwards = [b for g in groups for b in _chunk_steps(per_chunk, g)]
    steps = len(forwards)
    if steps == 0:
        return 0.0
    stashed = list(accumulate(forwards))
    if warmup >= steps:
        return stashed[-1]
    backwards = [b for g in groups for b in _chunk_steps(per_chunk[::-1], g)]
    freed = [0.0, *accumulate(backwards[:steps - warmup])]
    return max(map(float.__sub__, stashed[warmup - 1:], freed))


def _chunk_steps(per_chunk: tuple[float, ...], microbatches: int) -> list[float]:
    """The stash of each chunk-step of one group of `microbatches`, chunk by chunk."""
    return [bytes_ for bytes_ in per_chunk for _ in range(microbatches)]


def context_reserve(memory: float, is_cpu: bool) -> float:
    """Framework reserve of a device with `memory` bytes: context plus allocator fragmentation."""
    return (CPU_CONTEXT_BYTES if is_cpu else GPU_CONTEXT_BYTES) + FRAGMENTATION * memory


def transfer_buffers(held_boundary: float, grads_kept: float, lanes: int, grad_bytes_per_param: float) -> float:
    """Bytes a rank keeps for transfers: a send and a receive buffer of the largest activation it holds
    at a border (`held_boundary`), and one gradient bucket being reduced when the stage has replicas."""
    bucket = min(grads_kept, GRAD_BUCKET_PARAMS * grad_bytes_per_param) if lanes > 1 else 0.0
    return 2 * held_boundary + bucket


@dataclass(frozen=True, slots=True)
class StatesHeld:
    """A rank's model states before the memory policy places them (bytes; `CostModel` or the planner)."""

    params: Sequence[float]   # each ministage's parameters (this rank's tp/ep part, not ZeRO-sharded)
    grads: Sequence[float]    # each ministage's gradients, likewise
    grads_kept: float         # gradients ZeRO leaves this rank (experts sharded over their own group)
    optimizer_kept: float     # optimizer state ZeRO leaves this rank
    shard: ShardFactors
    gathers: bool             # ZeRO-3 with a group to gather from: full parameters come and go
    lanes: int                # lanes of the stage (a gradient bucket when more than one)
    held_boundary: float      # the largest activation this rank holds at a border
    grad_bytes_per_param: float
    # the parameters of each unit ZeRO-3 gathers at once (Note [zero-3 units] in zero_units.py): a layer's
    # where it gathers per block; empty: the ministages are the units
    unit_params: Sequence[float] = ()
    regathers: bool = False   # ZeRO-1/2 over a group: each ministage's parameters are gathered after its step


def reduced_at_once(held: StatesHeld) -> float:
    """ZeRO-2/3's full gradient buffers on the device at once (Note [gradient buffer release] in
    passes/lower/zero.py): the buffer being filled and the one before it, whose reduce-scatter the rank waits
    for after the next op, each with its reduce-scatter's output (its shard, 1/N of it) until that wait; per
    unit where the stage gathers per block, else per ministage (0 where the gradients are not sharded)."""
    if held.shard.grads >= 1.0:
        return 0.0
    return gathered_at_once(gradient_buffers(held), 1) * (1.0 + held.shard.grads)


def gradient_buffers(held: StatesHeld) -> list[float]:
    """The full gradients of each buffer a gradient op fills under ZeRO-2/3, in run order: a unit's where the
    stage gathers per block, else a ministage's."""
    if not held.unit_params:
        return list(held.grads)
    per_param = sum(held.grads) / sum(held.params) if sum(held.params) else 1.0
    return [u * per_param for u in held.unit_params]


def gathered_at_once(units: Sequence[float], prefetch: int) -> float:
    """ZeRO-3's full parameters on the device at once: a unit and the `prefetch` after it in the order it
    runs them (forward, or backward in reverse: the same windows of neighbours), the heaviest such window."""
    ahead = 1 + prefetch
    return max(sum(units[i:i + ahead]) for i in range(len(units)))


@dataclass(frozen=True, slots=True)
class StateMemory:
    """Model states and buffers on a rank's device, and what is offloaded to its host."""

    params: float
    grads: float
    optimizer: float
    buffers: float
    host: float
    after_backward: float = 0.0   # held only once the backward is done: ZeRO-1's reduced gradient shard
    first_backward: float = 0.0   # gradients on the device while the step's first gradient op runs
    gathered: float = 0.0         # of `buffers`, ZeRO-3's full parameters at once (`gathered_at_once`)


def state_memory(held: StatesHeld, offload: OffloadSpec, schedule: ScheduleKind, grad_clip: float,
                 prefetch: int) -> StateMemory:
    """Where a rank's states sit at its peak: resident parameters (Note [parameter residency]), gradients
    (one ministage's when each is stepped right after its backward), optimizer state unless offloaded,
    and buffers: transfers plus ZeRO-3's gathered parameters (the current unit and `prefetch` more: a
    ministage each, or one layer each where the stage gathers per block; `gathered_at_once`)."""
    off_params, off_opt = offloaded(offload)
    params = sum(held.params)
    resident = resident_params(schedule, grad_clip, held.params, prefetch, held.regathers) if off_params else params
    reduced = reduced_at_once(held)
    grads = max(max(held.grads), reduced) if interleaved_update(schedule, grad_clip) else held.grads_kept + reduced
    gather = gathered_at_once(held.unit_params or held.params, prefetch) if held.gathers else 0.0
    sharded_grads = sum(held.grads) * held.shard.grads
    buffers = transfer_buffers(held.held_boundary, sharded_grads, held.lanes, held.grad_bytes_per_param) + gather
    host = (params * held.shard.params if off_params else 0.0) + (held.optimizer_kept if off_opt else 0.0)
    # ZeRO-1 reduces once, after the last backward: its shard (in the compute dtype) comes when no activations
    # are held, and beside the full gradients it was reduced from (Note [reduced shard] in runtime/buffers.py)
    once = held.shard.grads >= 1.0 and not interleaved_update(schedule, grad_clip)   # else each ministage's, stepped
    after = sum(held.grads) * held.shard.reduced if once else 0.0
    return StateMemory(resident * held.shard.params, grads, 0.0 if off_opt else held.optimizer_kept, buffers, host,
                       after, min(grads, first_gradients(held)), gather)


def first_gradients(held: StatesHeld) -> float:
    """Gradients on the device while a step's first gradient op runs: every full gradient where they are not
    sharded (the runtime allocates them with the parameters), else the one buffer that op fills; the shards
    ZeRO-2/3 keep come with the reduce-scatters after it (Note [GPipe backward peak])."""
    return held.grads_kept if held.shard.grads >= 1.0 else max(gradient_buffers(held))


def activation_memory(schedule: ScheduleKind, stage: int, num_stages: int, microbatches: int,
                      per_microbatch: Sequence[float], limit: int | None, offload_activations: bool,
                      boundary_inputs: float, largest_input: float, prefetch: int,
                      group: int | None = None, later: Sequence[int] | None = None,
                      groups: Sequence[int] | None = None) -> tuple[float, float]:
    """(on the device, on the host) activation bytes at the peak of a rank of `stage` serving
    `microbatches`, whose ministages stash `per_microbatch` bytes each per microbatch (under interleaved
    1F1B, `group`: its microbatches in its largest group, `interleaved_group`; `later`: the chunks after
    the stage's, `interleaved_warmup`; `groups`: the sizes of its groups where lowering's differ from
    even ones of `group`, `pipeline_stage.lane_groups`).

    Per-microbatch schedules keep `in_flight` microbatches of every
    ministage, interleaved 1F1B what its strict order holds at most
    (`interleaved_peak`); Zorse runs one ministage over every microbatch, so
    it keeps them all, or with activations offloaded only each microbatch's
    boundary inputs (`boundary_inputs`, on the host) and one ministage
    recomputed at a time, beside `prefetch` + 2 stashed inputs on the device
    (`largest_input`, the largest input of one of its ministages): the one it
    recomputes, those fetched ahead, and the last forward's, whose copy to the
    host is still in flight as the first backward runs (passes/lower/offload.py
    waits for it after that backward).
    """
    per_op = schedule in (ScheduleKind.ZORSE, ScheduleKind.INTERLEAVED)
    held = microbatches if per_op else \
        in_flight(schedule, stage, num_stages, microbatches, len(per_microbatch), limit, group, later)
    if offload_activations:
        return max(per_microbatch) + (2 + prefetch) * largest_input, held * boundary_inputs
    if schedule is ScheduleKind.INTERLEAVED:
        g = num_stages if group is None else group
        warmup = interleaved_warmup(stage, num_stages, len(per_microbatch), g, later)
        return interleaved_peak(tuple(per_microbatch), tuple(groups or even_groups(microbatches, g)), warmup), 0.0
    return held * sum(per_microbatch), 0.0


class BackwardPeak(NamedTuple):
    """What a rank holds at once at its peak in the backward (`zorse_backward_peak`, `gpipe_backward_peak`);
    `params`: its offloaded parameters on the device then, `gathered`: ZeRO-3's full parameters then (None:
    `state_memory`'s)."""

    activations: float
    grads: float
    params: float | None = None
    gathered: float | None = None

    @property
    def total(self) -> float:
        """What of the rank's memory the peak decides (the parameters where it says)."""
        return self.activations + self.grads + (self.params or 0.0) + (self.gathered or 0.0)


@dataclass(frozen=True, slots=True)
class ZorseGathers:
    """A Zorse rank's ZeRO-3 ministages, each gathered whole (`zorse_backward_peak`): their full parameters,
    and how many the rank gathers ahead of the one it runs."""

    params: Sequence[float]
    prefetch: int


def zorse_gathers(held: StatesHeld, prefetch: int) -> ZorseGathers | None:
    """The ministages a ZeRO-3 rank gathers whole, for `zorse_backward_peak` (None where it gathers none, or
    per block, whose windows `gathered_at_once` counts)."""
    return ZorseGathers(held.params, prefetch) if held.gathers and not held.unit_params else None


@dataclass(frozen=True, slots=True)
class ZorseParams:
    """A Zorse rank's offloaded parameters, for `zorse_backward_peak`: each ministage's on the device, and
    what `resident_window` needs to know of lowering."""

    params: Sequence[float]
    prefetch: int
    regathers: bool
    gathers: bool = False   # ZeRO-3 gathers each ministage from its shards (Note [parameter residency])


def zorse_backward_peak(schedule: ScheduleKind, grad_clip: float, offload_activations: bool, microbatches: int,
                        per_microbatch: Sequence[float], grads: Sequence[float], grads_kept: float,
                        released: bool = False, stashed_inputs: float = 0.0, offloaded_params: ZorseParams | None = None,
                        to_end: int | None = None, reduced: float = 0.0,
                        gathers: ZorseGathers | None = None) -> BackwardPeak | None:
    """(activations, gradients, offloaded parameters) on the device at a Zorse rank's peak, when they are not at
    their largest at once; None for the other schedules.

    Note [Zorse backward peak]: Zorse runs its ministages one at a time, the
    backward in reverse order, so as the backward of ministage k starts, the
    activations of ministages 0..k are all alive (every microbatch's) and
    gradients exist for k..K-1 only: k's own, and the later ones' as ZeRO
    keeps them until the step (with clipping, every step waits for the
    global norm) or none (without, each ministage steps right after its
    backward). The peak is the largest of these sums, not the most
    activations plus every gradient: the first backward holds the whole
    stash beside one ministage's gradients. Under ZeRO-2/3 (`released`) the
    full buffer of k + 1 is there too while k's first backward runs, its
    reduce-scatter waited after that op (Note [gradient buffer release] in
    passes/lower/zero.py), and as k's own reduce-scatter is posted after its
    last op, the shard it writes sits beside k's full gradients once k's
    activations are gone: with few activations (full checkpointing, one
    ministage) that is the peak. Under the interleaved update k + 1 steps
    after k's first op, and the tied head's copy at the end, each beside
    the shard its reduction wrote (ZeRO-1 to 3). With activations offloaded
    only ministage k's recomputed microbatch is on the device beside the
    stashed inputs (`stashed_inputs`, `activation_memory`'s) as its backward
    runs; with every step at the end and without ZeRO-2/3 the largest of
    them with the most gradients is the estimate's sum already, and None is
    returned. Offloaded parameters (`offloaded_params`) come and go in the
    same order (`resident_window`; ZeRO-3 fetches the shard of one more
    ahead): the first backward, the stash's largest, holds the fewest.
    With the steps at the end a ministage's window runs from its backward
    to its step (Note [parameter residency] in passes/lower/offload.py), so
    the backward gathers them as the stash shrinks, all of them there for
    the steps (the estimate added them all to the whole stash: ZeRO-2 with
    parameters on the host and no checkpointing, 50.6 GiB estimated,
    41.3 GiB compiled). `to_end`: a ministage whose update waits for the end of the
    step (the head's copy of a tied embedding, Note [zero placement] in
    passes/lower/zero.py): its gradients and parameters stay from its
    backward on. Under ZeRO-3 (`gathers`) k's full parameters and those of
    the `prefetch` ministages it runs next (k − 1, ...) are gathered: the
    first backward holds two, ministage 0's only its own, where the
    heaviest window beside every gradient counted them twice (a 65B Zorse
    stage of two ministages, clipping off: 115.6 GiB estimated, 91.1 GiB
    compiled).
    """
    keeps = not interleaved_update(schedule, grad_clip)
    if schedule is not ScheduleKind.ZORSE or not per_microbatch or \
            (keeps and offload_activations and not released and offloaded_params is None):
        return None
    kept_share = grads_kept / sum(grads) if sum(grads) else 0.0
    best = BackwardPeak(0.0, 0.0)
    prefix = _prefix(offloaded_params.params if offloaded_params is not None else ())
    stashed, filled = _prefix(per_microbatch), _prefix(grads)   # running sums: a thousand ministages stay quick
    count = len(per_microbatch)
    for k in range(count):
        if keeps:
            # k + 1's full buffer (ZeRO-2/3) until k's second op, the shards of k + 1 .. K - 1 until the step
            pending = grads[k + 1] if released and k + 1 < count else 0.0
            held = kept_share * (filled[-1] - filled[k + 1])
        else:
            # k + 1 steps after k's first op, the tied head's copy at the end, each beside its reduction's shard
            pending = grads[k + 1] * (1.0 + reduced) if k + 1 < count and k + 1 != to_end else 0.0
            held = grads[to_end] * (1.0 + reduced) if to_end is not None and to_end > k else 0.0
        stash = per_microbatch[k] + stashed_inputs if offload_activations else microbatches * stashed[k + 1]
        resident = _resident_at(k, offloaded_params, prefix, to_end, microbatches, not keeps)
        gathered = sum(gathers.params[max(0, k - gathers.prefetch):k + 1]) if gathers is not None else None
        best = max(best, BackwardPeak(stash, grads[k] + pending + held, resident, gathered), key=_by_total)
        if released or not keeps:
            # k's reduction posted: its shard beside its full gradients, k's activations gone; k + 1's buffer
            # still there where its wait (the second gradient op after it) is still to come
            behind = pending if keeps and microbatches == 1 else 0.0
            left = stashed_inputs if offload_activations else microbatches * stashed[k]
            best = max(best, BackwardPeak(left, grads[k] * (1.0 + reduced) + behind + held, resident, gathered),
                       key=_by_total)
    if keeps and offloaded_params is not None:   # the steps at the end, every ministage back beside its gradients
        best = max(best, BackwardPeak(0.0, kept_share * filled[-1], sum(offloaded_params.params),
                                      None if gathers is None else 0.0), key=_by_total)
    return best


def _by_total(peak: BackwardPeak) -> float:
    return peak.total


def _resident_at(k: int, offloaded: ZorseParams | None, prefix: Sequence[float], to_end: int | None,
                 ops: int, steps: bool) -> float | None:
    """Offloaded parameters on the device during the backward of ministage k (`zorse_backward_peak`; `prefix`:
    `_prefix` of their sizes; `steps`: each ministage steps after its backward)."""
    if offloaded is None:
        return None
    count = len(offloaded.params)
    # ZeRO-3 brings the shard of one more ahead: the gather posted one run ahead needs it
    prefetch = offloaded.prefetch + offloaded.gathers
    # where the steps wait for the end, a ministage's window runs from its backward to its step
    window = resident_window(k, count, prefetch, offloaded.regathers, ops) if steps else range(max(0, k - prefetch),
                                                                                                count)
    kept = offloaded.params[to_end] if to_end is not None and to_end > k and to_end not in window else 0.0
    return _window_sum(prefix, window) + kept


def forwards_first(schedule: ScheduleKind, stage: int, num_stages: int, microbatches: int,
                   limit: int | None = None) -> bool:
    """Whether a rank of `stage` runs every forward of its `microbatches` before its first backward: under
    GPipe always, under 1F1B and ZB-H1 when they all fit in its warm-up (`in_flight`)."""
    if schedule is ScheduleKind.GPIPE:
        return True
    if schedule not in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB):
        return False
    return in_flight(schedule, stage, num_stages, microbatches, 1, limit) >= microbatches


def gpipe_backward_peak(offload_activations: bool, held: float, stash: float,
                        states: StateMemory) -> BackwardPeak | None:
    """(activations, gradients) on the device at the peak of a rank that runs every forward first (the
    caller asks `forwards_first`).

    Note [GPipe backward peak]: GPipe runs every forward before the first
    backward (so do 1F1B and ZB-H1 on a rank whose microbatches all fit in
    its warm-up), so the whole stash (`held`) is there as the first gradient op
    runs, beside the gradients that op holds (`states.first_backward`: all
    of them where they are not sharded, else the one buffer it fills); the
    runtime allocates them before the op and autograd frees the op's stash
    as it goes, and the verifier holds both while the op runs. By the next
    gradient op that microbatch's stash (`stash`) is gone and the gradients
    are at their most (`states.grads`: under ZeRO-2/3 the buffer filled,
    the one before it awaiting its reduce-scatter, and their shards). The
    peak is the larger of the two sums, not the most of each (random job 68
    under the GEMM curve: a last stage of 4 microbatches under ZeRO-2,
    explained +13.6 % of its compiled peak counting both at once). Counting
    no gradients at the first op, a hand plan of job 68's model whose last
    stage holds 12 blocks and the head on one A100-80 (unsharded gradients)
    was explained at 78.3 GiB and refused by compile at 80.3 GiB. A zero-bubble
    rank of four microbatches, all in its warm-up, under ZeRO-3 with fp32
    gradients (random job 65) was explained +13.5 % of its compiled peak
    counting its stash and gradients at once. With activations offloaded the
    device holds a few inputs, not the stash: None."""
    if offload_activations:
        return None
    return max(BackwardPeak(held, states.first_backward), BackwardPeak(max(held - stash, 0.0), states.grads),
               key=_by_total)


@dataclass(frozen=True)
class RankMemory:
    rank: int
    gpu: str
    device: str
    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    reserve: float
    capacity: float
    host: float   # offloaded to host memory
    # where the rank's peak comes after its last backward (ZeRO-1's reduced shard beside the full gradients,
    # no activations held): the most activations it holds in the step, which `activations` (0) does not show
    activations_in_step: float | None = None

    @property
    def total(self) -> float:
        return _total(self.params, self.grads, self.optimizer, self.activations, self.buffers, self.reserve)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def share(self) -> float:
        """The share of its device's memory the rank fills."""
        return self.total / self.capacity


def rank_memory(rank: int, gpu: Gpu, stage: int, states: StateMemory, activations: tuple[float, float],
                backward_peak: BackwardPeak | None = None) -> RankMemory:
    """The breakdown of one rank: `state_memory` and `activation_memory` on its device, or with
    `backward_peak` (`zorse_backward_peak`, `gpipe_backward_peak`) what is held at once."""
    params, grads, held, buffers, in_step = _at_peak(states, activations, backward_peak)
    context = context_reserve(gpu.device.memory, gpu.device.is_cpu)
    return RankMemory(rank, str(gpu), gpu.device.name, stage, params, grads, states.optimizer,
                      held, buffers, context, gpu.device.memory, states.host + activations[1], in_step)


def rank_headroom(gpu: Gpu, states: StateMemory, activations: tuple[float, float],
                  backward_peak: BackwardPeak | None = None) -> float:
    """`rank_memory(...)`'s capacity less its total, without building the breakdown (the planner asks
    this of thousands of stage options, for several microbatch counts each)."""
    params, grads, held, buffers, _ = _at_peak(states, activations, backward_peak)
    device = gpu.device
    return device.memory - _total(params, grads, states.optimizer, held, buffers,
                                  context_reserve(device.memory, device.is_cpu))


def _at_peak(states: StateMemory, activations: tuple[float, float],
             backward_peak: BackwardPeak | None) -> tuple[float, float, float, float, float | None]:
    """(parameters, gradients, activations, buffers) on the device at the rank's peak: in its backward, or after
    it where ZeRO-1's reduced shard outweighs the activations held in it; and in that case those activations
    (`RankMemory.activations_in_step`), else None."""
    buffers = states.buffers
    if backward_peak is None:
        params, grads, held = states.params, states.grads, activations[0]
    else:
        params = states.params if backward_peak.params is None else backward_peak.params
        grads, held = backward_peak.grads, backward_peak.activations
        if backward_peak.gathered is not None:
            buffers += backward_peak.gathered - states.gathered
    if states.after_backward > held:
        return states.params, grads + states.after_backward, 0.0, buffers, held
    return params, grads, held, buffers, None


def _total(params: float, grads: float, optimizer: float, activations: float, buffers: float,
           reserve: float) -> float:
    return params + grads + optimizer + activations + buffers + reserve
