"""Each rank's device memory over its program, against the device's capacity.

Note [memory timeline]: walking a rank's instructions in order, with sizes
from the cost model (`CostModel.param_bytes`, `grad_bytes`,
`optimizer_bytes`, `activation_bytes`, `boundary_bytes`, `reserve_bytes`):

- static: each ministage's parameter shard and optimizer state, by the
  ZeRO level and group sizes of its `shard` line (none on the device with
  `param_offload` / `opt_offload`), and the rank's reserve;
- parameters of an offloaded ministage from its `prefetch` to the end of its
  `offload` (completed at its wait);
- gradients from the ministage's first weight-gradient op to its `step`;
- gathered full parameters (ZeRO-3) from the `all_gather` that takes the
  holder count from 0 to 1 to the `free` that takes it back to 0;
- stashed activations from `fwd` to the backward that consumes them (`bwd`,
  or `bwd_w` under zero-bubble); with `act_offload` only the boundary input
  is stashed, none while it is on the host, and the ministage's activations
  exist during its forward and its recomputing backward;
- receive buffers from the post to the compute op that consumes them.

Buffers are taken when work is posted and given back when it completes, so
the peak is what the rank needs whatever the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hetc.pipeline import Pipeline
from hetc.program import (AllGather, Backward, BackwardInput, BackwardWeight, Forward, Free, Instr, Offload,
                          Prefetch, Program, RankProgram, Recv, Shard, Step, Tensor, Wait)
from hetc.passes.verify.errors import Finding, at

__all__ = ["Sizes", "Peak", "rank_peaks", "check_memory", "format_bytes"]

PARTS = ("params", "grads", "optimizer", "gathered", "activations", "buffers", "reserve")


class Sizes(Protocol):
    """What the memory check needs from the cost model (`hetc.passes.cost.CostModel`)."""

    def param_bytes(self, ms: int, rank: int) -> float: ...
    def grad_bytes(self, ms: int, rank: int) -> float: ...
    def optimizer_bytes(self, ms: int, rank: int) -> float: ...
    def activation_bytes(self, ms: int, rank: int) -> float: ...
    def boundary_bytes(self, ms: int) -> float: ...
    def reserve_bytes(self, rank: int) -> float: ...


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
    return _Factors(1 / inner if shard.level >= 3 else 1.0, 1 / inner if shard.level >= 2 else 1.0, optimizer)


@dataclass
class _Walk:
    """The running use of one rank, by part, with the live allocations that make it up."""

    rank: int
    capacity: float
    used: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    live: dict[tuple, tuple[str, float]] = field(default_factory=dict)   # key -> (part, bytes)
    gathers: dict[int, int] = field(default_factory=dict)               # ms -> holders of its full params
    pending: dict[int, tuple] = field(default_factory=dict)             # handle -> key released on completion
    peak: Peak | None = None
    first_over: int | None = None

    def take(self, key: tuple, part: str, nbytes: float) -> None:
        if key not in self.live and nbytes > 0:
            self.live[key] = (part, nbytes)
            self.used[part] += nbytes

    def give(self, key: tuple) -> None:
        part, nbytes = self.live.pop(key, (None, 0.0))
        if part is not None:
            self.used[part] -= nbytes

    def observe(self, index: int, transient: float = 0.0) -> None:
        total = sum(self.used.values()) + transient
        if total > self.capacity and self.first_over is None:
            self.first_over = index
        if self.peak is None or total > self.peak.total:
            parts = dict(self.used, activations=self.used["activations"] + transient)
            self.peak = Peak(self.rank, index, total, parts, self.capacity, None)


class _Rank:
    def __init__(self, rp: RankProgram, pipeline: Pipeline, sizes: Sizes, group_size: dict[str, int]):
        self.rp, self.pipeline, self.sizes = rp, pipeline, sizes
        self.shards = {s.ms: s for s in rp.shards}
        self.factors = {ms: _factors(s, group_size) for ms, s in self.shards.items()}
        self.walk = _Walk(rp.rank, pipeline.world[rp.rank].device.memory)
        self.split = any(isinstance(i, BackwardInput) for i in rp.instrs)
        r = rp.rank
        self.walk.take(("reserve",), "reserve", sizes.reserve_bytes(r))
        for ms, shard in self.shards.items():
            f = self.factors[ms]
            if not shard.param_offload:
                self.walk.take(("params", ms), "params", sizes.param_bytes(ms, r) * f.params)
            if not shard.opt_offload:
                self.walk.take(("optimizer", ms), "optimizer", sizes.optimizer_bytes(ms, r) * f.optimizer)

    def _shard(self, ms: int) -> Shard:
        return self.shards.get(ms) or Shard(ms, 0)

    def _stash_bytes(self, ms: int) -> float:
        if not self._shard(ms).act_offload:
            return self.sizes.activation_bytes(ms, self.rp.rank)
        return self._boundary(ms - 1) if ms > 0 else 0.0

    def _boundary(self, ms: int) -> float:
        """Bytes of the activation leaving ministage ms (or its gradient), per rank of the producing stage."""
        return self.sizes.boundary_bytes(ms) / self.pipeline.stages[self.pipeline.ministages[ms].stage].cp

    # ------------------------------------------------------------ instructions

    def run(self, i: int, instr: Instr) -> None:
        w, r = self.walk, self.rp.rank
        transient = 0.0
        if isinstance(instr, (Forward, Backward, BackwardInput)) and self._shard(instr.ms).act_offload:
            transient = self.sizes.activation_bytes(instr.ms, r)     # computed (or recomputed) in full
        if isinstance(instr, (Backward, BackwardWeight)) or (isinstance(instr, BackwardInput) and not self.split):
            w.take(("grads", instr.ms), "grads", self.sizes.grad_bytes(instr.ms, r) * self.factors_of(instr.ms).grads)
        if isinstance(instr, Forward):
            w.take(("stash", instr.ms, instr.mb), "activations", self._stash_bytes(instr.ms))
        self._post(instr)
        w.observe(i, transient)
        self._after(instr)

    def factors_of(self, ms: int) -> _Factors:
        return self.factors.get(ms) or _Factors(1.0, 1.0, 1.0)

    def _post(self, instr: Instr) -> None:
        w, r = self.walk, self.rp.rank
        if isinstance(instr, Recv):
            producer = instr.ms
            w.take(("recv", instr.what, instr.ms, instr.mb), "buffers",
                   self._boundary(producer if instr.what is Tensor.ACT else producer - 1))
        elif isinstance(instr, AllGather) and self._gathers_full(instr):
            w.gathers[instr.ms] = w.gathers.get(instr.ms, 0) + 1
            w.take(("gathered", instr.ms), "gathered", self.sizes.param_bytes(instr.ms, r))
        elif isinstance(instr, Prefetch):
            if instr.what is Tensor.PARAMS:
                w.take(("params", instr.ms), "params",
                       self.sizes.param_bytes(instr.ms, r) * self.factors_of(instr.ms).params)
            else:
                w.take(("stash", instr.ms, instr.mb), "activations", self._stash_bytes(instr.ms))
        elif isinstance(instr, Offload):
            key = ("params", instr.ms) if instr.what is Tensor.PARAMS else ("stash", instr.ms, instr.mb)
            if instr.handle is None:
                w.give(key)
            else:
                w.pending[instr.handle] = key

    def _gathers_full(self, instr: AllGather) -> bool:
        shard = self._shard(instr.ms)
        return shard.level == 3 and instr.group != shard.outer

    def _after(self, instr: Instr) -> None:
        w = self.walk
        if isinstance(instr, Wait) and instr.handle in w.pending:
            w.give(w.pending.pop(instr.handle))
        elif isinstance(instr, Free) and w.gathers.get(instr.ms, 0) > 0:
            w.gathers[instr.ms] -= 1
            if w.gathers[instr.ms] == 0:
                w.give(("gathered", instr.ms))
        elif isinstance(instr, Forward):
            w.give(("recv", Tensor.ACT, instr.ms - 1, instr.mb))
        elif isinstance(instr, (Backward, BackwardInput)):
            w.give(("recv", Tensor.GRAD, instr.ms + 1, instr.mb))
            if isinstance(instr, Backward) or not self.split:
                w.give(("stash", instr.ms, instr.mb))
        elif isinstance(instr, BackwardWeight):
            w.give(("stash", instr.ms, instr.mb))
        elif isinstance(instr, Step):
            w.give(("grads", instr.ms))


def rank_peaks(program: Program, pipeline: Pipeline, sizes: Sizes) -> list[Peak]:
    """Every rank's memory peak (Note [memory timeline])."""
    group_size = {g.name: len(g.ranks) for g in program.groups}
    peaks = []
    for rp in program.ranks:
        rank = _Rank(rp, pipeline, sizes, group_size)
        rank.walk.observe(0)
        for i, instr in enumerate(rp.instrs):
            rank.run(i, instr)
        peak = rank.walk.peak
        peaks.append(Peak(peak.rank, peak.index, peak.total, peak.parts, peak.capacity, rank.walk.first_over))
    return peaks


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
