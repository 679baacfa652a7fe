"""Group identity (hetc/ir/groups.py) and the program's closed sets of phases and collectives."""

from hetc.ir.groups import WORLD, Axis, Direction, GroupId, GroupKind, split_direction, with_direction
from hetc.ir.program import COLLECTIVE_OF, COLLECTIVE_TYPES, PHASE_OF, Collective, Phase


def test_group_ids_render_the_names_of_note_group_names():
    dp = GroupId(GroupKind.DP, 2).at(Axis.POS, 1)
    assert str(dp) == "dp.s2.p1"
    assert str(dp.at(Axis.NODE, 0).per_microbatch(Direction.BACKWARD)) == "dp.s2.p1.n0.b"
    assert str(dp.of_kind(GroupKind.DPX).at(Axis.SHARD, 3)) == "dpx.s2.p1.i3"
    assert str(GroupId(GroupKind.TP, 0).at(Axis.LANE, 4).at(Axis.CP_RANK, 1)) == "tp.s0.l4.c1"
    assert str(WORLD) == "world"


def test_a_per_microbatch_copy_belongs_to_its_group_whatever_the_name():
    assert split_direction("dp.s0.p1.f") == ("dp.s0.p1", Direction.FORWARD)
    assert split_direction("my-group.b") == ("my-group", Direction.BACKWARD)
    assert split_direction("dp.s0.p1") == ("dp.s0.p1", None)
    assert split_direction("buffer") == ("buffer", None)
    for name in ("dp.s0.p1", "x"):
        for direction in Direction:
            assert split_direction(with_direction(name, direction)) == (name, direction)


def test_every_collective_instruction_has_its_kind_and_every_compute_op_its_phase():
    assert {COLLECTIVE_OF[t].value for t in COLLECTIVE_TYPES} == {t.OP for t in COLLECTIVE_TYPES}
    assert all(COLLECTIVE_OF[t] == t.OP for t in COLLECTIVE_TYPES)
    assert set(COLLECTIVE_OF.values()) == set(Collective)
    assert set(PHASE_OF.values()) == set(Phase)
