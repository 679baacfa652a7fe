"""The schedule visualizer: terminal grid, Chrome trace, HTML page in headless Chromium."""

from __future__ import annotations

from hetc.program import Program, RankProgram, parse_instr
from hetc.viz.grid import render_grid, short_text


def _tiny_program() -> Program:
    rank0 = ["load mb=0", "fwd ms=0 mb=0", "send act ms=0 mb=0 to=1 shape=2x32x64", "fwd ms=0 mb=1",
             "send act ms=0 mb=1 to=1 shape=2x32x64 h=3", "wait h=3", "recv grad ms=1 mb=0 from=1 shape=2x32x64",
             "bwd ms=0 mb=0", "step ms=0"]
    rank1 = ["recv act ms=0 mb=0 from=0 shape=2x32x64", "fwd ms=1 mb=0", "bwd ms=1 mb=0",
             "send grad ms=1 mb=0 to=0 shape=2x32x64", "step ms=1"]
    text0 = "rank 0 stage=0 lane=0 tp_rank=0 cp_rank=0\n" + "\n".join(rank0)
    text1 = "rank 1 stage=1 lane=0 tp_rank=0 cp_rank=0\n" + "\n".join(rank1)
    return Program((RankProgram.from_text(text0), RankProgram.from_text(text1)), ())


def test_grid_has_a_column_per_rank_and_a_row_per_instruction():
    lines = render_grid(_tiny_program()).splitlines()
    assert "rank 0 s0/l0" in lines[0] and "rank 1 s1/l0" in lines[0]
    assert len(lines) == 1 + 9
    assert lines[1].split()[:2] == ["step", "0:"] and "recv act ms=0 mb=0 from=0" in lines[1]
    assert "shape=" not in "\n".join(lines)  # shortened cells
    assert "ERROR" not in "\n".join(lines)


def test_grid_marks_focus_with_context_and_gaps():
    text = render_grid(_tiny_program(), focus={0: 6, 1: 2}, context=1)
    lines = text.splitlines()
    marked = [line for line in lines if "<-- ERROR HERE" in line]
    assert len(marked) == 2
    assert "> recv grad ms=1 mb=0 from=1" in marked[1] and marked[1].endswith("(rank 0)")
    assert "> bwd ms=1 mb=0" in marked[0]
    shown = [line.split()[1] for line in lines[1:] if line.startswith("step")]
    assert shown == ["1:", "2:", "3:", "5:", "6:", "7:"]
    assert lines[1] == "..." and lines[-1] == "..."
    # all markers line up in one column
    assert len({line.index("<--") for line in marked}) == 1


def test_grid_focus_past_the_end_and_only_focus_columns():
    text = render_grid(_tiny_program(), focus={1: 5}, context=2)
    assert "rank 0" not in text
    assert "> (end of program)" in text and "ERROR HERE" in text and "(rank" not in text


def test_short_text_cuts_long_instructions():
    instr = parse_instr("reduce_scatter grads ms=12 group=stage12_lanes_with_a_long_name h=7")
    assert len(short_text(instr)) == 28 and short_text(instr).endswith("~")
    assert short_text(instr, width=200) == str(instr)
