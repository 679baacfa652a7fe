"""The Program IR: every instruction's text and JSON round trip, listings, and located format errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetc.ir.program import (INSTR_TYPES, AllGather, AllReduce, AllToAll, Backward, BackwardInput,
                          BackwardWeight, Forward, Free, Group, Load, Offload, Prefetch, Program,
                          ProgramFormatError, RankProgram, Recv, ReduceScatter, Send, Shard, Step, Tensor,
                          Unit, Wait, instr_from_json, parse_instr)
from tests.plans import DEMO_PLANS, TEST_PLANS, compile_plan, plan_id

# one or more instances of every kind, with optional fields both set and left out
EXAMPLES = [
    Load(3), Forward(0, 1), Backward(2, 5), BackwardInput(1, 0), BackwardWeight(1, 0),
    Send(Tensor.ACT, 0, 1, 2, (2, 32, 64)), Send(Tensor.GRAD, 3, 0, 1, (4, 8, 64), handle=7),
    Recv(Tensor.ACT, 0, 1, 0, (2, 32, 64), handle=0), Recv(Tensor.GRAD, 2, 3, 5, (1, 16, 8)),
    AllGather(Tensor.PARAMS, 1, "dp.s0.p0", 4), AllGather(Tensor.PARAMS, 0, "dpx.s1.p0.i1"),
    ReduceScatter(Tensor.GRADS, 2, "dp.s0.p0.b", 9), ReduceScatter(Tensor.GRADS, 0, "dp.s0.p0.n1"),
    AllReduce(Tensor.GRADS, "dp.s1.p0", 3, 2), AllReduce(Tensor.LOSS, "world"), AllReduce(Tensor.NORM, "world"),
    AllToAll(Tensor.ACT, 1, 2, "cp.s0.l0", 11), AllToAll(Tensor.GRAD, 0, 0, "cp.s0.l0"),
    Offload(Tensor.PARAMS, 2, None, 13), Offload(Tensor.ACT, 0, 4, 20), Prefetch(Tensor.PARAMS, 1),
    Prefetch(Tensor.ACT, 1, 2, 25), Free(Tensor.PARAMS, 3), Step(0), Wait(12),
    # ZeRO-3 units (Note [units])
    Forward(0, 1, Unit(1, 2)), Backward(0, 1, Unit(0, 1)), AllGather(Tensor.PARAMS, 0, "dp.s0.p0.f", 5, Unit(2, 3)),
    Free(Tensor.PARAMS, 0, Unit(2, 3)), ReduceScatter(Tensor.GRADS, 0, "dp.s0.p0.b", 6, Unit(3, 4)),
    AllReduce(Tensor.GRADS, "dpx.s0.p0.i0", 0, None, Unit(3, 4)),
]


def test_examples_cover_every_instruction_kind():
    assert {type(i) for i in EXAMPLES} == set(INSTR_TYPES.values())


@pytest.mark.parametrize("instr", EXAMPLES, ids=str)
def test_text_round_trip(instr):
    text = str(instr)
    assert "\n" not in text and text.split()[0] == instr.OP
    assert parse_instr(text) == instr
    assert parse_instr("  " + text.replace(" ", "   ") + " ") == instr   # spacing is free


@pytest.mark.parametrize("instr", EXAMPLES, ids=str)
def test_json_round_trip(instr):
    obj = json.loads(json.dumps(instr.to_json()))
    assert obj["op"] == instr.OP
    assert instr_from_json(obj) == instr


def test_text_form_examples():
    assert str(Send(Tensor.ACT, 0, 1, 2, (2, 32, 64), handle=3)) == "send act ms=0 mb=1 to=2 shape=2x32x64 h=3"
    piece = Recv(Tensor.GRAD, 1, 0, 3, (2, 8, 64), handle=4, seq=(24, 32))
    assert str(piece) == "recv grad ms=1 mb=0 from=3 shape=2x8x64 seq=24:32 h=4"
    assert parse_instr(str(piece)) == piece
    with pytest.raises(ValueError, match="bad token range '8:8'"):
        parse_instr("recv act ms=0 mb=0 from=1 shape=2x8x64 seq=8:8")
    assert str(AllReduce(Tensor.LOSS, "world")) == "all_reduce loss group=world"
    assert str(Offload(Tensor.PARAMS, 2, None, 13)) == "offload params ms=2 h=13"
    gather = AllGather(Tensor.PARAMS, 0, "dp.s0.p0.f", 3, Unit(1, 2))
    assert str(gather) == "all_gather params ms=0 group=dp.s0.p0.f unit=1:2 h=3"
    assert gather.to_json()["unit"] == [1, 2]
    with pytest.raises(ValueError, match="bad unit '2:2'"):
        parse_instr("fwd ms=0 mb=0 unit=2:2")
    with pytest.raises(ValueError, match="bad unit '3'"):
        parse_instr("free params ms=0 unit=3")


def test_shard_units_round_trip():
    shard = Shard(0, 3, "dp.s0.p0", units=(Unit(0, 1), Unit(1, 2)))
    assert str(shard).endswith(" units=0:1,1:2")
    rp = RankProgram(0, 0, 0, 0, 0, (shard,), (Forward(0, 0, Unit(0, 1)),))
    assert RankProgram.from_text(rp.to_text()) == rp
    assert RankProgram.from_json(json.loads(json.dumps(rp.to_json()))) == rp


_small = st.integers(min_value=0, max_value=10_000)
_group = st.from_regex(r"[a-z][a-z0-9.]{0,12}", fullmatch=True)
_shape = st.lists(st.integers(min_value=1, max_value=4096), min_size=1, max_size=4).map(tuple)
_seq = st.tuples(_small, st.integers(min_value=1, max_value=4096)).map(lambda t: (t[0], t[0] + t[1]))
_unit = st.builds(lambda first, n: Unit(first, first + n), _small, st.integers(min_value=1, max_value=64))


def _instances(cls):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "what":
            kwargs[f.name] = st.sampled_from(cls.WHAT)
        elif f.name == "group":
            kwargs[f.name] = _group
        elif f.name == "shape":
            kwargs[f.name] = _shape
        elif f.name == "seq":
            kwargs[f.name] = st.none() | _seq
        elif f.name == "unit":
            kwargs[f.name] = st.none() | _unit
        elif f.default is None:
            kwargs[f.name] = st.none() | _small
        else:
            kwargs[f.name] = _small
    return st.builds(cls, **kwargs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(*[_instances(cls) for cls in INSTR_TYPES.values()]))
def test_generated_instructions_round_trip(instr):
    assert parse_instr(str(instr)) == instr
    assert instr_from_json(json.loads(json.dumps(instr.to_json()))) == instr


PLANS = DEMO_PLANS + TEST_PLANS


@pytest.mark.parametrize("path", PLANS, ids=plan_id)
def test_listing_round_trip(path):
    program = compile_plan(path).program
    for rp in program.ranks:
        assert RankProgram.from_text(rp.to_text()) == rp
        assert RankProgram.from_json(json.loads(json.dumps(rp.to_json()))) == rp
    assert Program.from_json(program.to_json()) == program
    assert Program.parse_groups(program.groups_text()) == program.groups


def test_listing_is_editable_by_hand():
    rp = compile_plan(DEMO_PLANS[0]).program.ranks[0]
    lines = rp.to_text().splitlines()
    edited = [lines[0], "# a comment line", *lines[1:]]
    edited = [line.split(None, 1)[1] if line.strip()[:1].isdigit() else line for line in edited]   # no index column
    assert edited[-1].startswith("all_reduce")
    edited[-1] += "   # trailing comment"
    assert RankProgram.from_text("\n".join(edited) + "\n\n") == rp


def test_shard_lines_round_trip():
    for shard in [Shard(0, 3, "dp.s0.p0", None, 0, True, False, True), Shard(2, 0),
                  Shard(1, 1, "dp.s1.t0", tp_group="tp.s1.l0.c0", cp_group="cp.s1.l0.t0"),
                  Shard(1, 3, "dp.s0.p0.n1", "dpx.s0.p0.i0", 1, False, True, False)]:
        rp = RankProgram(0, 0, 0, 0, 0, (shard,), (Step(shard.ms),))
        assert RankProgram.from_text(rp.to_text()) == rp


HEADER = "rank 1 stage=0 lane=1 tp_rank=0 cp_rank=0\n"
BAD_LISTINGS = [
    (HEADER + "    0  fwd ms=0 mb=0\n    1  jump ms=1\n", 3, "unknown instruction 'jump'"),
    (HEADER + "fwd ms=0\n", 2, "missing mb"),
    (HEADER + "load mb=0\nsend act ms=0 mb=0 to=1 shape=2xx4\n", 3, "bad shape"),
    (HEADER + "send act ms=0 mb=0 to=1 shape=2x0x4\n", 2, "bad shape"),
    (HEADER + "step ms=-1\n", 2, "must not be negative"),
    (HEADER + "step ms=one\n", 2, "whole number"),
    (HEADER + "send params ms=0 mb=0 to=1 shape=2\n", 2, "takes act, grad"),
    (HEADER + "all_gather ms=0 group=g\n", 2, "needs one of params"),
    (HEADER + "fwd ms=0 mb=0 mb=1\n", 2, "given twice"),
    (HEADER + "fwd ms=0 mb=0 color=red\n", 2, "unexpected 'color=red'"),
    (HEADER + "all_reduce loss group=\n", 2, "empty group name"),
    (HEADER + "\n\nshard ms=0 zero=1 group=g outer=- outer_zero=0 sparkly\n", 4, "unknown shard flag"),
    (HEADER + "shard ms=0 zero=1\n", 2, "bad shard line"),
    ("rank one stage=0 lane=0 tp_rank=0 cp_rank=0\n", 1, "bad header"),
    ("rank 0 stage=0 lane=0\n", 1, "bad header"),
    ("# no header\nfwd ms=0 mb=0\n", 1, "no 'rank N ...' header"),
]


@pytest.mark.parametrize("text, line, message", BAD_LISTINGS, ids=[m for _, _, m in BAD_LISTINGS])
def test_bad_listing_names_the_line(text, line, message):
    with pytest.raises(ProgramFormatError) as err:
        RankProgram.from_text(text, source="rank-0001.txt")
    assert err.value.line == line
    assert message in str(err.value)
    assert str(err.value).startswith(f"rank-0001.txt:{line}: ")


@pytest.mark.parametrize("text, line", [("group world = [0, 1]\ngroup dp [0]\n", 2),
                                        ("group a = [0, x]\n", 1), ("grp a = [0]\n", 1)])
def test_bad_group_table_names_the_line(text, line):
    with pytest.raises(ProgramFormatError) as err:
        Program.parse_groups(text, "groups.txt")
    assert err.value.line == line


def test_group_table_round_trip():
    groups = (Group("world", (0, 1, 2, 3)), Group("dp.s0.p0", (0, 1)), Group("empty", ()))
    assert Program.parse_groups(Program((), groups).groups_text()) == groups


def test_replace_rank_keeps_the_rest():
    program = compile_plan(DEMO_PLANS[0]).program
    changed = program.replace_rank(1, program.ranks[1].instrs[:-1])
    assert changed.ranks[1].instrs == program.ranks[1].instrs[:-1]
    assert changed.ranks[0] is program.ranks[0] and changed.groups == program.groups
