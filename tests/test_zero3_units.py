"""ZeRO-3 gathers per block (Note [zero-3 units]): below ZeRO-2 by explain and by the compiled program."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.verify import verify
from hetc.passes.verify.memory import rank_peaks
from hetc.ir.program import AllGather, Free, Unit
from hetc.runtime.checkpoint import latest_checkpoint
from tests.conftest import DEMO, REFERENCE_STEPS
from tests.costspecs import plan_text, write_spec
from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, assert_params_close, compile_plans

# one stage, one ministage of every layer, 8 lanes on one node of 8 GPUs; 1F1B by default
ONE_MINISTAGE = """
  zero = {level}
  stage all {{
    layers = embed..head
    ranks = n
    lanes = 8
  }}
"""


def _spec(tmp_path, level: int):
    return write_spec(tmp_path, plan_text(ONE_MINISTAGE.format(level=level), global_batch=16),
                      f"zero{level}.het")


def _compiled(tmp_path, level: int):
    """(explain's per-rank totals, the verified program's per-rank peaks, the program, the cost model)."""
    _, checked = load_checked(_spec(tmp_path, level))
    costs = CostModel(checked.explicit())
    program = lower(checked.explicit(), costs=costs)
    verify(program, checked.explicit(), costs)
    peaks = rank_peaks(program, checked.pipeline, costs)
    return [m.total for m in costs.estimate().memory], peaks, program, costs


def test_zero3_with_one_ministage_needs_less_memory_than_zero2(tmp_path):
    explain2, peaks2, _, _ = _compiled(tmp_path, 2)
    explain3, peaks3, program, costs = _compiled(tmp_path, 3)
    for rank in range(8):
        assert explain3[rank] < explain2[rank], rank
        assert peaks3[rank].total < peaks2[rank].total, rank
        assert peaks3[rank].total == pytest.approx(explain3[rank], rel=0.10), rank
    # the saving is the parameters: ZeRO-2 holds them whole, ZeRO-3 a shard and at most two layers gathered
    shard = program.ranks[0].shards[0]
    assert shard.units == tuple(Unit(i, i + 1) for i in range(costs.model.num_model_layers))
    largest = max(costs.unit_param_bytes(u, 0) for u in shard.units)
    assert peaks3[0].parts["gathered"] <= 2 * largest < costs.param_bytes(0, 0)


def test_forward_gathers_the_next_block_while_one_computes_and_frees_after_use(tmp_path):
    _, _, program, _ = _compiled(tmp_path, 3)
    gathered: set[Unit | None] = set()
    most = 0
    for instr in program.ranks[0].instrs:
        if isinstance(instr, AllGather) and instr.group.endswith((".f", ".b")):
            gathered.add(instr.unit)
        elif isinstance(instr, Free):
            gathered.discard(instr.unit)
        most = max(most, len(gathered))
    assert most == 2 and not gathered


def test_explain_shows_zero3_below_zero2(tmp_path, capsys):
    totals = {}
    for level in (2, 3):
        assert main(["explain", str(_spec(tmp_path, level)), "--json"]) == 0
        totals[level] = [m["total"] for m in json.loads(capsys.readouterr().out)["memory"]]
    assert all(t3 < t2 for t2, t3 in zip(totals[2], totals[3], strict=True))
    assert main(["explain", str(_spec(tmp_path, 3))]) == 0
    text = capsys.readouterr().out
    assert "ZeRO-3 over 8 lanes, gathered per layer (10 units)" in text


# Per-block ZeRO-3 beside tensor parallelism (each unit's module wired to the tp group) and in a GPipe
# pipeline of two stages; the demo folder's zero3 and hsdp plans cover one stage (test_plan_invariance.py).
RUNTIME_PLANS = {
    "tp2_zero3": """
  zero = 3
  stage all {
    layers = embed..head
    ranks = host
    lanes = 2
    tp = 2
  }""",
    "gpipe_zero3": """
  schedule = gpipe
  zero = 3
  stage a {
    layers = embed..block1
    ranks = host[0]
    lanes = 2
  }
  stage b {
    layers = block2..head
    ranks = host[1]
    lanes = 2
  }""",
}


@pytest.mark.parametrize("name", RUNTIME_PLANS)
def test_per_block_zero3_trains_to_the_reference(name, rank_pool, demo_reference, tmp_path):
    spec = write_spec(tmp_path, f'use "{DEMO / "job.het"}"\nparallel {{{RUNTIME_PLANS[name]}\n}}\n', f"{name}.het")
    plan_dir = compile_plans([spec], tmp_path / "out")[name]
    assert "units=" in (plan_dir / "programs" / "rank-0000.txt").read_text()
    reports = rank_pool.run(PlanJob(plan_dir, REFERENCE_STEPS, save_to=tmp_path / "ckpt"))
    assert_losses_close(agreed_losses(reports), demo_reference.losses)
    assert_params_close(latest_checkpoint(tmp_path / "ckpt"), demo_reference.params)
