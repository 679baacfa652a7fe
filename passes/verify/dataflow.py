"""Per-rank checks of what each instruction needs and what the step must do.

Each rank's program is walked in order (its own order is all that matters
here; the joint simulation is `protocol`). An instruction may only use what
earlier instructions made available *and waited for*: a forward its input
activation, a backward its output gradient and its stash, a ZeRO-3 compute
its gathered parameters, an offloaded ministage its parameters back on the
device; an optimizer step needs every gradient contribution to its shard
reduced (and the global norm, when clipping). At the end every microbatch
of the rank's lane has passed each of its ministages forward and backward
exactly once, every ministage has stepped once, and nothing is left gathered
or on the device that the next step expects on the host.

Boundary tensors may arrive in pieces (`seq=a:b`, hetc/ir/layout.py): a piece
must lie inside what its sender holds and what this rank holds, and before
a forward or backward uses a tensor its pieces must tile exactly the tokens
this rank holds; a whole-tensor receive must come from a rank holding the
same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hetc.ir.groups import split_direction
from hetc.ir.layout import Range, arrival_ranges, boundary_ranges, describe, local_slice, tiling_problem
from hetc.passes.verify.errors import Finding, at
from hetc.ir.pipeline import Pipeline
from hetc.ir.program import (AllGather, AllReduce, AllToAll, Backward, BackwardInput, BackwardWeight, ComputeInstr, Forward,
                          Free, Instr, Load, Offload, Prefetch, Program, RankProgram, Recv, ReduceScatter,
                          Send, Shard, Step, Tensor, Unit, Wait)

__all__ = ["check_dataflow", "rank_dataflow"]

_Key = tuple[int, int]                  # (ms, mb)
_Message = tuple[Tensor, int, int]      # (tensor, ms, mb) of a boundary tensor
_Moving = tuple[str, int] | tuple[str, int, int]    # ("params", ms) / ("act", ms, mb)
_Owned = Forward | Backward | BackwardInput | BackwardWeight | Step | Offload | Prefetch
_Learning = Backward | BackwardInput | BackwardWeight | Step
_Collective = AllGather | ReduceScatter | AllReduce | AllToAll
_Posted = Send | Recv | _Collective | Offload | Prefetch    # what may carry a handle


class _Fault(Exception):
    """What is wrong with the instruction a handler checks."""


@dataclass
class _State:
    loaded: set[int] = field(default_factory=set)
    fwd: set[_Key] = field(default_factory=set)           # (ms, mb) forwarded here
    bwd: set[_Key] = field(default_factory=set)           # (ms, mb) input-gradient done here (bwd or bwd_i)
    wgrad: set[_Key] = field(default_factory=set)         # (ms, mb) weight-gradient done here (bwd or bwd_w)
    arrived: dict[_Message, list[Range]] = field(default_factory=dict)   # token ranges received and waited
    pending: dict[int, _Posted] = field(default_factory=dict)     # handle -> instruction
    # (tensor, ms, mb) -> its posted receives not yet waited: an index of `pending`, so that checking a
    # receive against the ones in flight does not scan every posted op (64 ranks: 10^8 comparisons)
    receiving: dict[_Message, list[Recv]] = field(default_factory=dict)
    gathered: dict[tuple[int, Unit | None], int] = field(default_factory=dict)   # completed gathers not yet freed
    # (op kind, ms, mb, unit) a unit's op ran; ("F" | "B", ms, mb, layer): a unit's output is here
    reached: set[tuple[str, int, int, Unit | int | None]] = field(default_factory=set)
    on_host: set[int] = field(default_factory=set)       # offloaded ministages' parameters now on the host
    changed: set[int] = field(default_factory=set)       # ... stepped on the device since they came from it
    moving: set[_Moving] = field(default_factory=set)    # ("params", ms) / ("act", ms, mb) in flight
    act_host: set[_Key] = field(default_factory=set)     # (ms, mb) stashes on the host
    # (ms, unit) -> completed reductions after its last backward
    reduced: dict[tuple[int | None, Unit | None], list[str]] = field(default_factory=dict)
    stepped: set[int] = field(default_factory=set)
    norm_done: bool = False


class _Rank:
    def __init__(self, rp: RankProgram, pipeline: Pipeline, num_layers: int, clip: bool, seq: int | None,
                 forward_only: bool = False):
        self.rp = rp
        self.forward_only = forward_only
        self.pipeline = pipeline
        self.num_layers = num_layers
        self.clip = clip
        self.seq = seq
        stage = pipeline.stages[rp.stage]
        lane = stage.lanes[rp.lane]
        self.held = self._held_by(rp.rank)
        self.arrives = self._arrives_at(rp.rank)     # what it receives: `held`, or its tp part of it
        self.own = set(stage.ministages)
        self.mbs = set(lane.microbatches)
        self.shards: dict[int, Shard] = {s.ms: s for s in rp.shards}
        self.s = _State(on_host={s.ms for s in rp.shards if s.param_offload})

    def _held_by(self, rank: int) -> tuple[Range, ...] | None:
        """The tokens `rank` holds at its borders (None: not checked, no sequence length given)."""
        if self.seq is None:
            return None
        lane = self.pipeline.lane_of_rank[rank]
        return boundary_ranges(self.pipeline.stage_of_rank[rank], lane.ranks.index(rank), self.seq)

    def _arrives_at(self, rank: int) -> tuple[Range, ...] | None:
        """The tokens `rank` receives of a boundary tensor (Note [scatter-gather borders] in
        hetc/ir/layout.py); None where not checked."""
        if self.seq is None:
            return None
        lane = self.pipeline.lane_of_rank[rank]
        return arrival_ranges(self.pipeline.stage_of_rank[rank], lane.ranks.index(rank), self.seq)

    def _arrived(self, what: Tensor, ms: int, mb: int) -> bool:
        """Whether the boundary tensor (what, ms, mb) is here: its received pieces tile this rank's tokens."""
        pieces = self.s.arrived.get((what, ms, mb))
        if not pieces:
            return False
        if self.arrives is not None:
            problem = tiling_problem(pieces, self.arrives)
            if problem:
                raise _Fault(f"the received pieces of {what.value} ms={ms} mb={mb} do not tile this rank's "
                             f"tokens: {problem}")
        return True

    def starts(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].first_layer == 0

    def ends(self, ms: int) -> bool:
        return self.pipeline.ministages[ms].stop_layer == self.num_layers

    # ------------------------------------------------------------ instructions

    def _owned(self, instr: _Owned) -> None:
        if instr.ms not in self.own:
            raise _Fault(f"ministage {instr.ms} does not belong to this rank's stage")
        if hasattr(instr, "mb") and instr.mb is not None and instr.mb not in self.mbs:
            raise _Fault(f"microbatch {instr.mb} is not routed to this rank's lane")

    def _params_ready(self, ms: int, unit: Unit | None) -> None:
        shard = self.shards.get(ms)
        if shard is None:
            return
        if shard.level == 3 and shard.group is not None and self.s.gathered.get((ms, unit), 0) <= 0:
            what = f"unit {unit} of ministage {ms} are" if unit else f"ministage {ms} are"
            raise _Fault(f"the parameters of {what} sharded (ZeRO-3) and not gathered here")
        if shard.level != 3 or shard.group is None:
            self._on_device(ms)

    def _on_device(self, ms: int) -> None:
        if ms in self.s.on_host or ("params", ms) in self.s.moving:
            raise _Fault(f"the parameters of ministage {ms} are not on the device (prefetch and wait first)")

    def load(self, i: int, instr: Load) -> None:
        if instr.mb not in self.mbs:
            raise _Fault(f"microbatch {instr.mb} is not routed to this rank's lane")
        if instr.mb in self.s.loaded:
            raise _Fault(f"microbatch {instr.mb} is loaded twice")
        self.s.loaded.add(instr.mb)

    def _span(self, instr: ComputeInstr) -> tuple[int, int]:
        """The layers [first, stop) an op runs: its unit's, or its ministage's (Note [units])."""
        m = self.pipeline.ministages[instr.ms]
        unit = instr.unit
        if unit is None:
            return m.first_layer, m.stop_layer
        if unit not in self.shards[instr.ms].units:
            raise _Fault(f"unit {unit} is not one of ministage {instr.ms}'s units")
        return unit.first, unit.stop

    def _unit_once(self, instr: ComputeInstr) -> None:
        key = (type(instr).__name__, instr.ms, instr.mb, instr.unit)
        if instr.unit is not None and key in self.s.reached:
            raise _Fault(f"microbatch {instr.mb} passes unit {instr.unit} of ministage {instr.ms} twice")
        self.s.reached.add(key)

    def forward(self, i: int, instr: Forward) -> None:
        self._owned(instr)
        key = (instr.ms, instr.mb)
        first, stop = self._span(instr)
        m = self.pipeline.ministages[instr.ms]
        if key in self.s.fwd:
            raise _Fault(f"microbatch {instr.mb} passes ministage {instr.ms} forward twice")
        self._unit_once(instr)
        if (first == 0 or stop == self.num_layers) and instr.mb not in self.s.loaded:
            raise _Fault(f"microbatch {instr.mb}'s data is used before it is loaded")
        if first != m.first_layer and ("F", instr.ms, instr.mb, first) not in self.s.reached:
            raise _Fault(f"unit {instr.unit} of ministage {instr.ms} runs before the unit ending at layer {first}")
        if first == m.first_layer and not self.starts(instr.ms) and (instr.ms - 1, instr.mb) not in self.s.fwd \
                and not self._arrived(Tensor.ACT, instr.ms - 1, instr.mb):
            raise _Fault(f"the input activation (act ms={instr.ms - 1} mb={instr.mb}) has not arrived: "
                         "no completed receive or local forward provides it")
        self._params_ready(instr.ms, instr.unit)
        self.s.reached.add(("F", instr.ms, instr.mb, stop))
        if stop == m.stop_layer:
            self.s.fwd.add(key)

    def backward(self, i: int, instr: Backward | BackwardInput | BackwardWeight) -> None:
        self._learning(instr)
        self._owned(instr)
        key = (instr.ms, instr.mb)
        first, stop = self._span(instr)
        m = self.pipeline.ministages[instr.ms]
        if isinstance(instr, BackwardWeight):
            if key not in self.s.bwd:
                raise _Fault("the weight gradient comes before its input gradient (bwd_i)")
        else:
            if key not in self.s.fwd:
                raise _Fault(f"backward of microbatch {instr.mb} before its forward on ministage {instr.ms}")
            if key in self.s.bwd:
                raise _Fault(f"microbatch {instr.mb} passes ministage {instr.ms} backward twice")
            self._unit_once(instr)
            nxt = (instr.ms + 1, instr.mb)
            if stop != m.stop_layer and ("B", instr.ms, instr.mb, stop) not in self.s.reached:
                raise _Fault(f"unit {instr.unit} of ministage {instr.ms} runs backward before the unit starting "
                             f"at layer {stop}")
            if stop == m.stop_layer and not self.ends(instr.ms) and nxt not in self.s.bwd and \
                    not self._arrived(Tensor.GRAD, *nxt):
                raise _Fault(f"the output gradient (grad ms={nxt[0]} mb={nxt[1]}) has not arrived")
            if key in self.s.act_host or ("act", *key) in self.s.moving:
                raise _Fault(f"the stashed input of ministage {instr.ms} for microbatch {instr.mb} is on the host")
        if key in self.s.wgrad and not isinstance(instr, BackwardInput):
            raise _Fault(f"microbatch {instr.mb}'s weight gradient of ministage {instr.ms} is computed twice")
        self._params_ready(instr.ms, instr.unit)
        self.s.reached.add(("B", instr.ms, instr.mb, first))
        done = first == m.first_layer
        if not isinstance(instr, BackwardWeight) and done:
            self.s.bwd.add(key)
        if not isinstance(instr, BackwardInput):
            self.s.reduced.pop((instr.ms, instr.unit), None)   # reductions must follow the last backward
            if done:
                self.s.wgrad.add(key)

    def send(self, i: int, instr: Send) -> None:
        key = (instr.ms, instr.mb)
        done = self.s.fwd if instr.what is Tensor.ACT else self.s.bwd
        if key not in done:
            phase = "forward" if instr.what is Tensor.ACT else "backward"
            raise _Fault(f"sends the {phase} output of ministage {instr.ms} for microbatch {instr.mb} "
                         "before computing it")
        if instr.seq is not None and self.held is not None:
            self._inside(instr.seq, self.held, "this rank holds")
        self._post(i, instr)

    def recv(self, i: int, instr: Recv) -> None:
        key = _message(instr)
        pending = self.s.receiving.get(key, [])
        if instr.seq is None and (key in self.s.arrived or pending) or \
                instr.seq in self.s.arrived.get(key, []) or any(p.seq == instr.seq for p in pending):
            raise _Fault(f"receives {instr.what.value} ms={instr.ms} mb={instr.mb}"
                         f"{'' if instr.seq is None else f' seq={describe([instr.seq])}'} twice")
        if self.arrives is not None:
            self._check_piece(instr)
        self._post(i, instr)

    def _check_piece(self, instr: Recv) -> None:
        sender = self._held_by(instr.peer_from)
        assert sender is not None and self.arrives is not None   # both known once `seq` is
        if instr.seq is None:
            if sender != self.arrives:
                raise _Fault(f"receives rank {instr.peer_from}'s whole {instr.what.value}, tokens "
                             f"{describe(sender)}, but this rank receives {describe(self.arrives)}: the layouts "
                             "differ, so the tensor must come in pieces (seq=a:b)")
            return
        self._inside(instr.seq, self.arrives, "this rank receives")
        self._inside(instr.seq, sender, f"rank {instr.peer_from} holds")

    @staticmethod
    def _inside(piece: Range, held: tuple[Range, ...], whose: str) -> None:
        try:
            local_slice(held, piece)
        except ValueError:
            raise _Fault(f"tokens {describe([piece])} are not inside one range of the tokens {whose} "
                         f"({describe(held)})") from None

    def collective(self, i: int, instr: _Collective) -> None:
        if isinstance(instr, (AllGather, ReduceScatter, AllReduce)) and instr.what in (Tensor.GRADS, Tensor.PARAMS):
            self._unit_of_buffer(instr)
        if isinstance(instr, AllReduce) and instr.what is Tensor.TIED:
            self._tied_ready(instr)
        if isinstance(instr, AllGather):
            shard = self.shards.get(instr.ms)
            if shard is None:
                raise _Fault(f"ministage {instr.ms} does not belong to this rank's stage")
            if shard.param_offload and (instr.ms in self.s.on_host or ("params", instr.ms) in self.s.moving):
                raise _Fault(f"gathers ministage {instr.ms} while its shard is on the host")
        self._post(i, instr)

    def _reduced(self, ms: int, doing: str) -> None:
        """Every flat buffer of ministage `ms` is reduced over its groups, inner then outer, since its last
        backward: what its step and its tied sum read."""
        shard = self.shards[ms]
        for part in filter(None, (shard, shard.experts)):    # each flat buffer: inner group, then outer
            need = self._reductions_needed(part)
            for unit in part.units or (None,):
                have = [g for g in self.s.reduced.get((ms, unit), []) if shard.part(g) == part]
                if have[:len(need)] != need[:len(have)] or len(have) < len(need):
                    raise _Fault(f"{doing} ministage {ms} before its gradients{_of_unit(unit)} are reduced "
                                 f"over {', '.join(need[len(have):] or need)}")

    def _tied_ready(self, instr: AllReduce) -> None:
        """`all_reduce tied` sums the reduced gradient of the tied copy its ministage holds (Note [tied
        gradients] in hetc/ir/program.py): after every backward of it and its reductions."""
        if instr.ms is None or instr.ms not in self.shards:
            raise _Fault(f"sums a tied embedding's gradient of ministage {instr.ms}, which is not on this rank")
        if missing := [mb for mb in sorted(self.mbs) if (instr.ms, mb) not in self.s.wgrad]:
            raise _Fault(f"sums ministage {instr.ms}'s tied gradient before microbatches {missing} are through")
        self._reduced(instr.ms, "sums the tied gradient of")

    def free(self, i: int, instr: Free) -> None:
        key = (instr.ms, instr.unit)
        if self.s.gathered.get(key, 0) <= 0:
            raise _Fault(f"frees the parameters of ministage {instr.ms}{_of_unit(instr.unit)}, which are not "
                         "gathered")
        self.s.gathered[key] -= 1

    def _unit_of_buffer(self, instr: AllGather | ReduceScatter | AllReduce) -> None:
        """A collective on a ministage split into units names one of them (Note [units]); else none."""
        shard = self.shards.get(instr.ms) if instr.ms is not None else None
        if shard is None:
            raise _Fault(f"ministage {instr.ms} does not belong to this rank's stage")
        units = shard.part(instr.group).units
        if units and instr.unit not in units:
            raise _Fault(f"ministage {instr.ms}'s buffers are its units {', '.join(map(str, units))}: a collective "
                         "on it names one of them")
        if not units and instr.unit is not None:
            raise _Fault(f"ministage {instr.ms} is not split into units, but the collective names unit {instr.unit}")

    def copy(self, i: int, instr: Offload | Prefetch) -> None:
        if instr.what is Tensor.PARAMS:
            self._owned(instr)
            if ("params", instr.ms) in self.s.moving:
                raise _Fault(f"the parameters of ministage {instr.ms} are already being copied")
            to_host = isinstance(instr, Offload)
            if to_host == (instr.ms in self.s.on_host):
                raise _Fault(f"the parameters of ministage {instr.ms} are already on the "
                             f"{'host' if to_host else 'device'}")
            if isinstance(instr, Offload) and instr.host_current and instr.ms in self.s.changed:
                raise _Fault(f"releases the parameters of ministage {instr.ms} without copying them to the host, "
                             "but its step changed them on the device")
            self.s.moving.add(("params", instr.ms))
        elif isinstance(instr, Offload) and instr.host_current:
            raise _Fault("offloads a stash as host_current: a stash has no host copy until its offload makes one")
        else:
            key = (instr.ms, instr.mb)
            if key not in self.s.fwd or key in self.s.bwd:
                raise _Fault(f"moves the stash of ministage {instr.ms} for microbatch {instr.mb}, which is not live")
            self.s.moving.add(("act", *key))
        self._post(i, instr)

    def _learning(self, instr: _Learning) -> None:
        if self.forward_only:
            raise _Fault(f"an evaluation program runs forward only, but `{instr}` learns")

    def step(self, i: int, instr: Step) -> None:
        self._learning(instr)
        self._owned(instr)
        if instr.ms in self.s.stepped:
            raise _Fault(f"ministage {instr.ms} steps twice")
        if missing := [mb for mb in sorted(self.mbs) if (instr.ms, mb) not in self.s.wgrad]:
            raise _Fault(f"steps ministage {instr.ms} before the gradients of microbatches {missing} exist")
        self._reduced(instr.ms, "steps")
        if self.clip and not self.s.norm_done:
            raise _Fault("steps before the global gradient norm is known (all_reduce norm)")
        if not self.shards[instr.ms].opt_offload:
            self._on_device(instr.ms)
        if self.shards[instr.ms].param_offload:
            self.s.changed.add(instr.ms)    # the host copy is behind until an offload copies it back
        self.s.stepped.add(instr.ms)

    @staticmethod
    def _reductions_needed(shard: Shard) -> list[str]:
        if shard.group is None:
            return []
        return [shard.group] + ([shard.outer] if shard.outer else [])

    def _post(self, i: int, instr: _Posted) -> None:
        if instr.handle is None:
            self._complete(instr)
        else:
            self.s.pending[instr.handle] = instr
            if isinstance(instr, Recv):
                self.s.receiving.setdefault(_message(instr), []).append(instr)

    def wait(self, i: int, instr: Wait) -> None:
        done = self.s.pending.pop(instr.handle, None)
        if done is not None:
            if isinstance(done, Recv):
                self.s.receiving[_message(done)].remove(done)
            self._complete(done)

    def _complete(self, instr: _Posted) -> None:
        s = self.s
        if isinstance(instr, Recv):
            # a whole tensor brings every token this rank receives (`recv` checked the sender holds the same)
            whole = list(self.arrives) if self.arrives is not None else [(0, 0)]
            s.arrived.setdefault((instr.what, instr.ms, instr.mb), []).extend(
                whole if instr.seq is None else [instr.seq])
        elif isinstance(instr, AllGather):
            shard = self.shards[instr.ms]
            full = shard.level == 3 and instr.group != shard.outer   # the outer gather rebuilds the shard
            key = (instr.ms, instr.unit)
            s.gathered[key] = s.gathered.get(key, 0) + full
        elif isinstance(instr, (ReduceScatter, AllReduce)) and instr.what is Tensor.GRADS:
            group, _ = split_direction(instr.group)
            reduced = s.reduced.setdefault((instr.ms, instr.unit), [])
            if group not in reduced:
                reduced.append(group)
        elif isinstance(instr, AllReduce) and instr.what is Tensor.NORM:
            s.norm_done = True
        elif isinstance(instr, (Offload, Prefetch)):
            self._copied(instr)

    def _copied(self, instr: Offload | Prefetch) -> None:
        s = self.s
        if instr.what is Tensor.PARAMS:
            s.moving.discard(("params", instr.ms))
            (s.on_host.add if isinstance(instr, Offload) else s.on_host.discard)(instr.ms)
            s.changed.discard(instr.ms)
        else:
            assert instr.mb is not None   # `copy` let only a live stash, (ms, mb), move
            s.moving.discard(("act", instr.ms, instr.mb))
            (s.act_host.add if isinstance(instr, Offload) else s.act_host.discard)((instr.ms, instr.mb))

    # ------------------------------------------------------------ the end

    def finish(self) -> list[str]:
        out = []
        for ms in sorted(self.own):
            for mb in sorted(self.mbs):
                if (ms, mb) not in self.s.fwd:
                    out.append(f"microbatch {mb} never passes ministage {ms} forward")
                elif not self.forward_only and ((ms, mb) not in self.s.wgrad or (ms, mb) not in self.s.bwd):
                    out.append(f"microbatch {mb} never passes ministage {ms} backward")
            if ms not in self.s.stepped and not self.forward_only:
                out.append(f"ministage {ms} never steps its optimizer")
            for (gathered_ms, unit), count in self.s.gathered.items():
                if gathered_ms == ms and count:
                    out.append(f"the gathered parameters of ministage {ms}{_of_unit(unit)} are never freed")
            if self.shards.get(ms) and self.shards[ms].param_offload and ms not in self.s.on_host:
                out.append(f"the parameters of ministage {ms} end the step on the device, but the next step "
                           "expects them on the host")
        return out


def _of_unit(unit: Unit | None) -> str:
    return "" if unit is None else f" (unit {unit})"


def _message(recv: Recv) -> _Message:
    return recv.what, recv.ms, recv.mb


# one handler per instruction class, each taking its own class (so the table's value type is loose)
_HANDLERS: dict[type[Instr], Callable[..., None]] = {
    Load: _Rank.load, Forward: _Rank.forward, Backward: _Rank.backward, BackwardInput: _Rank.backward,
    BackwardWeight: _Rank.backward, Send: _Rank.send, Recv: _Rank.recv, AllGather: _Rank.collective,
    ReduceScatter: _Rank.collective, AllReduce: _Rank.collective, AllToAll: _Rank.collective,
    Offload: _Rank.copy, Prefetch: _Rank.copy, Free: _Rank.free, Step: _Rank.step, Wait: _Rank.wait,
}


def check_dataflow(program: Program, pipeline: Pipeline, num_layers: int, clip: bool,
                   seq: int | None = None, forward_only: bool = False) -> list[Finding]:
    """Per-rank findings; with the sequence length `seq`, received pieces are checked against the layouts.

    `forward_only`: an evaluation program (Note [Evaluation programs] in passes/lower/forward_only.py):
    every microbatch passes each ministage forward once, and nothing runs backward or steps.
    """
    return [at(program, rp.rank, index, message) for rp in program.ranks
            for index, message in rank_dataflow(rp, pipeline, num_layers, clip, seq, forward_only)]


def rank_dataflow(rp: RankProgram, pipeline: Pipeline, num_layers: int, clip: bool, seq: int | None = None,
                  forward_only: bool = False) -> list[tuple[int, str]]:
    """`check_dataflow` of one rank, which reads no other rank's program: (instruction index, message)."""
    rank = _Rank(rp, pipeline, num_layers, clip and not forward_only, seq, forward_only)
    for i, instr in enumerate(rp.instrs):
        try:
            _HANDLERS[type(instr)](rank, i, instr)
        except _Fault as fault:
            return [(i, str(fault))]
    return [(len(rp.instrs) - 1, msg) for msg in rank.finish()]
