"""A member's program from its class representative's: rank numbers, microbatch ids and group names renamed.

Each instruction kind has its own small renaming (a closed table, like
the runtime's handlers): only the fields that name a peer, a microbatch
or a group change, and an instruction naming none of them is shared, not
copied (instructions are frozen). tests/test_lower_by_class.py checks the
table against every kind's fields, so a field added to an instruction
cannot be dropped here unnoticed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hetc.ir.errors import InternalError
from hetc.ir.groups import TIED, WORLD, split_direction, with_direction
from hetc.ir.geometry import RankPlace
from hetc.ir.program import (AllGather, AllReduce, AllToAll, Backward, BackwardInput, BackwardWeight, Forward, Free, Instr,
                          Load, Offload, Prefetch, RankProgram, Recv, ReduceScatter, Send, Shard, Step, Wait)

__all__ = ["RENAMED_FIELDS", "SHARD_GROUPS", "Substitution", "substitute"]

# groups every rank names alike
_SHARED_GROUPS = frozenset({str(WORLD), str(TIED)})
# the fields of a `Shard` that name a group
SHARD_GROUPS = ("group", "outer", "tp_group", "cp_group", "ep_group", "expert_group")


@dataclass(frozen=True)
class Substitution:
    """How a member's program follows from its representative's (Note [lowering by class] in
    passes/lower/classes.py)."""

    ranks: dict[int, int]
    microbatches: dict[int, int]
    groups: dict[str, str]          # the representative's own groups (not their per-microbatch copies)

    def group(self, name: str) -> str:
        base, direction = split_direction(name)
        got = self.groups.get(base)
        if got is None:
            if base not in _SHARED_GROUPS:
                raise InternalError(f"lowering by class cannot rename group {name}: a pass names a group "
                                    "passes/lower/classes.py does not know")
            return name
        return got if direction is None else with_direction(got, direction)

    def maybe_group(self, name: str | None) -> str | None:
        return None if name is None else self.group(name)


def substitute(rp: RankProgram, sub: Substitution, place: RankPlace) -> RankProgram:
    """`rp` (a representative's program) renamed for the member at `place`."""
    instrs = tuple(_RENAME[type(instr)](instr, sub) for instr in rp.instrs)
    return RankProgram(place.rank, place.stage.index, place.lane.index, place.tp_rank, place.cp_rank,
                       tuple(_shard(shard, sub) for shard in rp.shards), instrs)


def _shard(shard: Shard, sub: Substitution) -> Shard:
    renamed: dict[str, Any] = {name: sub.maybe_group(getattr(shard, name)) for name in SHARD_GROUPS}
    return dataclasses.replace(shard, **renamed)


def _same(instr: Instr, sub: Substitution) -> Instr:
    return instr


def _load(i: Load, s: Substitution) -> Instr:
    return Load(s.microbatches[i.mb])


def _compute(i: Forward | Backward | BackwardInput | BackwardWeight, s: Substitution) -> Instr:
    return type(i)(i.ms, s.microbatches[i.mb], i.unit)


def _send(i: Send, s: Substitution) -> Instr:
    return Send(i.what, i.ms, s.microbatches[i.mb], s.ranks[i.peer_to], i.shape, i.handle, i.seq)


def _recv(i: Recv, s: Substitution) -> Instr:
    return Recv(i.what, i.ms, s.microbatches[i.mb], s.ranks[i.peer_from], i.shape, i.handle, i.seq)


def _gather(i: AllGather | ReduceScatter, s: Substitution) -> Instr:
    group = s.group(i.group)
    return i if group == i.group else type(i)(i.what, i.ms, group, i.handle, i.unit)


def _all_reduce(i: AllReduce, s: Substitution) -> Instr:
    group = s.group(i.group)
    return i if group == i.group else AllReduce(i.what, group, i.ms, i.handle, i.unit)


def _all_to_all(i: AllToAll, s: Substitution) -> Instr:
    return AllToAll(i.what, i.ms, s.microbatches[i.mb], s.group(i.group), i.handle)


def _host_copy(i: Offload | Prefetch, s: Substitution) -> Instr:
    return i if i.mb is None else dataclasses.replace(i, mb=s.microbatches[i.mb])


# kind -> (its renaming, the fields that renaming reads, in order: the test holds them to the kind's fields)
_TABLE: dict[type, tuple[Callable[[Any, Substitution], Instr], tuple[str, ...]]] = {
    Load: (_load, ("mb",)),
    Forward: (_compute, ("ms", "mb", "unit")),
    Backward: (_compute, ("ms", "mb", "unit")),
    BackwardInput: (_compute, ("ms", "mb", "unit")),
    BackwardWeight: (_compute, ("ms", "mb", "unit")),
    Send: (_send, ("what", "ms", "mb", "peer_to", "shape", "handle", "seq")),
    Recv: (_recv, ("what", "ms", "mb", "peer_from", "shape", "handle", "seq")),
    AllGather: (_gather, ("what", "ms", "group", "handle", "unit")),
    ReduceScatter: (_gather, ("what", "ms", "group", "handle", "unit")),
    AllReduce: (_all_reduce, ("what", "group", "ms", "handle", "unit")),
    AllToAll: (_all_to_all, ("what", "ms", "mb", "group", "handle")),
    Offload: (_host_copy, ("what", "ms", "mb", "handle", "host_current")),
    Prefetch: (_host_copy, ("what", "ms", "mb", "handle")),
    Free: (_same, ("what", "ms", "unit")),
    Step: (_same, ("ms",)),
    Wait: (_same, ("handle",)),
}
_RENAME = {kind: fn for kind, (fn, _) in _TABLE.items()}
RENAMED_FIELDS: dict[type, tuple[str, ...]] = {kind: fields for kind, (_, fields) in _TABLE.items()}
