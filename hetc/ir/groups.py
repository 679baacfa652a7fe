"""Group identity: which ranks a collective runs over, as a typed value.

Note [group names]: a program names its groups by text (the group table,
`group=` of a collective, the shard lines), and a person editing a listing
may name a group anything. The groups the compiler makes follow one scheme,
built here from a `GroupId` (kind, stage, coordinates) and rendered to text
only where a name is written into the program:

    dp.s{stage}.p{pos}         the stage's lanes at lane position pos (ZeRO)
    dp.s{stage}.t{t}           with cp > 1: tp rank t of every lane and cp rank
    {dp group}.n{k}            hierarchical ZeRO: the replicas on node k
    dpx.s{stage}.p{pos}.i{i}   hierarchical ZeRO: shard i of every node
                               (dpx.s{stage}.t{t}.i{i} with cp > 1)
    tp.s{stage}.l{lane}.c{c}   the tp ranks of cp rank c of a lane
    cp.s{stage}.l{lane}.t{t}   the cp ranks of tp rank t of a lane
    ep.s{stage}.g{g}.p{pos}    expert parallelism: lane position pos of EP group g
    dpe.s{stage}.e{r}          the replicas of EP rank r's experts
    tied                       every rank holding a copy of a tied embedding (Note [tied gradients] in
                               hetc/ir/program.py)
    world                      every rank (loss, gradient norm)

Any group may have per-microbatch copies `{group}.f` / `{group}.b` (the
forward and backward collectives of ZeRO-3 and ZeRO-2 under pipelining);
they have the group's members and act on the group's buffers, so readers
ask `split_direction` for the group a name belongs to, whatever its text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

__all__ = ["TIED", "WORLD", "Axis", "Direction", "GroupId", "GroupKind", "split_direction", "with_direction"]


class GroupKind(StrEnum):
    """What a group's members share (Note [group names])."""

    WORLD = "world"
    DP = "dp"        # the replicas of a lane position's parameters (ZeRO)
    DPX = "dpx"      # hierarchical ZeRO: the same shard on every node
    TP = "tp"
    CP = "cp"
    EP = "ep"
    DPE = "dpe"      # the replicas of an EP rank's experts
    TIED = "tied"    # the holders of a tied embedding's copies


class Axis(StrEnum):
    """A coordinate of a group inside its stage."""

    POS = "p"        # lane position
    TP_RANK = "t"
    CP_RANK = "c"
    LANE = "l"
    NODE = "n"       # hierarchical ZeRO: the replicas' node
    SHARD = "i"      # hierarchical ZeRO: the shard's index inside its node
    EP_GROUP = "g"
    EP_RANK = "e"


class Direction(StrEnum):
    """The per-microbatch copy of a group a collective runs on: forward or backward."""

    FORWARD = "f"
    BACKWARD = "b"


@dataclass(frozen=True, slots=True)
class GroupId:
    """One group of the compiler's scheme; `str()` is its name in the program."""

    kind: GroupKind
    stage: int | None = None                        # None only for `world` and `tied`
    coords: tuple[tuple[Axis, int], ...] = ()
    direction: Direction | None = None

    def at(self, axis: Axis, index: int) -> GroupId:
        """This group narrowed by one more coordinate."""
        return replace(self, coords=(*self.coords, (axis, index)))

    def of_kind(self, kind: GroupKind) -> GroupId:
        """The group of another kind at the same coordinates (a dp group's hierarchical `dpx`)."""
        return replace(self, kind=kind)

    def per_microbatch(self, direction: Direction) -> GroupId:
        return replace(self, direction=direction)

    def __str__(self) -> str:
        parts = [self.kind.value]
        if self.stage is not None:
            parts.append(f"s{self.stage}")
        parts += [f"{axis.value}{index}" for axis, index in self.coords]
        if self.direction is not None:
            parts.append(self.direction.value)
        return ".".join(parts)


WORLD = GroupId(GroupKind.WORLD)
TIED = GroupId(GroupKind.TIED)


def split_direction(name: str) -> tuple[str, Direction | None]:
    """(the group a name belongs to, which per-microbatch copy it is): `dp.s0.p1.f` -> (`dp.s0.p1`, FORWARD)."""
    for direction in Direction:
        if name.endswith(f".{direction.value}"):
            return name[:-2], direction
    return name, None


def with_direction(name: str, direction: Direction) -> str:
    """The name of a group's per-microbatch copy (`split_direction`'s inverse)."""
    return f"{name}.{direction.value}"
