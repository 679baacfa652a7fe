"""What a running job reports (issue 33, item 1): the --metrics schema of docs/metrics.md, TensorBoard
scalars, start-up lines, and the telemetry flags refused without their package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hetc.cli import main
from tests.conftest import DEMO, ROOT

STEPS = 30   # the demo job's own length (issue 33: "a 30-step demo run")
EVAL_EVERY = 10
STARTUP = ["placed 4 ranks", "process groups up", "model built; weights initialised from seed 1234"]


@dataclass(frozen=True)
class Run:
    plan: Path
    records: list[dict]
    tensorboard: Path
    stdout: str
    stderr: str


def _job_with_clip_and_eval(folder: Path) -> Path:
    """The demo job with clipping (so every step has a grad_norm) and an evaluation every EVAL_EVERY steps
    (so some have a val_loss): the fields that are present only on some runs' steps."""
    job = (DEMO / "job.het").read_text()
    assert "  lr = 3e-3\n" in job
    job = job.replace("  lr = 3e-3\n", f"  lr = 3e-3\n  grad_clip = 1.0\n  eval_every = {EVAL_EVERY}\n"
                                       "  eval_share = 0.1\n")
    job = job.replace('path = "data/tiny.txt"', f'path = "{DEMO / "data" / "tiny.txt"}"')
    job = job.replace('use "../catalog.het"', f'use "{DEMO.parent / "catalog.het"}"')
    (folder / "job.het").write_text(job)
    (folder / "dp.het").write_text((DEMO / "dp.het").read_text())
    return folder / "dp.het"


def _run(plan: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetc", "run", str(plan), "--local", *flags], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
                          check=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    folder = tmp_path_factory.mktemp("telemetry")
    plan, metrics, tensorboard = folder / "plan", folder / "m.jsonl", folder / "tb"
    assert main(["compile", str(_job_with_clip_and_eval(folder)), "-o", str(plan)]) == 0
    done = _run(plan, "--steps", str(STEPS), "--metrics", str(metrics), "--tensorboard", str(tensorboard))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return Run(plan, records, tensorboard, done.stdout, done.stderr)


def documented_fields() -> dict[str, str]:
    """docs/metrics.md's table of --metrics fields: name -> when present."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    table = text.split("## `--metrics FILE`", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]* \| ([^|]*) \|", table, re.MULTILINE)
    assert rows, "docs/metrics.md lost its table of fields"
    return {name: present.strip() for name, present in rows}


@pytest.mark.timeout(300)
def test_every_record_has_exactly_the_documented_fields(run):
    documented = documented_fields()
    always = {name for name, present in documented.items() if present == "every step"}
    assert [r["step"] for r in run.records] == list(range(1, STEPS + 1))
    for record in run.records:
        evaluated = {"val_loss"} if record["step"] % EVAL_EVERY == 0 else set()
        assert set(record) == always | {"grad_norm"} | evaluated, f"step {record['step']}"
        assert set(record) <= set(documented)
        assert len(record["peak_memory_bytes"]) == len(record["class_times_s"]) == 4
        # on CPU, reserved is the peak RSS, as allocated is (docs/metrics.md)
        assert record["peak_memory_reserved_bytes"] == record["peak_memory_bytes"]
        assert record["lr"] > 0 and record["grad_norm"] > 0 and record["mfu"] > 0 and record["tokens_per_s"] > 0


@pytest.mark.timeout(300)
def test_tensorboard_reads_back_every_steps_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.tensorboard))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "hfu", "step_time_s", "peak_memory_bytes",
                    "peak_memory_reserved_bytes", "val_loss"}
    for tag in tags - {"val_loss"}:
        assert [e.step for e in events.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    assert [e.step for e in events.Scalars("val_loss")] == [s for s in range(1, STEPS + 1) if s % EVAL_EVERY == 0]
    for record, loss, memory in zip(run.records, events.Scalars("loss"), events.Scalars("peak_memory_bytes"),
                                    strict=True):
        assert loss.value == pytest.approx(record["loss"], rel=1e-6)
        assert memory.value == pytest.approx(max(record["peak_memory_bytes"]), rel=1e-6)


@pytest.mark.timeout(300)
def test_startup_phases_are_told_once_on_rank_0_in_order(run):
    told = [line.removeprefix("hetc run: ") for line in run.stderr.splitlines() if line.startswith("hetc run: ")]
    phases = [re.sub(r" \([^()]*\)$", "", line) for line in told]   # the phase's time, in parentheses
    assert phases[1:] == STARTUP, run.stderr     # after `starting 4 local ranks`
    assert phases[0] == "starting 4 local ranks"


@pytest.mark.timeout(300)
def test_quiet_tells_no_startup_phase(run):
    done = _run(run.plan, "--steps", "1", "-q")
    assert done.returncode == 0, done.stderr
    assert not any(phase in done.stderr for phase in STARTUP), done.stderr


@pytest.mark.parametrize(("flag", "module", "install"), [("--wandb", "wandb", "pip install wandb"),
                                                         ("--tensorboard", "tensorboard", "pip install tensorboard")])
def test_a_telemetry_flag_without_its_package_is_a_usage_error(run, monkeypatch, capsys, flag, module, install):
    monkeypatch.setitem(sys.modules, module, None)    # `import` now raises ImportError, as when not installed
    assert main(["run", str(run.plan), "--local", "--steps", "1", flag, "x"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} needs the `{module}` package" in err and install in err and "Traceback" not in err
