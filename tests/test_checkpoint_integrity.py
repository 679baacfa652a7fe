"""Checkpoints that know what they are (issue 28, findings 4, 6, 7 and the checkpoint cases of 14).

Every case runs `hetc run` in this process as one torchrun rank of the 1-rank demo plan (the torchrun
variables set here, rank 0 hosting the store), so a run of a few steps takes well under a second
after the first: the checks under test are the CLI's and rank 0's, which no second rank changes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from hetc.cli import main as hetc_main
from hetc.runtime.checkpoint_files import LATEST, MANIFEST_FILE
from hetc.runtime.local import free_port
from tests.conftest import DEMO, demo_job

STEPS = 4


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """The 1-rank demo plan, and variants of its job with one thing changed."""
    out = tmp_path_factory.mktemp("plans")
    job = demo_job()
    variants = {
        "demo": job,
        "layers3": job.replace("layers = 4", "layers = 3"),
        "heads2": job.replace("heads = 4\n  kv_heads = 2", "heads = 2\n  kv_heads = 1"),
        "sgd": job.replace("optimizer adamw", "optimizer sgd"),
        "seed": job.replace("seed = 1234", "seed = 99"),
    }
    assert all(text != job for name, text in variants.items() if name != "demo")
    single = (DEMO / "single.het").read_text()
    dirs = {}
    for name, text in variants.items():
        (out / f"{name}_job.het").write_text(text)
        spec = out / f"{name}.het"
        spec.write_text(single.replace('use "job.het"', f'use "{name}_job.het"'))
        assert hetc_main(["compile", str(spec), "-o", str(out / name)]) == 0
        dirs[name] = out / name
    return dirs


@pytest.fixture
def as_rank0(monkeypatch):
    """This process as launch rank 0 of 1, as torchrun would start it; the process group is gone after."""
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "HETC_LOCAL_LAUNCHER", "HETC_NODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")      # each run sets its own; restored after the test
    yield
    if dist.is_initialized():     # a run that stopped with an error leaves it (its process would exit)
        dist.destroy_process_group()


def _run(plan: Path, *args: object) -> int:
    os.environ["MASTER_PORT"] = str(free_port())
    return hetc_main(["run", str(plan), "-q", *map(str, args)])


def _steps_run(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.fixture
def saved(plans, as_rank0, tmp_path) -> Path:
    """A checkpoint directory with step-2 and step-4 of the demo plan."""
    ckpt = tmp_path / "ckpt"
    assert _run(plans["demo"], "--steps", STEPS, "--checkpoint", ckpt, "--every", 2) == 0
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-2", "step-4"]
    return ckpt


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _shard(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"))


# ---------------------------------------------------------------- finding 4: which checkpoint --resume loads


@pytest.mark.parametrize("latest", ["deleted", "names a missing step"])
def test_resume_without_latest_finds_the_newest_complete_step(latest, plans, saved, tmp_path, caplog):
    if latest == "deleted":
        (saved / LATEST).unlink()
    else:
        (saved / LATEST).write_text("step-9\n")
    metrics = tmp_path / "m.jsonl"
    with caplog.at_level(logging.WARNING, logger="hetc.runtime"):
        assert _run(plans["demo"], "--steps", STEPS + 1, "--checkpoint", saved, "--resume",
                    "--metrics", metrics) == 0
    assert _steps_run(metrics) == [STEPS + 1]     # resumed after step 4: not retrained from step 1
    why = "is missing" if latest == "deleted" else "names step-9, which is not a complete checkpoint"
    assert f"{saved / LATEST} {why}; resuming from {saved / 'step-4'}" in caplog.text
    assert (saved / LATEST).read_text().strip() == f"step-{STEPS + 1}"


@pytest.mark.parametrize("make", [False, True], ids=["missing", "empty"])
def test_resume_of_a_directory_without_checkpoints_is_an_error(make, plans, as_rank0, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    if make:
        ckpt.mkdir()
    metrics = tmp_path / "m.jsonl"
    assert _run(plans["demo"], "--steps", 2, "--checkpoint", ckpt, "--resume", "--metrics", metrics) == 2
    err = capsys.readouterr().err
    assert f"--resume: {ckpt} {'holds no checkpoint' if make else 'does not exist'}" in err
    assert "--resume-if-present" in err and not _steps_run(metrics)


def test_resume_if_present_starts_at_step_0_when_there_is_nothing(plans, as_rank0, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert _run(plans["demo"], "--steps", 2, "--checkpoint", tmp_path / "new", "--resume-if-present",
                "--metrics", metrics) == 0
    assert _steps_run(metrics) == [1, 2]


def test_resume_at_or_past_the_last_step_says_there_is_no_step_to_run(plans, saved, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert _run(plans["demo"], "--steps", 3, "--checkpoint", saved, "--resume", "--metrics", metrics) == 0
    assert "no step to run: resumed at step 4, and the run ends at step 3 (--steps)" in capsys.readouterr().err
    assert _steps_run(metrics) == []


# ---------------------------------------------------------------- finding 6: checksums


def test_flipped_bytes_in_a_shard_fall_back_to_the_previous_checkpoint(plans, saved, tmp_path, caplog):
    shard = _shard(saved / "step-4")
    _flip_byte(shard, shard.stat().st_size // 2)
    metrics = tmp_path / "m.jsonl"
    with caplog.at_level(logging.WARNING, logger="hetc.runtime"):
        assert _run(plans["demo"], "--steps", 3, "--checkpoint", saved, "--resume", "--metrics", metrics) == 0
    assert _steps_run(metrics) == [3]             # from step-2, the newest intact one
    assert f"skipped step-4 ({shard}: corrupt" in caplog.text
    assert f"resuming from {saved / 'step-2'}" in caplog.text


@pytest.mark.parametrize("damage", ["flip_shard", "flip_metadata", "truncate_shard", "delete_shard"])
def test_export_of_a_damaged_checkpoint_is_one_located_line(damage, saved, tmp_path, capsys):
    """Findings 6 and 14: no NaN carried into the export, no traceback, the file named."""
    step = saved / "step-4"
    target = step / ".metadata" if damage == "flip_metadata" else _shard(step)
    if damage.startswith("flip"):
        _flip_byte(target, target.stat().st_size // 3)
    elif damage == "truncate_shard":
        os.truncate(target, target.stat().st_size // 2)
    else:
        target.unlink()
    assert hetc_main(["export", "hf", str(step), "-o", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{target}:1:1: error: ") and len(err.splitlines()) == 1, err
    assert {"flip_shard": "corrupt", "flip_metadata": "corrupt", "truncate_shard": "truncated",
            "delete_shard": "missing"}[damage] in err
    assert not (tmp_path / "hf").exists()


def test_resume_with_every_checkpoint_damaged_is_an_error_not_a_fresh_start(plans, saved, as_rank0, capsys):
    for step in ("step-2", "step-4"):
        os.truncate(_shard(saved / step), 100)    # a bare EOFError from DCP before (finding 14)
    assert _run(plans["demo"], "--steps", 5, "--checkpoint", saved, "--resume-if-present") == 2
    err = capsys.readouterr().err
    assert "holds no intact checkpoint" in err and "truncated" in err and "Traceback" not in err
    assert (saved / LATEST).read_text().strip() == "step-4"      # nothing overwritten


def test_a_saved_checkpoint_lists_a_checksum_for_every_file(saved):
    step = saved / "step-4"
    listed = json.loads((step / MANIFEST_FILE).read_text())["files"]
    assert set(listed) == {p.name for p in step.iterdir()} - {MANIFEST_FILE}
    assert {".metadata", "model.het", "data.json"} <= set(listed)


# ---------------------------------------------------------------- finding 7: the checkpoint's model, optimizer, data


@pytest.mark.parametrize("variant, field, values", [
    ("layers3", "layers", "4 there, 3 in this run"),
    ("heads2", "heads", "4 there, 2 in this run"),
    ("sgd", "optimizer", "adamw there, sgd in this run"),
    ("seed", "seed", "1234 there, 99 in this run"),
])
def test_resume_into_another_model_optimizer_or_data_names_the_difference(variant, field, values, plans, saved,
                                                                          tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert _run(plans[variant], "--steps", 6, "--checkpoint", saved, "--resume", "--metrics", metrics) == 2
    err = capsys.readouterr().err
    assert f"{field} is {values}" in err and not _steps_run(metrics)
    if variant == "heads2":
        assert "kv_heads is 2 there, 1 in this run" in err     # the same tensor sizes: compared by the model


@pytest.mark.parametrize("variant", ["sgd", "seed"])
def test_load_weights_only_restarts_at_step_0_with_another_optimizer_or_data(variant, plans, saved, tmp_path):
    metrics, fresh, ckpt = tmp_path / "m.jsonl", tmp_path / "fresh.jsonl", tmp_path / "finetune"
    assert _run(plans[variant], "--steps", 2, "--checkpoint", ckpt, "--load-weights-only", saved / "step-4",
                "--metrics", metrics) == 0
    assert _steps_run(metrics) == [1, 2]
    assert (ckpt / LATEST).read_text().strip() == "step-2"
    assert _run(plans[variant], "--steps", 1, "--metrics", fresh) == 0
    first_loss, fresh_loss = (json.loads(path.read_text().splitlines()[0])["loss"] for path in (metrics, fresh))
    assert first_loss < fresh_loss - 0.05, (first_loss, fresh_loss)     # the trained weights, not a random start


def test_load_weights_only_still_needs_the_same_model(plans, saved, tmp_path, capsys):
    assert _run(plans["layers3"], "--steps", 2, "--checkpoint", tmp_path / "ft", "--load-weights-only", saved) == 2
    assert "layers is 4 there, 3 in this run" in capsys.readouterr().err


# ---------------------------------------------------------------- finding 14: read-only path, full disk


def _mount_tmpfs(where: Path, options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(OPTIONS): a tmpfs mounted with OPTIONS (the test skips without root); unmounted after."""
    mounted = tmp_path / "mnt"

    def mount(options: str) -> Path:
        _mount_tmpfs(mounted, options)
        return mounted

    yield mount
    subprocess.run(["umount", str(mounted)], capture_output=True, check=False)


def test_a_read_only_checkpoint_path_is_refused_before_step_1(plans, as_rank0, tmpfs, tmp_path, capsys):
    read_only = tmpfs("ro,size=64k")
    metrics = tmp_path / "m.jsonl"
    assert _run(plans["demo"], "--steps", 2, "--checkpoint", read_only / "ck", "--metrics", metrics) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot write checkpoints into {read_only / 'ck'}" in err and "Read-only" in err
    assert len(err.splitlines()) == 1 and not _steps_run(metrics)


def test_a_full_disk_during_a_save_is_named(plans, as_rank0, tmpfs, capsys):
    small = tmpfs("size=64k")     # the demo checkpoint is ~3 MB
    ckpt = small / "ck"
    assert _run(plans["demo"], "--steps", 2, "--checkpoint", ckpt) == 2
    err = capsys.readouterr().err.strip()
    assert f"saving step 2 into {ckpt / 'step-2.tmp'} failed: the disk is full" in err, err
    assert len(err.splitlines()) == 1 and "internal error" not in err
    assert not (ckpt / "step-2.tmp").exists()     # the partial save is removed: the space is given back
