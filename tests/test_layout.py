"""Block layout contracts (hetc/ir/layout.py): held ranges per layout and the pieces of a border."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetc.ir.layout import (Piece, arrival_ranges, attention_ranges, border_copies, boundary_ranges,
                            gathers_at_border, layout_problem, local_slice, positions, seq_chunks, transfers)
from hetc.ir.spec import CPKind


@dataclass(frozen=True)
class L:
    tp: int = 1
    cp: int = 1
    cp_kind: CPKind = CPKind.RING
    sequence_parallel: bool = False


def lane(layout: L, seq: int) -> list[tuple[tuple[int, int], ...]]:
    return [boundary_ranges(layout, pos, seq) for pos in range(layout.tp * layout.cp)]


def test_tensor_parallelism_replicates_the_whole_sequence():
    assert lane(L(tp=2), 32) == [((0, 32),), ((0, 32),)]


def test_ulysses_holds_contiguous_slices_in_cp_order():
    assert lane(L(cp=4, cp_kind=CPKind.ULYSSES), 32) == [((0, 8),), ((8, 16),), ((16, 24),), ((24, 32),)]


def test_ring_attention_holds_zigzag_chunks():
    assert lane(L(cp=2), 32) == [((0, 8), (24, 32)), ((8, 24),)]     # chunks 1 and 2 are one run
    assert boundary_ranges(L(cp=4), 1, 32) == ((4, 8), (24, 28))


def test_sequence_parallelism_splits_the_cp_ranks_tokens_over_tp():
    assert lane(L(tp=2, sequence_parallel=True), 32) == [((0, 16),), ((16, 32),)]
    # lane positions are cp-major: pos = cp_rank * tp + tp_rank; the split is of the concatenation
    assert lane(L(tp=2, cp=2, sequence_parallel=True), 32) == [((0, 8),), ((24, 32),), ((8, 16),), ((16, 24),)]
    assert boundary_ranges(L(tp=4, cp=2, sequence_parallel=True), 1, 32) == ((4, 8),)
    # the attention still sees the whole cp rank's tokens
    assert attention_ranges(L(tp=2, cp=2, sequence_parallel=True), 1, 32) == ((0, 8), (24, 32))


def test_a_replicated_lane_receives_its_tp_part_and_gathers_the_rest():
    """Note [scatter-gather borders]: what each tp rank receives is the part sequence parallelism would hold;
    the parts of a lane's tp group concatenate, in tp order, to the tokens each of them holds."""
    replicated = L(tp=2, cp=2)
    assert [arrival_ranges(replicated, pos, 32) for pos in range(4)] == [((0, 8),), ((24, 32),), ((8, 16),),
                                                                         ((16, 24),)]
    for cp_rank in range(2):
        parts = [arrival_ranges(replicated, cp_rank * 2 + t, 32) for t in range(2)]
        assert positions([r for part in parts for r in part]) == \
            positions(boundary_ranges(replicated, cp_rank * 2, 32))
    assert gathers_at_border(L(tp=4), 32) and border_copies(L(tp=4), 32) == 1
    # whole where the tokens do not split over tp, or are not replicated: no gather
    assert not gathers_at_border(L(tp=3), 32) and arrival_ranges(L(tp=3), 1, 32) == ((0, 32),)
    assert border_copies(L(tp=3), 32) == 3
    for held_once in (L(tp=2, sequence_parallel=True), L(cp=2), L()):
        assert not gathers_at_border(held_once, 32)
        width = range(held_once.tp * held_once.cp)
        assert [arrival_ranges(held_once, p, 32) for p in width] == [boundary_ranges(held_once, p, 32) for p in width]


def test_granularity_and_problems():
    assert seq_chunks(L(tp=2, cp=2, sequence_parallel=True)) == 8
    assert seq_chunks(L(tp=2, cp=3, cp_kind=CPKind.ULYSSES)) == 3
    assert layout_problem(L(cp=6), 42) == ("cp", ("ring attention with cp (6) cuts the sequence into 2·cp = 12 "
                                                  "zigzag chunks"))
    assert layout_problem(L(cp=3), 32) == ("cp", "cp (3) cuts the sequence into 3 slices")
    assert layout_problem(L(tp=3, cp=2, sequence_parallel=True, cp_kind=CPKind.ULYSSES), 32) == \
        ("tp", "sequence parallelism splits each cp rank's 16 tokens over tp (3) ranks")
    assert layout_problem(L(tp=3), 32) is None       # replicated: any tp
    with pytest.raises(ValueError, match="does not divide"):
        boundary_ranges(L(cp=3), 0, 32)


def test_local_slices_and_positions():
    held = ((4, 8), (24, 28))
    assert local_slice(held, (26, 28)) == slice(6, 8)
    assert positions(((0, 2), (6, 8))) == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="not inside one"):
        local_slice(((0, 8), (24, 32)), (4, 26))


def test_agreeing_sides_send_whole_tensors():
    ring = lane(L(cp=2), 32)
    assert transfers(ring, ring) == [Piece(0, 0, None), Piece(1, 1, None)]


def test_tp_to_ring_cp_takes_pieces_from_the_same_position():
    pieces = transfers(lane(L(tp=2), 32), lane(L(cp=2), 32))
    assert pieces == [Piece(0, 0, (0, 8)), Piece(0, 0, (24, 32)), Piece(1, 1, (8, 24))]


def test_ring_cp_to_tp_gives_every_replica_the_whole_sequence():
    pieces = transfers(lane(L(cp=2), 32), lane(L(tp=2), 32))
    assert pieces == [Piece(0, 0, (0, 8)), Piece(1, 0, (8, 24)), Piece(0, 0, (24, 32)),
                      Piece(0, 1, (0, 8)), Piece(1, 1, (8, 24)), Piece(0, 1, (24, 32))]


def test_a_token_nobody_holds_is_an_error():
    with pytest.raises(ValueError, match="tokens 16:32 are needed by lane position 0"):
        transfers([((0, 16),)], [((0, 32),)])


LAYOUTS = st.builds(L, tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 4]),
                    cp_kind=st.sampled_from(list(CPKind)), sequence_parallel=st.booleans())


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUTS, LAYOUTS)
def test_pieces_tile_every_needed_range_exactly_once(a, b):
    seq = 64
    giving, needing = lane(a, seq), lane(b, seq)
    got: dict[int, list[tuple[int, int]]] = {q: [] for q in range(len(needing))}
    for piece in transfers(giving, needing):
        held = giving[piece.giver]
        if piece.seq is None:
            assert held == needing[piece.needer]
            got[piece.needer] += list(held)
            continue
        local_slice(held, piece.seq)                      # contiguous at the giver
        local_slice(needing[piece.needer], piece.seq)     # and at the needer
        got[piece.needer].append(piece.seq)
    for q, needed in enumerate(needing):
        assert sorted(t for a_, b_ in got[q] for t in range(a_, b_)) == sorted(positions(needed))
