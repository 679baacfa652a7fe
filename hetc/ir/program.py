"""The Program: one instruction list per rank, for one training step.

A closed set of instruction kinds, each a frozen dataclass with a one-line
text form that parses back to the same object (`parse_instr(str(i)) == i`).
A rank's listing (`RankProgram.to_text`) is what `hetc compile` writes to
`programs/rank-NNNN.txt` and what `hetc verify` and `hetc run` read, so a
person can edit a schedule by hand.

Semantics the runtime and the verifier share (Note [dataflow]):
- `fwd ms=k mb=j` reads its input from: the loaded tokens when ministage k
  starts at the embedding; else this rank's own `fwd ms=k-1 mb=j` when it ran
  it; else a completed `recv act ms=k-1 mb=j`. Its output is what
  `send act ms=k mb=j` sends. When ministage k ends at the head, it also
  computes the loss of microbatch j (labels from `load`).
- `bwd ms=k mb=j` (or `bwd_i` then `bwd_w`) reads the gradient of its output
  from: the loss when k ends at the head; else this rank's own backward of
  ministage k+1; else a completed `recv grad ms=k+1 mb=j`. The gradient of
  its input is what `send grad ms=k mb=j` sends.
- A message is named by (tensor kind, producing ministage, microbatch): `act`
  leaves ministage k forwards, `grad` leaves ministage k backwards.
- An instruction with `h=N` only starts; `wait h=N` completes it. Without a
  handle it completes before the next instruction starts.
- Collectives act on the flat parameter/gradient buffer of one ministage over
  a named group; every member must issue a group's collectives in the same
  order.
- A `send`/`recv` with `seq=a:b` carries only tokens [a, b) of the sequence:
  where the block layouts of two sides differ (hetc/ir/layout.py), a boundary
  tensor travels as pieces, and a consumer waits until its received pieces
  tile exactly the tokens it holds.
- Note [compute collectives]: the compute of a ministage whose shard line
  names a `tp_group` / `cp_group` runs tensor-parallel all-reduces, Ulysses
  all-to-alls or ring-attention exchanges on those groups, so every compute
  op of it is a collective there: all members run the same ops in the same
  order. An `ep_group` (expert parallelism) joins the same lane position of
  several lanes, which serve different microbatches: there its members run
  the same op kinds on the same ministages in the same order (microbatches
  may differ), each op doing the MoE blocks' all-to-alls.
- A ministage whose shard line names an `ep_group` keeps its expert
  parameters in a second flat buffer, replicated over `expert_group` (the
  lanes at the same EP rank; `-`: none) instead of the ministage's `group`.
  A collective on `expert_group` (or its `.f`/`.b`) acts on that buffer,
  one on the other groups on the dense one; `step`, `offload` and
  `prefetch` act on both.
- For a ZeRO-3 ministage, `all_gather params` raises a count of holders of
  its full parameters (allocating them at 0 -> 1) and `free params` lowers it
  (releasing them at 1 -> 0), so a gather for the next op may be posted while
  the current op still uses the parameters.
- Note [units]: a ZeRO-3 ministage may be split into *units* (the FSDP unit:
  one block each, its shard line's `units=`); then its parameters are one
  flat buffer per unit, and `all_gather`, `free`, `reduce_scatter`, `all_reduce grads` with
  `unit=a:b` act on the buffer of layers [a, b) alone. A compute op with
  `unit=a:b` runs layers [a, b) of its ministage only: forward reads the
  input of the ministage when a is its first layer, else its own forward of
  the unit ending at a; backward reads the output gradient of the ministage
  when b is its stop, else its own backward of the unit starting at b. The
  ministage's forward (backward) is done, for sends and the next ministage,
  when its last (first) unit is. A collective without a unit on a ministage
  split into units is refused (each unit is a buffer of its own).
- Note [tied gradients]: with tied embeddings on different stages, the
  embedding's ministage and the head's each hold a copy of the matrix (Note
  [tied copies] in runtime/nn/model.py). `all_reduce tied ms=k` on the group
  of every rank holding a copy sums the copies' reduced gradients (after
  ministage k's ZeRO reductions, each element counted by one replica) and
  puts the sum back in each copy's reduced gradient; ministage k's `step`
  comes after it. It names no unit: it finds the copy in whichever unit of
  ministage k holds it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, NamedTuple

from hetc.ir.jsontypes import JsonObject, RawJson

from hetc.ir.groups import split_direction

__all__ = [
    "COLLECTIVE_OF",
    "COLLECTIVE_TYPES",
    "COMPUTE_TYPES",
    "INSTR_TYPES",
    "PHASE_OF",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Collective",
    "ComputeInstr",
    "Forward",
    "Free",
    "Group",
    "Instr",
    "Load",
    "Offload",
    "Phase",
    "Prefetch",
    "Program",
    "ProgramFormatError",
    "RankProgram",
    "Recv",
    "ReduceScatter",
    "Send",
    "Shard",
    "Step",
    "Tensor",
    "Unit",
    "Wait",
    "instr_from_json",
    "parse_instr",
]


class Tensor(StrEnum):
    ACT = "act"          # a boundary activation of one microbatch
    GRAD = "grad"        # the gradient of a boundary activation
    PARAMS = "params"    # a ministage's parameters (flat buffer)
    GRADS = "grads"      # a ministage's parameter gradients (flat buffer)
    LOSS = "loss"        # the step's summed loss (for reporting)
    NORM = "norm"        # the squared gradient norm (for clipping)
    TIED = "tied"        # the gradient of a tied embedding's copies (Note [tied copies] in runtime/nn/model.py)


class ProgramFormatError(ValueError):
    """A listing or JSON that does not describe a program; carries the line."""

    def __init__(self, message: str, line: int = 0, source: str = ""):
        self.line = line
        self.source = source
        where = f"{source}:{line}: " if source else (f"line {line}: " if line else "")
        super().__init__(where + message)


@dataclass(frozen=True, slots=True, order=True)
class Unit:
    """Layers [first, stop) of a ministage (model layer indices): the unit ZeRO-3 gathers, computes and
    reduces at once (Note [units]); text `first:stop`."""

    first: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.stop:
            raise ValueError(f"bad unit '{self.first}:{self.stop}' (write e.g. unit=1:2, first < stop)")

    def __str__(self) -> str:
        return f"{self.first}:{self.stop}"

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)

    @classmethod
    def parse(cls, raw: str) -> Unit:
        first, sep, stop = raw.partition(":")
        if not (sep and first.isdigit() and stop.isdigit()):
            raise ValueError(f"bad unit '{raw}' (write e.g. unit=1:2)")
        return cls(int(first), int(stop))


@dataclass(frozen=True, slots=True)
class _Base:
    OP: ClassVar[str] = ""
    WHAT: ClassVar[tuple[Tensor, ...]] = ()   # allowed values of the positional `what`

    def __str__(self) -> str:
        parts = [self.OP]
        for name, key in _text_fields(type(self)):  # type: ignore[arg-type]  # a class is hashable
            value = getattr(self, name)
            if name == "what":
                parts.append(value.value)
            elif isinstance(value, bool):
                if value:
                    parts.append(key)        # a flag: written by name where set
            elif value is not None:
                parts.append(f"{key}={_fmt(name, value) if isinstance(value, tuple) else value}")
        return " ".join(parts)

    def to_json(self) -> JsonObject:
        out: JsonObject = {"op": self.OP}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value is not False:    # a flag is written where set
                out[f.name] = value.value if isinstance(value, StrEnum) else (
                    list(value) if isinstance(value, tuple) else
                    [value.first, value.stop] if isinstance(value, Unit) else value)
        return out


# text key for a field, where it differs from the field name
_KEYS = {"peer_to": "to", "peer_from": "from", "handle": "h"}


@functools.cache
def _text_fields(cls: type) -> tuple[tuple[str, str], ...]:
    """(field, text key) in text order: the handle last. Cached: listings print millions of these."""
    fields = sorted(dataclasses.fields(cls), key=lambda f: f.name == "handle")
    return tuple((f.name, _KEYS.get(f.name, f.name)) for f in fields)


def _fmt(name: str, value: tuple[int, ...]) -> str:
    if name == "seq":
        return f"{value[0]}:{value[1]}"
    if isinstance(value, tuple):
        return "x".join(str(v) for v in value)
    return str(value)


@dataclass(frozen=True, slots=True)
class Load(_Base):
    """Load the tokens and labels of microbatch `mb` (plan-independent content)."""

    OP: ClassVar[str] = "load"
    mb: int


@dataclass(frozen=True, slots=True)
class _Compute(_Base):
    """The fields every compute op has: ministage `ms` on microbatch `mb`, all of it or one unit."""

    ms: int
    mb: int
    unit: Unit | None = None


@dataclass(frozen=True, slots=True)
class Forward(_Compute):
    OP: ClassVar[str] = "fwd"


@dataclass(frozen=True, slots=True)
class Backward(_Compute):
    """Input gradient and weight gradient together."""

    OP: ClassVar[str] = "bwd"


@dataclass(frozen=True, slots=True)
class BackwardInput(_Compute):
    """Zero-bubble I: the input gradient only; weight gradient deferred to `bwd_w`."""

    OP: ClassVar[str] = "bwd_i"


@dataclass(frozen=True, slots=True)
class BackwardWeight(_Compute):
    OP: ClassVar[str] = "bwd_w"


@dataclass(frozen=True, slots=True)
class Send(_Base):
    """Send a boundary tensor; `seq=a:b` only tokens [a, b) of the sequence (a layout transform's piece)."""

    OP: ClassVar[str] = "send"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.ACT, Tensor.GRAD)
    what: Tensor
    ms: int
    mb: int
    peer_to: int
    shape: tuple[int, ...]
    handle: int | None = None
    seq: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Recv(_Base):
    """Receive a boundary tensor, or with `seq=a:b` the piece of it holding tokens [a, b)."""

    OP: ClassVar[str] = "recv"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.ACT, Tensor.GRAD)
    what: Tensor
    ms: int
    mb: int
    peer_from: int
    shape: tuple[int, ...]
    handle: int | None = None
    seq: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class AllGather(_Base):
    """Gather ministage `ms`'s parameter shards into its full parameters."""

    OP: ClassVar[str] = "all_gather"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.PARAMS,)
    what: Tensor
    ms: int
    group: str
    handle: int | None = None
    unit: Unit | None = None


@dataclass(frozen=True, slots=True)
class ReduceScatter(_Base):
    """Sum ministage `ms`'s gradients over the group, keeping this rank's shard."""

    OP: ClassVar[str] = "reduce_scatter"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.GRADS,)
    what: Tensor
    ms: int
    group: str
    handle: int | None = None
    unit: Unit | None = None


@dataclass(frozen=True, slots=True)
class AllReduce(_Base):
    """Sum over the group: a ministage's gradients (or its shard of them), the loss, the norm, or (`tied`) the
    gradient of the tied embedding's copy that ministage `ms` holds (Note [tied gradients])."""

    OP: ClassVar[str] = "all_reduce"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.GRADS, Tensor.LOSS, Tensor.NORM, Tensor.TIED)
    what: Tensor
    group: str
    ms: int | None = None
    handle: int | None = None
    unit: Unit | None = None


@dataclass(frozen=True, slots=True)
class AllToAll(_Base):
    """Layout transform of a boundary tensor inside a group (tp/cp contracts)."""

    OP: ClassVar[str] = "all_to_all"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.ACT, Tensor.GRAD)
    what: Tensor
    ms: int
    mb: int
    group: str
    handle: int | None = None


@dataclass(frozen=True, slots=True)
class Offload(_Base):
    """Copy to the host and release device memory (params of a ministage, or one stashed act); with
    `host_current`, parameters whose host copy is still current (nothing changed them on the device since
    they came: Note [clean parameter offload] in passes/lower/offload.py) are released without a copy."""

    OP: ClassVar[str] = "offload"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.PARAMS, Tensor.ACT)
    what: Tensor
    ms: int
    mb: int | None = None
    handle: int | None = None
    host_current: bool = False


@dataclass(frozen=True, slots=True)
class Prefetch(_Base):
    """Copy back from the host to the device."""

    OP: ClassVar[str] = "prefetch"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.PARAMS, Tensor.ACT)
    what: Tensor
    ms: int
    mb: int | None = None
    handle: int | None = None


@dataclass(frozen=True, slots=True)
class Free(_Base):
    """Release the gathered full parameters of a sharded ministage."""

    OP: ClassVar[str] = "free"
    WHAT: ClassVar[tuple[Tensor, ...]] = (Tensor.PARAMS,)
    what: Tensor
    ms: int
    unit: Unit | None = None


@dataclass(frozen=True, slots=True)
class Step(_Base):
    """The optimizer step on this rank's shard of ministage `ms`."""

    OP: ClassVar[str] = "step"
    ms: int


@dataclass(frozen=True, slots=True)
class Wait(_Base):
    OP: ClassVar[str] = "wait"
    handle: int


Instr = (Load | Forward | Backward | BackwardInput | BackwardWeight | Send | Recv | AllGather | ReduceScatter
         | AllReduce | AllToAll | Offload | Prefetch | Free | Step | Wait)
INSTR_TYPES: dict[str, type[Instr]] = {t.OP: t for t in Instr.__args__}
COMPUTE_TYPES = (Forward, Backward, BackwardInput, BackwardWeight)
ComputeInstr = Forward | Backward | BackwardInput | BackwardWeight
COLLECTIVE_TYPES = (AllGather, ReduceScatter, AllReduce, AllToAll)


class Phase(StrEnum):
    """What a compute op does to a microbatch: forward, backward, or backward's two halves (zero bubble:
    the gradient of the input, then of the weights). The letters are torch's action codes (`0F1`)."""

    FORWARD = "F"
    BACKWARD = "B"
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"


class Collective(StrEnum):
    """The collective operations, by the name the cost model, the profiles and the listings use."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


PHASE_OF: dict[type[ComputeInstr], Phase] = {Forward: Phase.FORWARD, Backward: Phase.BACKWARD,
                                             BackwardInput: Phase.INPUT_GRAD, BackwardWeight: Phase.WEIGHT_GRAD}
COLLECTIVE_OF: dict[type[AllGather | ReduceScatter | AllReduce | AllToAll], Collective] = {
    AllGather: Collective.ALL_GATHER, ReduceScatter: Collective.REDUCE_SCATTER, AllReduce: Collective.ALL_REDUCE,
    AllToAll: Collective.ALL_TO_ALL}
_FIELD_OF_KEY = {v: k for k, v in _KEYS.items()}


def parse_instr(text: str) -> Instr:
    """The inverse of `str(instr)`; ValueError with a reason on bad text."""
    words = text.split()
    if not words:
        raise ValueError("empty instruction")
    cls = INSTR_TYPES.get(words[0])
    if cls is None:
        raise ValueError(f"unknown instruction '{words[0]}'; known: {', '.join(INSTR_TYPES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}   # cls's own field names, each value parsed for its field
    rest = words[1:]
    if "what" in fields:
        if not rest or "=" in rest[0]:
            raise ValueError(f"'{cls.OP}' needs one of {', '.join(w.value for w in cls.WHAT)}")
        what = Tensor(rest[0]) if rest[0] in Tensor._value2member_map_ else None
        if what not in cls.WHAT:
            raise ValueError(f"'{cls.OP}' takes {', '.join(w.value for w in cls.WHAT)}, not '{rest[0]}'")
        values["what"] = what
        rest = rest[1:]
    for word in rest:
        key, sep, raw = word.partition("=")
        name = _FIELD_OF_KEY.get(key, key)
        if not sep and name in fields and fields[name].type in (bool, "bool"):
            values[name] = True
            continue
        if not sep or name not in fields or name == "what":
            raise ValueError(f"unexpected '{word}' in '{cls.OP}'")
        if name in values:
            raise ValueError(f"'{key}' given twice")
        values[name] = _parse_value(name, raw)
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"'{cls.OP}' is missing {', '.join(_KEYS.get(m, m) for m in missing)}")
    return cls(**values)


def _parse_value(name: str, raw: str) -> str | int | tuple[int, ...] | Unit:
    if name == "group":
        if not raw:
            raise ValueError("empty group name")
        return raw
    if name == "seq":
        start, sep, stop = raw.partition(":")
        if not (sep and start.isdigit() and stop.isdigit() and int(start) < int(stop)):
            raise ValueError(f"bad token range '{raw}' (write e.g. seq=0:16)")
        return int(start), int(stop)
    if name == "unit":
        return Unit.parse(raw)
    if name == "shape":
        try:
            dims = tuple(int(d) for d in raw.split("x"))
        except ValueError:
            raise ValueError(f"bad shape '{raw}' (write e.g. 2x32x64)") from None
        if any(d <= 0 for d in dims):
            raise ValueError(f"bad shape '{raw}'")
        return dims
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"'{name}' must be a whole number, not '{raw}'") from None
    if value < 0:
        raise ValueError(f"'{name}' must not be negative")
    return value


def instr_from_json(obj: RawJson) -> Instr:
    cls = INSTR_TYPES.get(obj.get("op", ""))
    if cls is None:
        raise ValueError(f"unknown instruction {obj.get('op')!r}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            continue
        v = obj[f.name]
        kwargs[f.name] = Tensor(v) if f.name == "what" else (
            tuple(v) if f.name in ("shape", "seq") else Unit(*v) if f.name == "unit" else v)
    return cls(**kwargs)


# ---------------------------------------------------------------- tables


@dataclass(frozen=True, slots=True)
class Group:
    """A named set of ranks that run collectives together."""

    name: str
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        return f"group {self.name} = [{', '.join(map(str, self.ranks))}]"


@dataclass(frozen=True, slots=True)
class Shard:
    """How one rank holds a ministage's state (the buffer table).

    `level` is the ZeRO level inside `group` (None: a single lane, nothing to
    shard); `outer` and `outer_level` the level across shard groups
    (hierarchical ZeRO). `param_offload` keeps parameters on the host between
    uses, `opt_offload` keeps optimizer state on the host and steps there,
    `act_offload` stashes only the ministage's boundary input on the host and
    recomputes the ministage in backward. `tp_group` / `cp_group` name the
    groups the ministage's compute runs its tensor- and context-parallel
    collectives on (Note [compute collectives]); `ep_group` the expert-parallel
    group of its MoE blocks, whose expert parameters are replicated over
    `expert_group` (None: nowhere else) rather than `group`. `units`: the
    ZeRO-3 units the ministage is split into (Note [units]); empty, one
    buffer for the whole ministage.
    """

    ms: int
    level: int
    group: str | None = None
    outer: str | None = None
    outer_level: int = 0
    param_offload: bool = False
    opt_offload: bool = False
    act_offload: bool = False
    tp_group: str | None = None
    cp_group: str | None = None
    ep_group: str | None = None
    expert_group: str | None = None
    units: tuple[Unit, ...] = ()

    @property
    def compute_groups(self) -> tuple[str, ...]:
        return tuple(g for g in (self.tp_group, self.cp_group, self.ep_group) if g is not None)

    @property
    def experts(self) -> Shard | None:
        """The shard of the expert parameters' own buffer (a view: `group` is `expert_group`), or None."""
        if self.ep_group is None:
            return None
        return dataclasses.replace(self, group=self.expert_group, outer=None, outer_level=0, ep_group=None,
                                   expert_group=None)

    def part(self, group: str) -> Shard:
        """The buffer a collective on `group` acts on: the experts' or the dense parameters' (Note above)."""
        experts = self.experts
        base, _ = split_direction(group)
        return experts if experts is not None and base == self.expert_group else self

    def __str__(self) -> str:
        flags = [name for name, on in (("param_offload", self.param_offload), ("opt_offload", self.opt_offload),
                                       ("act_offload", self.act_offload)) if on]
        groups = "".join(f" {k}={g}" for k, g in (("tp_group", self.tp_group), ("cp_group", self.cp_group),
                                                   ("ep_group", self.ep_group)) if g)
        if self.ep_group:
            groups += f" expert_group={self.expert_group or '-'}"
        if self.units:
            groups += " units=" + ",".join(map(str, self.units))
        return (f"shard ms={self.ms} zero={self.level} group={self.group or '-'} outer={self.outer or '-'} "
                f"outer_zero={self.outer_level}" + groups + "".join(f" {f}" for f in flags))


def _parse_shard(text: str) -> Shard:
    words = text.split()[1:]
    kv = dict(w.partition("=")[::2] for w in words if "=" in w)
    flags = {w for w in words if "=" not in w}
    unknown = flags - {"param_offload", "opt_offload", "act_offload"}
    if unknown:
        raise ValueError(f"unknown shard flag '{min(unknown)}'")
    try:
        return Shard(int(kv["ms"]), int(kv["zero"]), None if kv["group"] == "-" else kv["group"],
                     None if kv["outer"] == "-" else kv["outer"], int(kv["outer_zero"]),
                     "param_offload" in flags, "opt_offload" in flags, "act_offload" in flags,
                     kv.get("tp_group") or None, kv.get("cp_group") or None, kv.get("ep_group") or None,
                     None if kv.get("expert_group", "-") == "-" else kv["expert_group"],
                     tuple(Unit.parse(u) for u in kv["units"].split(",")) if kv.get("units") else ())
    except (KeyError, ValueError) as err:
        raise ValueError(f"bad shard line ({err})") from None


@dataclass(frozen=True, slots=True)
class RankProgram:
    """What one rank does in one step."""

    rank: int
    stage: int
    lane: int
    tp_rank: int
    cp_rank: int
    shards: tuple[Shard, ...]
    instrs: tuple[Instr, ...]

    def header(self) -> str:
        return f"rank {self.rank} stage={self.stage} lane={self.lane} tp_rank={self.tp_rank} cp_rank={self.cp_rank}"

    def to_text(self) -> str:
        lines = [self.header(), *map(str, self.shards)]
        lines += [f"{i:>5}  {instr}" for i, instr in enumerate(self.instrs)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str, source: str = "") -> RankProgram:
        header: _Header | None = None
        shards: list[Shard] = []
        instrs: list[Instr] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                if line.startswith("rank "):
                    header = _parse_header(line)
                elif line.startswith("shard "):
                    shards.append(_parse_shard(line))
                else:
                    index, _, body = line.partition(" ")
                    if not index.isdigit():
                        body = line  # the index column is optional when editing by hand
                    instrs.append(parse_instr(body.strip()))
            except ValueError as err:
                raise ProgramFormatError(str(err), lineno, source) from None
        if header is None:
            raise ProgramFormatError("no 'rank N ...' header line", 1, source)
        return cls(*header, shards=tuple(shards), instrs=tuple(instrs))

    def to_json(self) -> JsonObject:
        return {"rank": self.rank, "stage": self.stage, "lane": self.lane, "tp_rank": self.tp_rank,
                "cp_rank": self.cp_rank, "shards": [_shard_json(s) for s in self.shards],
                "instrs": [i.to_json() for i in self.instrs]}

    @classmethod
    def from_json(cls, obj: RawJson) -> RankProgram:
        return cls(obj["rank"], obj["stage"], obj["lane"], obj["tp_rank"], obj["cp_rank"],
                   tuple(_shard_from_json(s) for s in obj["shards"]),
                   tuple(instr_from_json(i) for i in obj["instrs"]))


def _shard_json(shard: Shard) -> dict[str, Any]:
    out = dataclasses.asdict(shard)
    out["units"] = [[u.first, u.stop] for u in shard.units]
    return out


def _shard_from_json(obj: dict[str, Any]) -> Shard:
    return Shard(**{**obj, "units": tuple(Unit(*u) for u in obj.get("units", ()))})


class _Header(NamedTuple):
    """A listing's `rank N stage=S lane=L tp_rank=T cp_rank=C` line: RankProgram's leading fields."""

    rank: int
    stage: int
    lane: int
    tp_rank: int
    cp_rank: int


def _parse_header(line: str) -> _Header:
    words = line.split()
    kv = dict(w.partition("=")[::2] for w in words[2:])
    try:
        return _Header(int(words[1]), int(kv["stage"]), int(kv["lane"]), int(kv["tp_rank"]),
                       int(kv["cp_rank"]))
    except (KeyError, ValueError, IndexError):
        raise ValueError("bad header: expected 'rank N stage=S lane=L tp_rank=T cp_rank=C'") from None


@dataclass(frozen=True, slots=True)
class Program:
    """All ranks' programs with the group table. `ranks` is indexed by rank; a plan directory's ranks may
    be read on demand (Note [a rank reads its own] in hetc/plandir.py)."""

    ranks: Sequence[RankProgram]
    groups: tuple[Group, ...]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def groups_text(self) -> str:
        return "".join(f"{g}\n" for g in self.groups)

    @staticmethod
    def parse_groups(text: str, source: str = "") -> tuple[Group, ...]:
        groups = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            head, sep, body = line.partition("=")
            words = head.split()
            if not sep or len(words) != 2 or words[0] != "group":
                raise ProgramFormatError("expected 'group NAME = [r, ...]'", lineno, source)
            try:
                ranks = tuple(int(r) for r in body.strip().strip("[]").split(",") if r.strip())
            except ValueError:
                raise ProgramFormatError("ranks must be whole numbers", lineno, source) from None
            groups.append(Group(words[1], ranks))
        return tuple(groups)

    def to_json(self) -> str:
        return json.dumps({"groups": [{"name": g.name, "ranks": list(g.ranks)} for g in self.groups],
                           "ranks": [r.to_json() for r in self.ranks]})

    @classmethod
    def from_json(cls, text: str) -> Program:
        obj = json.loads(text)
        return cls(tuple(RankProgram.from_json(r) for r in obj["ranks"]),
                   tuple(Group(g["name"], tuple(g["ranks"])) for g in obj["groups"]))

    def replace_rank(self, rank: int, instrs: tuple[Instr, ...]) -> Program:
        ranks = list(self.ranks)
        ranks[rank] = dataclasses.replace(ranks[rank], instrs=instrs)
        return Program(tuple(ranks), self.groups)
