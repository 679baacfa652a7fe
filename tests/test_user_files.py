"""Files a user names on the command line or in a spec are read only when they are regular files (Note
[untrusted paths] in hetc/frontend/load.py, hetc/ir/userfile.py): a named pipe blocks at open and a device
streams for ever, so each is refused by name, exit 2, before it is opened; a directory is named as one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetc.cli import main as hetc_main
from tests.conftest import DEMO, SHARED_DATA

SAILOR = SHARED_DATA / "sailor"


@pytest.fixture
def fifo(tmp_path) -> Path:
    """A named pipe nobody writes to: opening it to read would block for ever."""
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def _fails(argv: list[str], capsys) -> str:
    assert hetc_main(argv) == 2, argv
    return capsys.readouterr().err


def test_a_pipe_as_the_timeline_or_the_metrics_file(demo_plan_dirs, fifo, capsys):
    plan = demo_plan_dirs["pp"]
    err = _fails(["viz", str(plan), "--trace", str(fifo), "-o", str(fifo.parent / "page.html")], capsys)
    assert f"the timeline '{fifo}' is a named pipe, not a regular file" in err
    err = _fails(["calibrate", str(plan), "--measured", str(fifo)], capsys)
    assert f"the metrics file '{fifo}' is a named pipe, not a regular file" in err


def test_a_pipe_as_a_profile(fifo, capsys):
    err = _fails(["explain", str(DEMO / "pp.het"), "--profile", str(fifo)], capsys)
    assert f"the profile '{fifo}' is a named pipe, not a regular file" in err


@pytest.mark.skipif(not SAILOR.is_dir(), reason=f"{SAILOR} is absent (Sailor's data, read by path)")
def test_a_pipe_or_a_directory_as_another_systems_file(fifo, tmp_path, capsys):
    err = _fails(["import", "sailor", "--data", str(SAILOR), "--plan", str(fifo)], capsys)
    assert f"the Sailor plan '{fifo}' is a named pipe, not a regular file" in err
    err = _fails(["import", "sailor", "--data", str(SAILOR), "--plan", str(tmp_path)], capsys)
    assert f"the Sailor plan '{tmp_path}' is a directory, not a regular file" in err

