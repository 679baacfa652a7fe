"""Each rank's device memory over its program, against the device's capacity.

Note [memory timeline]: walking a rank's instructions in order, with sizes
from the cost model (`CostModel.param_bytes`, `grad_bytes`,
`optimizer_bytes`, `activation_bytes`, `boundary_bytes`, `reserve_bytes`):

- static: each ministage's parameter shard and optimizer state, by the
  ZeRO level and group sizes of its `shard` line (none on the device with
  `param_offload` / `opt_offload`), and the rank's reserve;
- parameters of an offloaded ministage from its `prefetch` to the end of its
  `offload` (completed at its wait);
- at ZeRO-0 and 1, the full gradients from the ministage's first
  weight-gradient op to its `step`;
- at ZeRO-1 to 3, the reduced shard of each buffer (1/N of it) from the
  step's first reduce-scatter over its shard group to the `step`, each
  further reduction's output from its post to its wait (runtime/buffers.py,
  Note [reduced shard]); and the optimizer shard's gradients reduced across
  shard groups (`across = 1`) from that reduce-scatter to the `step`;
- under ZeRO-2 and 3, also the full gradient buffer (compute dtype) of a
  ministage, or of a ZeRO-3 unit, from each weight-gradient op (`bwd`,
  `bwd_w`: the runtime's `ready_grads`) to the wait of the reduce-scatter
  that follows it over the shard group (runtime/buffers.py `reduced`), per
  buffer: the dense and the expert parameters' apart;
- gathered full parameters (ZeRO-3) from the `all_gather` that takes the
  holder count from 0 to 1 to the `free` that takes it back to 0, per unit
  where the ministage is split into units (Note [units] in hetc/ir/program.py:
  the unit's parameters, `unit_param_bytes`);
- stashed activations from `fwd` to the backward that consumes them (`bwd`,
  or `bwd_w` under zero-bubble), unit by unit where ops run per unit
  (`unit_activation_bytes`); with `act_offload` only the boundary input
  is stashed, none while it is on the host, and the ministage's activations
  exist during its forward and its recomputing backward;
- receive buffers (each piece, by its shape) from the post to the compute op
  that consumes them.

Buffers are taken when work is posted and given back when it completes, so
the peak is what the rank needs whatever the overlap. `rank_levels` gives
the same walk instruction by instruction (the simulator turns it into the
timeline's memory curves).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hetc.ir.groups import split_direction
from hetc.passes.verify.errors import Finding, at
from hetc.ir.pipeline import Pipeline
from hetc.ir.program import (AllGather, Backward, BackwardInput, BackwardWeight, ComputeInstr, Forward, Free, Group, Instr,
                          Offload, Prefetch, Program, RankProgram, Recv, ReduceScatter, Shard, Step, Tensor, Unit,
                          Wait)

__all__ = ["Peak", "Sizes", "check_memory", "format_bytes", "group_sizes", "rank_levels", "rank_peak", "rank_peaks"]

# What holds memory, by kind: ("reserve",), ("params" | "optimizer" | "grads" | "gathered", ms),
# ("stash", ms, mb) or ("recv", what, ms, mb, seq)
_Key = tuple[object, ...]

PARTS = ("params", "grads", "optimizer", "gathered", "activations", "buffers", "reserve")


class Sizes(Protocol):
    """What the memory check needs from the cost model (`hetc.passes.cost.CostModel`)."""

    @property
    def delta(self) -> float: ...   # bytes per element of the training dtype (activations and their gradients)


    def param_bytes(self, ms: int, rank: int) -> float: ...
    def unit_param_bytes(self, unit: Unit, rank: int) -> float: ...
    def unit_grad_bytes(self, unit: Unit, rank: int) -> float: ...
    def unit_activation_bytes(self, unit: Unit, rank: int) -> float: ...
    def grad_bytes(self, ms: int, rank: int) -> float: ...
    def optimizer_bytes(self, ms: int, rank: int) -> float: ...
    def activation_bytes(self, ms: int, rank: int) -> float: ...
    def boundary_bytes(self, ms: int) -> float: ...
    def reserve_bytes(self, rank: int) -> float: ...
    def expert_fraction(self, ms: int, rank: int) -> float: ...


@dataclass(frozen=True)
class Peak:
    """A rank's highest memory use: where (instruction index), how much, of what; and its first overflow."""

    rank: int
    index: int
    total: float
    parts: dict[str, float]
    capacity: float
    first_over: int | None      # the first instruction at which the use exceeds the capacity


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True, slots=True)
class _Factors:
    params: float
    grads: float
    optimizer: float


def _factors(shard: Shard, group_size: dict[str, int]) -> _Factors:
    inner = group_size.get(shard.group, 1) if shard.group else 1
    everyone = inner * (group_size.get(shard.outer, 1) if shard.outer else 1)
    optimizer = (1 / everyone if shard.outer_level >= 1 else 1 / inner) if shard.level >= 1 else 1.0
    # grads: the full buffer a rank keeps through the step (ZeRO-2/3 keep only reduced shards, counted apart)
    return _Factors(1 / inner if shard.level >= 3 else 1.0, 1.0 if shard.level < 2 else 0.0, optimizer)


def _ministage_factors(shard: Shard, group_size: dict[str, int], sizes: Sizes, rank: int) -> _Factors:
    """`_factors` of the ministage's buffers, weighted by their sizes (expert parameters apart, if so)."""
    dense = _factors(shard, group_size)
    if shard.experts is None:
        return dense
    share, experts = sizes.expert_fraction(shard.ms, rank), _factors(shard.experts, group_size)
    return _Factors(*(d * (1 - share) + e * share for d, e in zip(dataclasses.astuple(dense),
                                                                   dataclasses.astuple(experts))))


@dataclass
class _Walk:
    """The running use of one rank, by part, with the live allocations that make it up."""

    rank: int
    capacity: float
    used: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    live: dict[_Key, tuple[str, float]] = field(default_factory=dict)   # key -> (part, bytes)
    gathers: dict[tuple[int, Unit | None], int] = field(default_factory=dict)  # (ms, unit) -> holders
    pending: dict[int, list[_Key]] = field(default_factory=dict)       # handle -> keys released on completion
    total: float = 0.0
    peak: Peak | None = None
    first_over: int | None = None
    levels: list[float] | None = None   # when recording: the use at each observation, in order

    def take(self, key: _Key, part: str, nbytes: float) -> None:
        if key not in self.live and nbytes > 0:
            self.live[key] = (part, nbytes)
            self.used[part] += nbytes
            self.total += nbytes

    def give(self, *keys: _Key) -> None:
        for key in keys:
            part, nbytes = self.live.pop(key, (None, 0.0))
            if part is not None:
                self.used[part] -= nbytes
                self.total -= nbytes

    def observe(self, index: int, transient: float = 0.0) -> None:
        total = self.total + transient
        if self.levels is not None:
            self.levels.append(total)
        if total > self.capacity and self.first_over is None:
            self.first_over = index
        if self.peak is None or total > self.peak.total:
            parts = dict(self.used, activations=self.used["activations"] + transient)
            self.peak = Peak(self.rank, index, total, parts, self.capacity, None)


class _Rank:
    def __init__(self, rp: RankProgram, pipeline: Pipeline, sizes: Sizes, group_size: dict[str, int]):
        self.rp, self.pipeline = rp, pipeline
        self.shards = {s.ms: s for s in rp.shards}
        self.walk = _Walk(rp.rank, pipeline.world[rp.rank].device.memory)
        self.split = any(isinstance(i, BackwardInput) for i in rp.instrs)
        self._sizes(sizes, group_size)
        self.walk.take(("reserve",), "reserve", sizes.reserve_bytes(rp.rank))
        for ms, shard in self.shards.items():
            if not shard.param_offload:
                self.walk.take(("params", ms), "params", self.shard_params[ms])
            if not shard.opt_offload:
                self.walk.take(("optimizer", ms), "optimizer", self.optimizer[ms])

    def _sizes(self, sizes: Sizes, group_size: dict[str, int]) -> None:
        """Every size this rank's instructions need, once per ministage of the model."""
        r, count = self.rp.rank, len(self.pipeline.ministages)
        none = _Factors(1.0, 1.0, 1.0)
        factors = [_ministage_factors(self.shards[ms], group_size, sizes, r) if ms in self.shards else none
                   for ms in range(count)]
        own = [ms for ms in range(count) if self.pipeline.ministages[ms].stage == self.rp.stage]
        self.full_params = {ms: sizes.param_bytes(ms, r) for ms in own}
        self.shard_params = {ms: self.full_params[ms] * factors[ms].params for ms in own}
        self.grads = {ms: sizes.grad_bytes(ms, r) * factors[ms].grads for ms in own}
        self.grads_full = {ms: sizes.grad_bytes(ms, r) for ms in own}
        self.optimizer = {ms: sizes.optimizer_bytes(ms, r) * factors[ms].optimizer for ms in own}
        self.activations = {ms: sizes.activation_bytes(ms, r) for ms in own}
        self.sharded = {ms: _sharded_parts(self.shards[ms], sizes.expert_fraction(ms, r)) for ms in own
                        if ms in self.shards}
        self.group_size = group_size
        self.shards_held: dict[int, list[_Key]] = {}     # ms -> its reduced shards, given back at its step
        # the boundary input of each own ministage, as this rank holds it (its share of the tokens)
        cp = self.pipeline.stages[self.rp.stage].cp
        self.stash_input = {ms: sizes.boundary_bytes(ms - 1) / cp if ms > 0 else 0.0 for ms in own}
        self.delta = sizes.delta
        self.sizes = sizes
        self.pieces: dict[tuple[Tensor, int, int], list[_Key]] = {}   # (what, ms, mb) -> live receive buffers
        self.act_offload = {ms for ms, shard in self.shards.items() if shard.act_offload}
        self.full_gather = {ms for ms, shard in self.shards.items() if shard.level == 3}
        self.outer = {ms: shard.outer for ms, shard in self.shards.items()}

    def _stash_bytes(self, ms: int) -> float:
        if ms not in self.act_offload:
            return self.activations.get(ms, 0.0)
        return self.stash_input.get(ms, 0.0)

    @staticmethod
    def _stash_key(instr: ComputeInstr) -> _Key:
        """A stash's key: one per ministage and microbatch, or per unit where ops run per unit."""
        base = ("stash", instr.ms, instr.mb)
        return base if instr.unit is None else (*base, instr.unit)

    def _unit_stash(self, instr: Forward) -> float:
        if instr.unit is None:
            return self._stash_bytes(instr.ms)
        return self.sizes.unit_activation_bytes(instr.unit, self.rp.rank)

    def run(self, i: int, instr: Instr) -> None:
        handler = _HANDLERS.get(type(instr))
        if handler is None:
            self.walk.observe(i)
        else:
            handler(self, i, instr)

    # ------------------------------------------------------------ handlers: take, observe, give back

    def _transient(self, ms: int) -> float:
        """Activations that exist only while the op runs: the full forward (or its recompute) with act_offload."""
        return self.activations.get(ms, 0.0) if ms in self.act_offload else 0.0

    def forward(self, i: int, instr: Forward) -> None:
        self.walk.take(self._stash_key(instr), "activations", self._unit_stash(instr))
        self.walk.observe(i, self._transient(instr.ms))
        self._consumed(Tensor.ACT, instr.ms - 1, instr.mb)

    def backward(self, i: int, instr: Backward | BackwardInput) -> None:
        weights = not isinstance(instr, BackwardInput) or not self.split
        if weights:
            self.walk.take(("grads", instr.ms), "grads", self.grads.get(instr.ms, 0.0))
            self._ready_grads(instr)
        self.walk.observe(i, self._transient(instr.ms))
        self._consumed(Tensor.GRAD, instr.ms + 1, instr.mb)
        if weights:
            self.walk.give(self._stash_key(instr))

    def backward_weight(self, i: int, instr: BackwardWeight) -> None:
        self.walk.take(("grads", instr.ms), "grads", self.grads.get(instr.ms, 0.0))
        self._ready_grads(instr)
        self.walk.observe(i)
        self.walk.give(self._stash_key(instr))

    def _ready_grads(self, instr: ComputeInstr) -> None:
        """A gradient op's full gradient buffers under ZeRO-2/3, until their reduce-scatters complete."""
        for group, (share, part) in self.sharded.get(instr.ms, {}).items():
            if part.level < 2:      # ZeRO-1 keeps its full gradients: counted as "grads"
                continue
            self.walk.take(("full grads", instr.ms, instr.unit, group), "grads",
                           self._buffer_grads(instr.ms, instr.unit) * share)

    def _buffer_grads(self, ms: int, unit: Unit | None) -> float:
        """The full gradients of a ministage's buffer, or of one of its ZeRO-3 units'."""
        return self.grads_full[ms] if unit is None else self.sizes.unit_grad_bytes(unit, self.rp.rank)

    def reduce_scatter(self, i: int, instr: ReduceScatter) -> None:
        group = split_direction(instr.group)[0]
        full_grads: _Key = ("full grads", instr.ms, instr.unit, group)
        released = [full_grads] if full_grads in self.walk.live else []
        released += self._reduced_shard(i, instr, group)
        self.walk.observe(i)
        if instr.handle is None:
            self.walk.give(*released)
        elif released:
            self.walk.pending[instr.handle] = released

    def _reduced_shard(self, i: int, instr: ReduceScatter, group: str) -> list[_Key]:
        """Take what a reduce-scatter's output holds until the step (Note [reduced shard] in
        runtime/buffers.py); the keys to give back when it completes (a further reduction's output)."""
        parts = self.sharded.get(instr.ms, {})
        if not parts:
            return []
        full = self._buffer_grads(instr.ms, instr.unit)
        if group in parts:                       # over the shard group: into `acc`
            shard = full * parts[group][0] / self.group_size.get(group, 1)
            key: _Key = ("reduced", instr.ms, instr.unit, group)
            if key not in self.walk.live:
                self._hold_shard(instr.ms, key, shard)
                return []
            out = ("reduced out", instr.ms, instr.unit, group, i)    # a further one's output, until added
            self.walk.take(out, "grads", shard)
            return [out]
        for share, part in parts.values():       # across shard groups: the optimizer's slice of `acc`
            if part.outer == group and part.outer_level == 1:
                inner = self.group_size.get(part.group or "", 1)
                self._hold_shard(instr.ms, ("reduced", instr.ms, instr.unit, group),
                                 full * share / (inner * self.group_size.get(group, 1)))
        return []

    def _hold_shard(self, ms: int, key: _Key, nbytes: float) -> None:
        self.walk.take(key, "grads", nbytes)
        self.shards_held.setdefault(ms, []).append(key)

    def recv(self, i: int, instr: Recv) -> None:
        key = ("recv", instr.what, instr.ms, instr.mb, instr.seq)
        self.walk.take(key, "buffers", math.prod(instr.shape) * self.delta)
        self.pieces.setdefault((instr.what, instr.ms, instr.mb), []).append(key)
        self.walk.observe(i)

    def _consumed(self, what: Tensor, ms: int, mb: int) -> None:
        self.walk.give(*self.pieces.pop((what, ms, mb), []))

    def all_gather(self, i: int, instr: AllGather) -> None:
        w = self.walk
        if instr.ms in self.full_gather and instr.group != self.outer[instr.ms]:
            key = (instr.ms, instr.unit)
            w.gathers[key] = w.gathers.get(key, 0) + 1
            full = self.full_params.get(instr.ms, 0.0) if instr.unit is None else \
                self.sizes.unit_param_bytes(instr.unit, self.rp.rank)
            w.take(("gathered", *key), "gathered", full)
        w.observe(i)

    def free(self, i: int, instr: Free) -> None:
        w = self.walk
        w.observe(i)
        key = (instr.ms, instr.unit)
        if w.gathers.get(key, 0) > 0:
            w.gathers[key] -= 1
            if w.gathers[key] == 0:
                w.give(("gathered", *key))

    def prefetch(self, i: int, instr: Prefetch) -> None:
        if instr.what is Tensor.PARAMS:
            self.walk.take(("params", instr.ms), "params", self.shard_params.get(instr.ms, 0.0))
        else:
            self.walk.take(("stash", instr.ms, instr.mb), "activations", self._stash_bytes(instr.ms))
        self.walk.observe(i)

    def offload(self, i: int, instr: Offload) -> None:
        key = ("params", instr.ms) if instr.what is Tensor.PARAMS else ("stash", instr.ms, instr.mb)
        if instr.handle is None:
            self.walk.give(key)
        else:
            self.walk.pending[instr.handle] = [key]
        self.walk.observe(i)

    def wait(self, i: int, instr: Wait) -> None:
        self.walk.observe(i)
        self.walk.give(*self.walk.pending.pop(instr.handle, []))

    def step(self, i: int, instr: Step) -> None:
        self.walk.observe(i)
        self.walk.give(("grads", instr.ms), *self.shards_held.pop(instr.ms, []))


# one handler per instruction class, each taking its own class (so the table's value type is loose)
_HANDLERS: dict[type[Instr], Callable[..., None]] = {
    Forward: _Rank.forward, Backward: _Rank.backward, BackwardInput: _Rank.backward,
    BackwardWeight: _Rank.backward_weight, Recv: _Rank.recv, AllGather: _Rank.all_gather, Free: _Rank.free,
    Prefetch: _Rank.prefetch, Offload: _Rank.offload, Wait: _Rank.wait, Step: _Rank.step,
    ReduceScatter: _Rank.reduce_scatter,
}


def _sharded_parts(shard: Shard, expert_fraction: float) -> dict[str, tuple[float, Shard]]:
    """The ministage's buffers sharded at ZeRO-1 to 3 over a group: shard group -> (its share of the
    ministage's gradients, its shard line)."""
    parts = [(shard, 1.0 - expert_fraction if shard.experts is not None else 1.0)]
    if shard.experts is not None:
        parts.append((shard.experts, expert_fraction))
    return {part.group: (share, part) for part, share in parts
            if part.group is not None and part.level >= 1 and share > 0}


def _walk(rp: RankProgram, pipeline: Pipeline, sizes: Sizes, group_size: dict[str, int], record: bool) -> _Walk:
    """One rank's walk; with `record`, its `levels` hold the use while each instruction runs."""
    rank = _Rank(rp, pipeline, sizes, group_size)
    rank.walk.observe(0)                  # the static use alone, before the first instruction
    if record:
        rank.walk.levels = []
    for i, instr in enumerate(rp.instrs):
        rank.run(i, instr)                # every handler observes exactly once
    return rank.walk


def group_sizes(groups: tuple[Group, ...]) -> dict[str, int]:
    """Each group's number of members, by name (what a rank's shards are sharded over)."""
    return {g.name: len(g.ranks) for g in groups}


def rank_peaks(program: Program, pipeline: Pipeline, sizes: Sizes) -> list[Peak]:
    """Every rank's memory peak (Note [memory timeline])."""
    group_size = group_sizes(program.groups)
    return [rank_peak(rp, pipeline, sizes, group_size) for rp in program.ranks]


def rank_peak(rp: RankProgram, pipeline: Pipeline, sizes: Sizes, group_size: dict[str, int]) -> Peak:
    """One rank's memory peak, which reads no other rank's program (`group_size`: `group_sizes`)."""
    walk = _walk(rp, pipeline, sizes, group_size, record=False)
    peak = walk.peak
    assert peak is not None   # observe(0) set it
    return Peak(peak.rank, peak.index, peak.total, peak.parts, peak.capacity, walk.first_over)


def rank_levels(program: Program, pipeline: Pipeline, sizes: Sizes) -> list[list[float]]:
    """Per rank, in program order: the bytes in use while each instruction runs, then after the last one.

    Entry i is what the memory check compares with the capacity at instruction
    i (its buffers taken, none yet given back); the final entry is the use once
    the program has ended. Their maximum is the rank's `Peak.total`.
    """
    group_size = group_sizes(program.groups)
    levels = []
    for rp in program.ranks:
        walk = _walk(rp, pipeline, sizes, group_size, record=True)
        assert walk.levels is not None   # recorded
        if len(walk.levels) != len(rp.instrs):
            raise AssertionError(f"rank {rp.rank}: {len(walk.levels)} observations of {len(rp.instrs)} instructions")
        levels.append([*walk.levels, walk.total])
    return levels


def check_memory(program: Program, pipeline: Pipeline, sizes: Sizes) -> list[Finding]:
    """A finding for every rank whose memory exceeds its device, at the first instruction where it does."""
    findings = []
    for peak in rank_peaks(program, pipeline, sizes):
        if peak.first_over is None:
            continue
        device = pipeline.world[peak.rank].device.name
        parts = ", ".join(f"{name} {format_bytes(peak.parts[name])}" for name in PARTS if peak.parts[name] > 0)
        findings.append(at(program, peak.rank, peak.first_over,
                           f"out of device memory: the rank needs {format_bytes(peak.total)} at its peak "
                           f"(instruction {peak.index}: {parts}) but its {device} holds "
                           f"{format_bytes(peak.capacity)}"))
    return findings
