"""torch.distributed.pipelining accepts every exported pipeline (compute_comms CSV).

Each lane-aligned plan, lowered under GPipe, 1F1B, interleaved 1F1B and
ZB-H1, exports one CSV per lane; each is parsed with torch's own
`_Action.from_str` and must pass `_validate_schedule` (every stage runs every
microbatch forward and backward in a valid order, one rank per stage) and
`_simulate_comms_compute` (the sends and receives let every rank progress).
These are private torch functions: the test is pinned to the torch version
it was written against and skips, saying why, on any other.
"""

from __future__ import annotations

import csv
import io
import re

import pytest

from hetc.cli import main
from hetc.passes.export_torch import TorchPipeline, lanes_aligned, torch_pipelines
from hetc.ir.spec import ScheduleKind
from tests.conftest import DEMO
from tests.plans import DEMO_PLANS, TEST_PLANS, compile_plan, plan_id

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

PINNED_TORCH = "2.13.0"
_NEEDED = ("_Action", "_validate_schedule", "_simulate_comms_compute")
if torch.__version__.split("+")[0] != PINNED_TORCH:
    pytest.skip(f"written against torch {PINNED_TORCH}'s private pipelining functions; this is torch "
                f"{torch.__version__}", allow_module_level=True)
if not all(hasattr(schedules, name) for name in _NEEDED):
    pytest.skip(f"torch {torch.__version__} lacks {', '.join(n for n in _NEEDED if not hasattr(schedules, n))}",
                allow_module_level=True)

KINDS = [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED, ScheduleKind.ZB]
PLANS = [p for p in DEMO_PLANS + TEST_PLANS if plan_id(p) != "specs/zorse16"]   # zorse16: Zorse only


def _actions(text: str) -> dict[int, list]:
    rows = list(csv.reader(io.StringIO(text)))
    return {rank: [schedules._Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}


def _torch_accepts(tp: TorchPipeline, text: str | None = None) -> None:
    actions = _actions(tp.csv() if text is None else text)
    mapping = schedules._validate_schedule(actions, len(actions), tp.num_stages, tp.num_microbatches)
    assert mapping == tp.stage_to_rank
    schedules._simulate_comms_compute(actions, lambda stage: tp.stage_to_rank[stage], tp.num_stages)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("path", PLANS, ids=plan_id)
def test_torch_accepts_every_exported_pipeline(path, kind):
    lowered = compile_plan(path, kind)
    exported = torch_pipelines(lowered.program, lowered.pipeline)
    if not lanes_aligned(lowered.pipeline):
        assert exported == []
        return
    assert len(exported) == len(lowered.pipeline.stages[0].lanes)
    for tp in exported:
        _torch_accepts(tp)
        cells = {re.sub(r"^\d+|\d+$", "", cell) for cell in tp.csv().replace("\n", ",").split(",") if cell}
        compute = {"F", "I", "W"} if kind is ScheduleKind.ZB else {"F", "B"}
        assert compute <= cells
        if len(lowered.pipeline.stages) > 1:
            assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= cells


def test_some_plans_export_multi_stage_pipelines():
    stages = {len(compile_plan(p, k).pipeline.stages) for p in PLANS for k in KINDS}
    assert max(stages) >= 4


def test_torch_rejects_a_broken_export():
    """The harness can fail: drop one receive and torch's simulator sees the pipeline stall."""
    tp = torch_pipelines(*_program_and_pipeline(DEMO / "pp.het"))[0]
    rows = tp.csv().splitlines()
    rows[1] = ",".join(cell for cell in rows[1].split(",") if cell != "1RECV_F0")
    with pytest.raises(ValueError, match="not progressing"):
        _torch_accepts(tp, "\n".join(rows) + "\n")


def _program_and_pipeline(path):
    lowered = compile_plan(path)
    return lowered.program, lowered.pipeline


def test_compile_writes_the_csv_files(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "interleaved.het"), "-o", str(out)]) == 0
    expected = {tp.name: tp.csv() for tp in torch_pipelines(*_program_and_pipeline(DEMO / "interleaved.het"))}
    written = {p.stem: p.read_text() for p in (out / "torch").glob("*.csv")}
    assert written == expected and set(written) == {"lane0", "lane1"}
    hetero = tmp_path / "hetero"
    assert main(["compile", str(DEMO / "hetero.het"), "-o", str(hetero)]) == 0
    assert not (hetero / "torch").exists(), "lanes that do not line up have no torch equivalent"
