"""Block layout contracts: which tokens of the sequence each rank of a lane holds at a border.

The survey's contract (III.III) says the activation at every border is
((b, S/N_part, H) × N_part)^N_rep. Here that becomes, for the rank at lane
position `pos` (= cp_rank · tp + tp_rank, `hetc.ir.pipeline.Lane`), a list of
token ranges of the full sequence, its *held ranges* (Note [block layout]):

- cp = 1 without sequence parallelism: the whole sequence, replicated over
  the tp ranks (N_rep = tp);
- Ulysses with cp = k: the cp_rank-th of k contiguous slices;
- ring attention with cp = k: chunks c and 2k−1−c of 2k equal chunks (the
  zigzag that gives every rank the same causal-attention work);
- Megatron sequence parallelism additionally splits the rank's tokens over
  the tp ranks: part tp_rank of tp equal parts of the cp_rank's local
  sequence (N_part = cp · tp, N_rep = 1).

A rank's boundary tensor is the concatenation of its held ranges in that
order, so a token range inside one held range is a contiguous slice of it
(`local_slice`). Where two sides of a border disagree, `transfers` cuts the
sequence into point-to-point pieces: each receiving position gets every
token it needs exactly once, from a position that holds it.

Note [scatter-gather borders]: where a lane replicates its tokens over its
tp ranks (tp > 1 without sequence parallelism), every tp rank would receive
the whole boundary tensor: tp copies of it over the pipeline border, which
is the node pair's slowest link. As Megatron-LM does by default
(`--scatter-gather-tensors-in-pipeline`), each tp rank receives only the
part sequence parallelism would hold (`arrival_ranges`: part tp_rank of
the cp rank's tokens, from the sender's position holding them) and the tp
group all-gathers the parts into the whole tensor when the consumer takes
it (runtime/lane.py `Arrivals`). The border carries the tensor once, as
1/tp pieces sent at once, and the gather runs over the lane's own tp group,
which sits inside a node (NVLink). Where the sequence does not split into
tp parts (`layout_problem` of the sequence-parallel layout) every rank
receives the whole tensor, as before. The gather is a call on the lane's tp
group inside the consumer's compute, where the tp all-reduces of its
layers are: every tp rank of a lane runs the same compute order, so NCCL
(one stream per communicator, calls matched in issue order) sees the same
sequence of calls on the tp communicator on every member, and the verifier
treats such compute as a call on that group (passes/verify/machine.py).

Note [block layout]: the sequence-parallel split is over the cp rank's
*concatenated* tokens, not over each held range: Megatron's all-gather at a
tensor-parallel region's entry concatenates the tp ranks' parts along the
sequence, which then rebuilds the cp rank's local sequence in order with no
permutation (with the zigzag ring and tp = 2, tp rank 0 holds chunk c and
tp rank 1 chunk 2k−1−c).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

from hetc.ir.spec import CPKind

__all__ = [
    "BorderLayout",
    "Piece",
    "Range",
    "SeqLayout",
    "arrival_ranges",
    "attention_ranges",
    "border_copies",
    "boundary_ranges",
    "describe",
    "gathers_at_border",
    "held_fraction",
    "held_length",
    "layout_problem",
    "local_slice",
    "positions",
    "replication",
    "seq_chunks",
    "tiling_problem",
    "transfers",
]

Range = tuple[int, int]   # [start, stop) of the full sequence


class SeqLayout(Protocol):
    """What decides a stage's border layout (`hetc.ir.pipeline.Stage` has these)."""

    @property
    def tp(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def cp_kind(self) -> CPKind: ...
    @property
    def sequence_parallel(self) -> bool: ...


def _zigzag(layout: SeqLayout) -> bool:
    return layout.cp > 1 and layout.cp_kind is CPKind.RING


def _splits_over_tp(layout: SeqLayout) -> bool:
    return layout.sequence_parallel and layout.tp > 1


def seq_chunks(layout: SeqLayout) -> int:
    """Into how many equal parts the layout cuts the sequence (each must be whole tokens)."""
    chunks = layout.cp * (2 if _zigzag(layout) else 1)
    return chunks * (layout.tp if _splits_over_tp(layout) else 1)


def layout_problem(layout: SeqLayout, seq: int) -> tuple[str, str] | None:
    """Why `seq` tokens cannot take this layout: (the field at fault, "cp" or "tp"; the reason), or None."""
    if seq % layout.cp:
        return "cp", f"cp ({layout.cp}) cuts the sequence into {layout.cp} slices"
    if _zigzag(layout) and seq % (2 * layout.cp):
        return "cp", f"ring attention with cp ({layout.cp}) cuts the sequence into 2·cp = {2 * layout.cp} zigzag chunks"
    if _splits_over_tp(layout) and (seq // layout.cp) % layout.tp:
        return "tp", (f"sequence parallelism splits each cp rank's {seq // layout.cp} tokens over tp "
                      f"({layout.tp}) ranks")
    return None


def replication(layout: SeqLayout) -> int:
    """N_rep: how many ranks of a lane hold each token at a border (tp, unless sequence parallel)."""
    return 1 if _splits_over_tp(layout) else layout.tp


def held_fraction(layout: SeqLayout) -> float:
    """The share of the sequence one rank holds at a border: 1 / N_part."""
    return replication(layout) / (layout.tp * layout.cp)


def attention_ranges(layout: SeqLayout, pos: int, seq: int) -> tuple[Range, ...]:
    """The tokens the cp rank of lane position `pos` attends from (its tp group's union)."""
    problem = layout_problem(layout, seq)
    if problem:
        raise ValueError(f"seq {seq}: {problem[1]}, which does not divide it")
    c, k = pos // layout.tp, layout.cp
    if k == 1:
        return ((0, seq),)
    if not _zigzag(layout):
        n = seq // k
        return ((c * n, (c + 1) * n),)
    n = seq // (2 * k)
    return _merged(((c * n, (c + 1) * n), ((2 * k - 1 - c) * n, (2 * k - c) * n)))


def boundary_ranges(layout: SeqLayout, pos: int, seq: int) -> tuple[Range, ...]:
    """The token ranges the rank at lane position `pos` holds at a ministage border, in local order."""
    local = attention_ranges(layout, pos, seq)
    if not _splits_over_tp(layout):
        return local
    part = held_length(local) // layout.tp
    start = (pos % layout.tp) * part
    return _global_ranges(local, start, start + part)


@dataclass(frozen=True, slots=True)
class BorderLayout:
    """A `SeqLayout` by value (the planner's candidates, the parts of Note [scatter-gather borders])."""

    tp: int
    cp: int = 1
    cp_kind: CPKind = CPKind.ULYSSES
    sequence_parallel: bool = False


def _scattered(layout: SeqLayout) -> BorderLayout:
    """`layout` with sequence parallelism on: the parts a border's scatter-gather sends."""
    return BorderLayout(layout.tp, layout.cp, layout.cp_kind, sequence_parallel=True)


def gathers_at_border(layout: SeqLayout, seq: int) -> bool:
    """Whether a rank of this layout receives a boundary tensor as its tp part and all-gathers it over its tp
    group (Note [scatter-gather borders]): tokens replicated over tp > 1 ranks, and `seq` splits into parts."""
    return replication(layout) > 1 and layout_problem(_scattered(layout), seq) is None


def border_copies(layout: SeqLayout, seq: int) -> int:
    """How many copies of each token a lane of this layout receives over a border: its replication, or one
    where its tp group gathers the parts (Note [scatter-gather borders])."""
    return 1 if gathers_at_border(layout, seq) else replication(layout)


def arrival_ranges(layout: SeqLayout, pos: int, seq: int) -> tuple[Range, ...]:
    """The tokens the rank at lane position `pos` receives of a boundary tensor from another stage: its
    held ranges, or under Note [scatter-gather borders] its tp part of them."""
    if gathers_at_border(layout, seq):
        return boundary_ranges(_scattered(layout), pos, seq)
    return boundary_ranges(layout, pos, seq)


def _merged(ranges: Sequence[Range]) -> tuple[Range, ...]:
    """Join ranges that continue each other (the middle ring rank's two chunks are one run)."""
    out: list[Range] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _global_ranges(held: Sequence[Range], start: int, stop: int) -> tuple[Range, ...]:
    """The full-sequence ranges of local positions [start, stop) of a tensor holding `held`."""
    out, offset = [], 0
    for a, b in held:
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return _merged(out)


def held_length(ranges: Sequence[Range]) -> int:
    return sum(b - a for a, b in ranges)


def local_slice(held: Sequence[Range], piece: Range) -> slice:
    """Where the tokens of `piece` sit in a tensor holding `held`; the piece lies inside one held range."""
    offset = 0
    for a, b in held:
        if a <= piece[0] and piece[1] <= b:
            return slice(offset + piece[0] - a, offset + piece[1] - a)
        offset += b - a
    raise ValueError(f"tokens {piece[0]}:{piece[1]} are not inside one of the held ranges {list(held)}")


def positions(ranges: Sequence[Range]) -> list[int]:
    """The token positions of `ranges`, in local order (RoPE angles, learned position embeddings)."""
    return [t for a, b in ranges for t in range(a, b)]


def describe(ranges: Sequence[Range]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges) or "nothing"


def tiling_problem(pieces: Sequence[Range], needed: Sequence[Range]) -> str | None:
    """Why `pieces` do not cover exactly the tokens of `needed`, each once, or None."""
    ordered = sorted(pieces)
    for (_, b), (c, d) in pairwise(ordered):
        if c < b:
            return f"tokens {c}:{min(b, d)} arrive twice"
    if _merged(ordered) != _merged(sorted(needed)):
        return f"the pieces cover tokens {describe(_merged(ordered))} but this rank holds {describe(needed)}"
    return None


@dataclass(frozen=True, slots=True)
class Piece:
    """One point-to-point message of a border: tokens `seq` from lane position `giver` to `needer`.

    `seq` is None when the message is the giver's whole local tensor and
    exactly what the needer holds (the two sides agree: a plain p2p send).
    """

    giver: int
    needer: int
    seq: Range | None


def transfers(giving: Sequence[Sequence[Range]], needing: Sequence[Sequence[Range]]) -> list[Piece]:
    """The messages that give every needing position its ranges, each token exactly once.

    `giving[p]` are the ranges lane position p of one side holds, `needing[q]`
    those position q of the other side needs. A piece comes from position q
    itself when it holds it, else from the holder after q in rotation (which
    spreads a replicated side's sends over its ranks). Pieces stay inside one
    held range of their giver and one needed range of their needer, so both
    ends are contiguous slices. ValueError when some needed token is held by
    no giver.
    """
    out: list[Piece] = []
    for q, needed in enumerate(needing):
        if q < len(giving) and tuple(giving[q]) == tuple(needed):
            out.append(Piece(q, q, None))
            continue
        for rng in needed:
            out += _cover(rng, q, giving)
    return out


def _cover(rng: Range, q: int, giving: Sequence[Sequence[Range]]) -> list[Piece]:
    cuts = sorted({rng[0], rng[1], *(e for held in giving for r in held for e in r if rng[0] < e < rng[1])})
    pieces: list[tuple[int, Range, Range]] = []    # (giver, its held range, tokens)
    n = len(giving)
    for a, b in pairwise(cuts):
        holders = [(p, r) for p, held in enumerate(giving) for r in held if r[0] <= a and b <= r[1]]
        if not holders:
            raise ValueError(f"tokens {a}:{b} are needed by lane position {q} but held by no position "
                             "of the other side")
        giver, held = min(holders, key=lambda h: (h[0] - q) % n)
        if pieces and pieces[-1][0] == giver and pieces[-1][1] == held:
            pieces[-1] = (giver, held, (pieces[-1][2][0], b))
        else:
            pieces.append((giver, held, (a, b)))
    return [Piece(giver, q, tokens) for giver, _, tokens in pieces]
