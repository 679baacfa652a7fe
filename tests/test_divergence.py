"""A diverging run never costs a finite checkpoint, and one checkpoint directory has one writer.

Issue 28, findings 2 and 3: two runs given the same `--checkpoint` replaced each other's
steps; a run at `lr = 1000` trained to the end on NaN with exit 0, `latest` named a
checkpoint of NaN weights and `--keep 2` pruned every finite one.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetc.cli import main
from hetc.runtime.checkpoint_lock import LOCK_FILE, CheckpointBusy, lock_checkpoint_dir
from hetc.runtime.checkpoint_files import complete_steps
from tests.conftest import ROOT, demo_job

HANG_GUARD_S = 300
TWO_RANKS = """
parallel {
  zero = 1
  stage all { layers = embed..head, ranks = host[0], lanes = 2 }
  idle = [host[1]]
}
"""


def _job(tmp_path: Path, lr: str, clip: str = "") -> Path:
    """The demo job at learning rate `lr` on two data-parallel ranks, as a spec in tmp_path."""
    spec = tmp_path / "job.het"
    spec.write_text(demo_job(("  lr = 3e-3\n", f"  lr = {lr}\n{clip}")) + TWO_RANKS)
    return spec


@pytest.fixture(scope="module")
def diverging_plan(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("diverging")
    plan = tmp / "plan"
    assert main(["compile", str(_job(tmp, "1000")), "-o", str(plan)]) == 0
    return plan


def _run(plan: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetc", "run", str(plan), "--local", *flags], check=False, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


def _finite(checkpoint: Path) -> bool:
    from hetc.runtime.checkpoint import read_params

    return all(bool(t.isfinite().all()) for t in read_params(checkpoint).values())


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_diverging_run_stops_and_leaves_only_finite_checkpoints(diverging_plan, tmp_path):
    """Saved every step: the optimizer state overflows before the loss does, and the save refuses it."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    done = _run(diverging_plan, "--steps", "20", "--checkpoint", str(ck), "--every", "1", "--keep", "2",
                "--metrics", str(metrics))
    assert done.returncode == 3, done.stderr
    stopped = re.search(r"error: step (\d+): (the loss is nan|its weights or optimizer state are not finite)"
                        r"; stopped without saving it", done.stderr)
    assert stopped, done.stderr
    step = int(stopped.group(1))
    assert 1 < step < 20, "lr 1000 should diverge within the run, after a finite first step"
    assert len(metrics.read_text().splitlines()) == step
    kept = sorted(p.name for p in ck.glob("step-*"))
    assert kept == [f"step-{step - 2}", f"step-{step - 1}"], kept
    assert (ck / "latest").read_text().strip() == f"step-{step - 1}"
    assert all(_finite(ck / name) for name in kept), kept


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_nan_loss_stops_the_run_naming_its_step(diverging_plan, tmp_path):
    metrics = tmp_path / "m.jsonl"
    done = _run(diverging_plan, "--steps", "30", "--metrics", str(metrics))
    assert done.returncode == 3, done.stderr
    stopped = re.search(r"error: step (\d+): the loss is nan; stopped without saving it", done.stderr)
    assert stopped, done.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == int(stopped.group(1)) and not math.isfinite(losses[-1])
    assert all(math.isfinite(loss) for loss in losses[:-1])
    assert "No checkpoint was being saved" in done.stderr


@pytest.mark.timeout(HANG_GUARD_S)
def test_skip_needs_clipping(diverging_plan, tmp_path):
    done = _run(diverging_plan, "--steps", "2", "--on-nonfinite", "skip")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("--on-nonfinite skip needs train.grad_clip") == 1, done.stderr
    assert "starting" not in done.stderr, "refused by the launcher, before any rank starts"


@pytest.mark.timeout(HANG_GUARD_S)
def test_skipped_steps_keep_the_weights_and_are_counted(tmp_path):
    plan, ck, metrics = tmp_path / "plan", tmp_path / "ck", tmp_path / "m.jsonl"
    assert main(["compile", str(_job(tmp_path, "1000", clip="  grad_clip = 1.0\n")), "-o", str(plan)]) == 0
    done = _run(plan, "--steps", "12", "--on-nonfinite", "skip", "--checkpoint", str(ck), "--metrics", str(metrics))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped, "lr 1000 should overflow the gradients within 12 steps"
    assert all(not math.isfinite(r["grad_norm"]) for r in records if r.get("skipped"))
    assert f"{len(skipped)} of 12 steps skipped their update" in done.stderr
    assert _finite(ck / "step-12")


def test_a_held_checkpoint_directory_is_refused(tmp_path):
    held = lock_checkpoint_dir(tmp_path / "ck")
    try:
        with pytest.raises(CheckpointBusy, match=rf"in use by another run \(host \S+ pid {os.getpid()} since"):
            lock_checkpoint_dir(tmp_path / "ck")
    finally:
        held.release()
    lock_checkpoint_dir(tmp_path / "ck").release()       # free again once released


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_message(tmp_path, caplog):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / LOCK_FILE).write_text("host elsewhere pid 4242 since 2026-12-01T00:00:00Z\n")   # its flock died with it
    lock = lock_checkpoint_dir(ck)
    lock.release()
    assert lock.took_over.startswith("host elsewhere pid 4242")
    assert "took over the lock" in caplog.text and "host elsewhere pid 4242" in caplog.text


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_second_run_on_a_checkpoint_directory_exits_2_at_once(demo_plan_dirs, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "a.jsonl"
    # after its first checkpoint the first run mostly sleeps (its ranks' compute stretched 50 times): it holds
    # the directory without taking the cores that the second run and the rest of the suite run on
    idle = [arg for rank in range(4) for arg in ("--inject", f"slow rank={rank} factor=50 from=2")]
    first = subprocess.Popen([sys.executable, "-m", "hetc", "run", str(demo_plan_dirs["dp"]), "--local",
                              "--steps", "1000000", "--checkpoint", str(ck), "--every", "2", *idle,
                              "--metrics", str(metrics)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S / 2
        while not complete_steps(ck):    # a whole checkpoint (saves are asynchronous): the resume below reads it
            assert first.poll() is None and time.monotonic() < deadline, "the first run never saved"
            time.sleep(0.2)
        second = _run(demo_plan_dirs["single"], "--steps", "1", "--checkpoint", str(ck))
        assert second.returncode == 2, second.stderr
        assert f"{ck} is in use by another run (host" in second.stderr
        assert first.poll() is None, "the refused run must not disturb the first"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    _wait_released(ck)      # SIGKILL's exits are asynchronous: the ranks' flock goes with the last of them
    after = _run(demo_plan_dirs["single"], "--steps", "1", "--checkpoint", str(ck), "--resume")
    assert after.returncode == 0, after.stderr      # the killed run's lock died with it


def _wait_released(ck: Path) -> None:
    """Until the checkpoint directory's lock can be taken (the killed run's ranks have exited)."""
    deadline = time.monotonic() + HANG_GUARD_S / 4
    while True:
        try:
            lock_checkpoint_dir(ck).release()
            return
        except CheckpointBusy:
            assert time.monotonic() < deadline, "the killed run's lock outlived its processes"
            time.sleep(0.1)


def test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints(demo_plan_dirs, tmp_path, capsys):
    ck = tmp_path / "ck"
    (ck / "step-2").mkdir(parents=True)
    (ck / "step-2" / ".metadata").write_bytes(b"an earlier run's")
    (ck / "latest").write_text("step-2\n")
    assert main(["run", str(demo_plan_dirs["single"]), "--local", "--steps", "1", "--checkpoint", str(ck)]) == 2
    assert f"{ck} holds the checkpoints of an earlier run" in capsys.readouterr().err
    assert (ck / "step-2" / ".metadata").read_bytes() == b"an earlier run's"
