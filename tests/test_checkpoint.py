"""Checkpoints: resume under the same plan (bit for bit), under another plan (resharding), atomic saves.

Multi-process cases run on the session's pool of gloo ranks
(tests/rank_pool.py); one case drives `hetc run --local` end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hetc.cli import main as hetc_main
from hetc.runtime.checkpoint import LATEST, CheckpointError, latest_checkpoint, read_params
from hetc.runtime.checkpoint_lock import LOCK_FILE
from tests.conftest import REFERENCE_STEPS, ROOT
from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, assert_params_close

SAVED_AT = 3   # save after 3 steps, resume and run to REFERENCE_STEPS


def _save_then_resume(pool, dirs, tmp_path, saver: str, resumer: str):
    """Run `saver` for SAVED_AT steps and save; resume under `resumer` up to the end and save again."""
    first, second = tmp_path / "first", tmp_path / "second"
    agreed_losses(pool.run(PlanJob(dirs[saver], SAVED_AT, save_to=first)))
    reports = pool.run(PlanJob(dirs[resumer], REFERENCE_STEPS, resume_from=first, save_to=second))
    assert {r.start for r in reports} == {SAVED_AT}
    return agreed_losses(reports), latest_checkpoint(second)


@pytest.mark.parametrize("plan", ["zero3", "hsdp", "zero3_offload", "hetero"])
def test_resume_under_the_same_plan_is_exact(plan, rank_pool, demo_plan_dirs, tmp_path):
    straight = agreed_losses(rank_pool.run(PlanJob(demo_plan_dirs[plan], REFERENCE_STEPS,
                                                   save_to=tmp_path / "straight")))
    resumed, path = _save_then_resume(rank_pool, demo_plan_dirs, tmp_path, plan, plan)
    assert resumed == straight[SAVED_AT:]
    want = read_params(latest_checkpoint(tmp_path / "straight"))
    got = read_params(path)
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("saver, resumer", [
    ("zero3", "pp"), ("zero3", "single"), ("zero3", "hetero"), ("pp", "zero3_offload"),
    ("hsdp", "interleaved"), ("single", "hsdp"), ("zero3_offload", "dp"), ("offload_act", "zb"),
])
def test_resume_under_another_plan(saver, resumer, rank_pool, demo_plan_dirs, demo_reference, tmp_path):
    losses, path = _save_then_resume(rank_pool, demo_plan_dirs, tmp_path, saver, resumer)
    assert_losses_close(losses, demo_reference.losses[SAVED_AT:])
    assert_params_close(path, demo_reference.params)


def test_an_interrupted_save_never_replaces_the_last_good_one(rank_pool, demo_plan_dirs, demo_reference,
                                                              tmp_path):
    plan = demo_plan_dirs["zero3"]
    agreed_losses(rank_pool.run(PlanJob(plan, SAVED_AT, save_to=tmp_path)))
    failed = rank_pool.run(PlanJob(plan, SAVED_AT + 1, resume_from=tmp_path, save_to=tmp_path, fail_save_on=1))
    assert len(failed) == 4 and all("simulated failure" in (r.error or "") for r in failed)
    assert (tmp_path / LATEST).read_text().strip() == f"step-{SAVED_AT}"
    assert not (tmp_path / f"step-{SAVED_AT + 1}").exists()
    assert not (tmp_path / f"step-{SAVED_AT + 1}.tmp" / ".metadata").exists()
    reports = rank_pool.run(PlanJob(plan, REFERENCE_STEPS, resume_from=tmp_path, save_to=tmp_path))
    assert {r.start for r in reports} == {SAVED_AT}
    assert_losses_close(agreed_losses(reports), demo_reference.losses[SAVED_AT:])
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, f"step-{SAVED_AT}", f"step-{REFERENCE_STEPS}"]


def test_resume_from_an_empty_directory_starts_at_step_0(rank_pool, demo_plan_dirs, demo_reference, tmp_path):
    reports = rank_pool.run(PlanJob(demo_plan_dirs["pp"], 2, resume_from=tmp_path))
    assert {r.start for r in reports} == {0}
    assert_losses_close(agreed_losses(reports), demo_reference.losses[:2])


def test_latest_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "step-7").mkdir()
    (tmp_path / LATEST).write_text("step-7\n")
    with pytest.raises(CheckpointError, match="step-7, which is not a complete checkpoint"):
        latest_checkpoint(tmp_path)


@pytest.mark.parametrize("flags, message", [(["--resume"], "--resume needs --checkpoint"),
                                            (["--every", "2"], "--every needs --checkpoint")])
def test_checkpoint_flags_are_checked_before_launch(flags, message, demo_plan_dirs, capsys):
    assert hetc_main(["run", str(demo_plan_dirs["single"]), "--local", *flags]) == 2
    assert message in capsys.readouterr().err


def _hetc_run(plan_dir, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hetc", "run", str(plan_dir), "--local", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_hetc_run_saves_every_k_steps_and_resumes(demo_plan_dirs, demo_reference, tmp_path):
    plan, ckpt, metrics = demo_plan_dirs["single"], tmp_path / "ckpt", tmp_path / "m.jsonl"
    first = _hetc_run(plan, "--steps", 3, "--checkpoint", ckpt, "--every", 2)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name != LOCK_FILE) == [LATEST, "step-2", "step-3"]
    second = _hetc_run(plan, "--steps", REFERENCE_STEPS, "--checkpoint", ckpt, "--resume", "--metrics", metrics)
    assert second.returncode == 0, second.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 5]   # 1-based, as the console: step-3 was the third step
    assert_losses_close(tuple(r["loss"] for r in records), demo_reference.losses[3:])
    assert_params_close(latest_checkpoint(ckpt), demo_reference.params)
