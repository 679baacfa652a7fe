"""Checkpoint retention (`--keep N`) and what Ctrl-C says about checkpoints (`hetc run --local`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetc.cli import main as hetc_main
from hetc.runtime.checkpoint import LATEST, _prune, complete_steps, latest_checkpoint
from tests.conftest import ROOT


def _fake_checkpoint(directory, step: int, complete: bool = True) -> None:
    path = directory / f"step-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / ".metadata").write_text("")


def test_pruning_keeps_the_newest_complete_ones_and_what_latest_names(tmp_path):
    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 10, complete=False)      # a save that never finished is not counted
    (tmp_path / LATEST).write_text("step-4\n")          # e.g. resumed from step 4, saving again
    _prune(tmp_path, 2)
    assert complete_steps(tmp_path) == [4, 6, 8]
    assert (tmp_path / "step-10").is_dir()


@pytest.mark.slow
def test_keep_leaves_the_newest_checkpoints(demo_plan_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert hetc_main(["run", str(demo_plan_dirs["single"]), "--local", "--steps", "4", "--checkpoint", str(ckpt),
                      "--every", "1", "--keep", "2"]) == 0
    assert complete_steps(ckpt) == [3, 4]
    assert latest_checkpoint(ckpt) == ckpt / "step-4"


def test_keep_needs_a_positive_count(demo_plan_dirs, tmp_path, capsys):
    assert hetc_main(["run", str(demo_plan_dirs["single"]), "--local", "--checkpoint", str(tmp_path),
                      "--keep", "0"]) == 2
    assert "--keep must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_names_the_latest_complete_checkpoint(demo_plan_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hetc", "run", str(demo_plan_dirs["single"]), "--local", "--steps", "1000000",
         "--checkpoint", str(ckpt), "--every", "1"], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200
        while not (ckpt / LATEST).is_file() and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.2)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    latest = latest_checkpoint(ckpt)
    assert f"hetc run: interrupted; the latest complete checkpoint is {latest} (continue with --resume)" in err
