"""Evaluation: the validation loss is the same under every plan, and its program is forward only.

The demo job with `eval_every = 2`, `eval_batches = 2` and 5% of its text
held out is run under several plans on the session's rank pool
(tests/rank_pool.py); every plan's validation losses must equal the
single-process reference trainer's (runtime/reference.py) within 1e-5
relative, and its training losses must be those of the job without
evaluation (evaluating changes nothing).
"""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.compiler import compile_spec
from hetc.passes.lower.forward_only import forward_only
from hetc.passes.verify import VerifyError, verify
from hetc.plandir import read_plan
from hetc.ir.program import Backward, Forward, Recv, Step, Wait
from hetc.runtime.reference import train_reference
from tests.conftest import DEMO, demo_job
from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, compile_plans

STEPS = 4
EVAL_KEYS = "eval_every = 2\n  eval_batches = 2\n  eval_share = 0.05\n"
# What the evaluation program drops or keeps differs by plan: ZeRO-1's gathers after the step and HSDP's
# outer ones (dropped), ZeRO-3's gathers with parameter offload (kept), zero-bubble's split backward,
# offloaded activation stashes, layout pieces between TP and CP, uneven lanes. (All 19 dense demo plans
# pass; these cover every kind of rewrite.)
PLANS = ["single", "zero1", "hsdp", "zero3_offload", "zb", "offload_act", "tp_to_cp", "hetero_tp"]


def eval_job(out, keys: str = EVAL_KEYS) -> None:
    """The demo job with `keys` added to its train block, in `out` (paths made absolute)."""
    (out / "job.het").write_text(demo_job(("train {\n", "train {\n  " + keys)))


@pytest.fixture(scope="module")
def eval_plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_specs")
    eval_job(root)
    for plan in PLANS:
        (root / f"{plan}.het").write_text((DEMO / f"{plan}.het").read_text())
    return compile_plans([root / f"{plan}.het" for plan in PLANS], root / "plans")


@pytest.fixture(scope="module")
def eval_reference(eval_plans):
    _, checked = read_plan(eval_plans["single"])
    return train_reference(checked.spec.model, checked.spec.train, base_dir=eval_plans["single"], steps=STEPS)


@pytest.mark.parametrize("plan", PLANS)
def test_validation_loss_is_plan_invariant(plan, rank_pool, eval_plans, eval_reference):
    reports = rank_pool.run(PlanJob(eval_plans[plan], STEPS))
    assert_losses_close(agreed_losses(reports), eval_reference.losses)
    vals = reports[0].val_losses
    assert all(r.val_losses == vals for r in reports)
    assert len(vals) == STEPS // 2
    assert_losses_close(vals, eval_reference.val_losses)
    assert vals[1] < vals[0], "two more steps of training lower the held-out loss"


def test_evaluating_changes_no_training_step(rank_pool, demo_reference, tmp_path):
    """With an eval block (the training data untouched), a plan that evaluates after every step trains
    exactly like the demo job: evaluation leaves parameters, optimizer state and data order alone."""
    text = DEMO / "data" / "tiny.txt"
    eval_job(tmp_path, f'eval_every = 1\n  eval text {{\n    path = "{text}"\n    shuffle = false\n  }}\n')
    (tmp_path / "zero3.het").write_text((DEMO / "zero3.het").read_text())
    plan = compile_plans([tmp_path / "zero3.het"], tmp_path / "plans")["zero3"]
    reports = rank_pool.run(PlanJob(plan, STEPS))
    assert_losses_close(agreed_losses(reports), demo_reference.losses[:STEPS])
    assert len(reports[0].val_losses) == STEPS


def test_eval_program_is_forward_only_and_verified(tmp_path):
    eval_job(tmp_path)
    (tmp_path / "zb.het").write_text((DEMO / "zb.het").read_text())
    compiled = compile_spec(tmp_path / "zb.het")
    evaluation = forward_only(compiled.program)
    for rp, train_rp in zip(evaluation.ranks, compiled.program.ranks, strict=True):
        assert not any(isinstance(i, (Backward, Step)) for i in rp.instrs)
        assert [i for i in rp.instrs if isinstance(i, Forward)] == \
            [i for i in train_rp.instrs if isinstance(i, Forward)]
    assert compiled.eval_timeline is not None
    assert 0 < compiled.eval_timeline.step_time < compiled.timeline.step_time
    with pytest.raises(VerifyError, match="forward only"):   # the training program is not an eval program
        verify(compiled.program, compiled.plan, forward_only=True)


def test_the_verifier_blames_a_broken_eval_program(tmp_path):
    eval_job(tmp_path)
    (tmp_path / "pp.het").write_text((DEMO / "pp.het").read_text())
    compiled = compile_spec(tmp_path / "pp.het")
    evaluation = forward_only(compiled.program)
    rank = next(rp for rp in evaluation.ranks if any(isinstance(i, Recv) for i in rp.instrs))
    mb = next(i.mb for i in rank.instrs if isinstance(i, Recv))
    instrs = tuple(i for i in rank.instrs if not (isinstance(i, Recv) and i.mb == mb))
    broken = evaluation.replace_rank(rank.rank, tuple(i for i in instrs if not _waits_for(i, rank, mb)))
    with pytest.raises(VerifyError, match=f"rank {rank.rank}, instruction .*has not arrived"):
        verify(broken, compiled.plan, forward_only=True)


def _waits_for(instr, rp, mb: int) -> bool:
    handles = {i.handle for i in rp.instrs if isinstance(i, Recv) and i.mb == mb}
    return isinstance(instr, Wait) and instr.handle in handles


def test_run_logs_val_loss(tmp_path, capfd):
    eval_job(tmp_path, "eval_every = 1\n  eval_batches = 1\n  eval_share = 0.05\n")
    (tmp_path / "single.het").write_text((DEMO / "single.het").read_text())
    assert main(["compile", str(tmp_path / "single.het"), "-o", str(tmp_path / "plan")]) == 0
    summary = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert summary["eval_every"] == 1 and summary["eval_time_s"] > 0
    metrics = tmp_path / "metrics.jsonl"
    assert main(["run", str(tmp_path / "plan"), "--local", "--steps", "2", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["val_loss"] > 0 for r in records)   # 1-based
    out = capfd.readouterr().out
    assert out.count("val_loss ") == 2
