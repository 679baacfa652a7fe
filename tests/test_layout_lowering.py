"""Block layouts in the compiled programs: border pieces, tp/cp groups, and what the verifier rejects."""

from __future__ import annotations

import dataclasses

import pytest

from hetc.passes.verify import VerifyError, verify
from hetc.ir.program import Forward, Program, Recv, Send, Wait
from tests.conftest import DEMO
from tests.plans import compile_plan


def _listing(plan: str, rank: int) -> list[str]:
    return [str(i) for i in compile_plan(DEMO / f"{plan}.het").program.ranks[rank].instrs]


def test_a_tp_to_cp_border_sends_each_ring_rank_its_zigzag_chunks():
    # first stage: ranks 0, 1 (TP=2, whole sequence each); second: ranks 2, 3 (ring CP=2)
    sends = [s.rsplit(" h=", 1)[0] for s in _listing("tp_to_cp", 0) if s.startswith("send act ms=0 mb=0")]
    assert sends == ["send act ms=0 mb=0 to=2 shape=2x8x64 seq=0:8",
                     "send act ms=0 mb=0 to=2 shape=2x8x64 seq=24:32"]
    assert [s.rsplit(" h=", 1)[0] for s in _listing("tp_to_cp", 1) if s.startswith("send act ms=0 mb=0")] == \
        ["send act ms=0 mb=0 to=3 shape=2x16x64 seq=8:24"]
    # gradients back: each tp rank receives its half of the tokens (Note [scatter-gather borders]), from the
    # ring ranks holding them, and its tp group gathers the halves
    grads = {r: [s.rsplit(" h=", 1)[0] for s in _listing("tp_to_cp", r) if s.startswith("recv grad ms=1 mb=0")]
             for r in (0, 1)}
    assert grads == {0: ["recv grad ms=1 mb=0 from=2 shape=2x8x64 seq=0:8",
                         "recv grad ms=1 mb=0 from=3 shape=2x8x64 seq=8:16"],
                     1: ["recv grad ms=1 mb=0 from=2 shape=2x8x64 seq=24:32",
                         "recv grad ms=1 mb=0 from=3 shape=2x8x64 seq=16:24"]}


def test_a_tp_border_without_sequence_parallelism_carries_each_tensor_once_in_tp_parts():
    """Megatron's scatter-gather: tp rank t of a lane sends part t of the activation to tp rank t of the
    next lane (and the gradient back), not the whole tensor to each: the border carries it once."""
    messages = {r: [s.rsplit(" h=", 1)[0] for s in _listing("tp2_pp2", r)
                    if " mb=0 " in s and s.startswith(("send", "recv"))] for r in range(4)}
    assert messages == {
        0: ["send act ms=0 mb=0 to=2 shape=2x16x64 seq=0:16", "recv grad ms=1 mb=0 from=2 shape=2x16x64 seq=0:16"],
        1: ["send act ms=0 mb=0 to=3 shape=2x16x64 seq=16:32", "recv grad ms=1 mb=0 from=3 shape=2x16x64 seq=16:32"],
        2: ["recv act ms=0 mb=0 from=0 shape=2x16x64 seq=0:16", "send grad ms=1 mb=0 to=0 shape=2x16x64 seq=0:16"],
        3: ["recv act ms=0 mb=0 from=1 shape=2x16x64 seq=16:32", "send grad ms=1 mb=0 to=1 shape=2x16x64 seq=16:32"]}


def test_agreeing_layouts_send_whole_tensors():
    assert not any("seq=" in s for plan in ("pp", "hetero") for r in range(4) for s in _listing(plan, r))


def test_shard_lines_name_the_compute_groups_and_dp_spans_cp():
    lowered = compile_plan(DEMO / "tp2_cp2.het")
    shard = lowered.program.ranks[1].shards[0]
    assert (shard.group, shard.tp_group, shard.cp_group) == ("dp.s0.t1", "tp.s0.l0.c0", "cp.s0.l0.t1")
    groups = {g.name: g.ranks for g in lowered.program.groups}
    assert groups["tp.s0.l0.c0"] == (0, 1) and groups["cp.s0.l0.t1"] == (1, 3) and groups["dp.s0.t1"] == (1, 3)
    ring = compile_plan(DEMO / "ring2.het").program    # two lanes of cp 2: ZeRO over lanes x cp ranks
    assert {g.name: g.ranks for g in ring.groups}["dp.s0.t0"] == (0, 1, 2, 3)


# ---------------------------------------------------------------- hand-edited programs


def _verify(plan: str, program: Program) -> VerifyError:
    lowered = compile_plan(DEMO / f"{plan}.het")
    with pytest.raises(VerifyError) as caught:
        verify(program, lowered.plan)
    return caught.value


def _edited(plan: str, rank: int, edit) -> Program:
    program = compile_plan(DEMO / f"{plan}.het").program
    return program.replace_rank(rank, tuple(edit(list(program.ranks[rank].instrs))))


def _first(instrs, pred) -> int:
    return next(i for i, instr in enumerate(instrs) if pred(instr))


def _replacing(pred, **changes):
    """An edit that changes fields of the first instruction matching `pred`."""
    def edit(instrs):
        i = _first(instrs, pred)
        instrs[i] = dataclasses.replace(instrs[i], **changes)
        return instrs
    return edit


def test_a_missing_piece_is_rejected_at_the_forward_that_needs_it():
    def drop_piece(instrs):
        i = _first(instrs, lambda x: isinstance(x, Recv) and x.seq == (24, 32))
        h = instrs[i].handle
        return [x for k, x in enumerate(instrs) if k != i and x != Wait(h)]
    program = _edited("tp_to_cp", 2, drop_piece)
    err = _verify("tp_to_cp", program)
    fwd = _first(program.ranks[2].instrs, lambda x: isinstance(x, Forward))
    assert (err.rank, err.index, err.check) == (2, fwd, "dataflow")
    assert "do not tile this rank's tokens: the pieces cover tokens 0:8 but this rank holds 0:8,24:32" in str(err)


def test_a_piece_outside_the_receivers_tokens_is_rejected():
    shift = _replacing(lambda x: isinstance(x, Recv) and x.seq == (0, 8), seq=(4, 12))
    err = _verify("tp_to_cp", _edited("tp_to_cp", 2, shift))
    assert err.rank == 2 and "tokens 4:12 are not inside one range of the tokens this rank receives (0:8,24:32)" \
        in str(err)


def test_a_whole_tensor_across_disagreeing_layouts_is_rejected():
    whole = _replacing(lambda x: isinstance(x, Recv) and x.seq is not None, seq=None, shape=(2, 16, 64))
    err = _verify("tp_to_cp", _edited("tp_to_cp", 2, whole))
    assert err.rank == 2 and "the layouts differ, so the tensor must come in pieces" in str(err)


def test_a_tp_rank_running_its_compute_in_another_order_is_rejected():
    def swap(instrs):     # rank 1 runs its second forward before its first backward; rank 0 does not
        b = _first(instrs, lambda x: type(x).__name__ == "Backward")
        f = [i for i, x in enumerate(instrs) if isinstance(x, Forward)][1]
        return instrs[:b] + instrs[b + 1:f + 1] + [instrs[b]] + instrs[f + 1:]
    err = _verify("tp2", _edited("tp2", 1, swap))
    assert err.check == "protocol" and "collective #1 on group 'tp.s0.l0.c0' differs" in str(err)


def test_a_send_and_a_receive_of_different_pieces_do_not_match():
    other_piece = _replacing(lambda x: isinstance(x, Send) and x.seq == (24, 32), seq=(0, 8))
    err = _verify("tp_to_cp", _edited("tp_to_cp", 0, other_piece))
    assert err.check == "protocol" and err.rank == 2
    assert "receives a different message than is sent; the next message from rank 0 is `send act ms=0 mb=0 to=2 " \
        "shape=2x8x64 seq=0:8" in str(err)


def test_a_whole_tensor_sent_to_a_rank_that_gathers_parts_is_rejected():
    """tp2_pp2: rank 2 receives tokens 0:16 and gathers the rest over its tp group (Note [scatter-gather
    borders]); the whole activation sent to it, as before that Note, is a dataflow fault on both ends' terms."""
    def whole(rank):
        def edit(instrs):
            return [dataclasses.replace(x, seq=None, shape=(2, 32, 64))
                    if isinstance(x, (Send, Recv)) and x.what.value == "act" else x for x in instrs]
        return edit
    program = _edited("tp2_pp2", 0, whole(0))
    program = program.replace_rank(2, tuple(whole(2)(list(program.ranks[2].instrs))))
    err = _verify("tp2_pp2", program)
    assert err.check == "dataflow" and err.rank == 2
    assert "receives rank 0's whole act, tokens 0:32, but this rank receives 0:16" in str(err)


# ---------------------------------------------------------------- the predicted timeline


@pytest.mark.parametrize("plan", ["tp_to_cp", "tp2_cp2", "hetero_tp"])
def test_a_lane_runs_tp_cp_compute_in_lockstep_in_the_timeline(plan):
    from hetc.passes.cost import CostModel
    from hetc.passes.simulate import simulate

    lowered = compile_plan(DEMO / f"{plan}.het")
    timeline = simulate(lowered.program, lowered.plan,
                        CostModel(lowered.plan))
    starts: dict[tuple, set[float]] = {}
    for e in timeline.events:
        stage = lowered.pipeline.stage_of_rank[e.rank]
        if e.text.startswith(("fwd", "bwd")) and stage.tp * stage.cp > 1:
            lane = lowered.pipeline.lane_of_rank[e.rank].ranks
            starts.setdefault((lane, e.text), set()).add(round(e.start, 12))
    assert starts and all(len(s) == 1 for s in starts.values()), \
        {k: s for k, s in starts.items() if len(s) > 1}


def test_a_lane_out_of_rank_order_is_a_located_error_where_the_order_matters(tmp_path):
    from hetc.ir.errors import SpecError
    from hetc.compiler import load_checked
    from hetc.passes.lower import lower

    def compile_text(extra: str):
        spec = tmp_path / "desc.het"
        spec.write_text(f'use "{DEMO / "job.het"}"\nparallel {{\n  stage all {{\n    layers = embed..head\n'
                        f'    ranks = [host[1, 1], host[1, 0]]\n    lanes = 1\n    tp = 2\n{extra}  }}\n'
                        '  idle = [host[0]]\n}\n')
        _, checked = load_checked(spec, require_complete=True)
        return lower(checked.explicit())

    assert compile_text("")            # plain TP all-reduces do not care in which order torch numbers the ranks
    with pytest.raises(SpecError) as caught:
        compile_text("    sequence_parallel = true\n")
    diag = caught.value.diagnostics[0]
    assert (diag.span.line, diag.span.col) == (5, 13)
    assert diag.message == ("the tp ranks of lane 0 of stage 'all' are not in ascending rank order, which sequence "
                            "parallelism needs; list each lane's GPUs in rank order")
