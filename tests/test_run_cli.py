"""`hetc run` refuses unsafe or malformed programs before starting any rank."""

from __future__ import annotations

import shutil

import pytest

from hetc.cli import main
from tests.conftest import DEMO


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "pp"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    return out


def _copy(plan, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(plan, broken)
    return broken, broken / "programs" / "rank-0000.txt"


def test_a_dropped_receive_is_refused_naming_rank_and_instruction(plan, tmp_path, capsys):
    broken, listing = _copy(plan, tmp_path)
    lines = [line for line in listing.read_text().splitlines() if "recv grad ms=1 mb=0" not in line]
    listing.write_text("\n".join(lines) + "\n")
    assert main(["run", str(broken), "--local", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "programs are unsafe" in err and "rank 0, instruction" in err and "has not arrived" in err


def test_a_misspelt_instruction_is_a_located_error(plan, tmp_path, capsys):
    broken, listing = _copy(plan, tmp_path)
    listing.write_text(listing.read_text().replace("  load mb=0", "  lod mb=0", 1))
    assert main(["run", str(broken), "--local"]) == 2
    err = capsys.readouterr().err
    assert f"{listing}:3: error: unknown instruction 'lod'" in err


def test_a_wrong_local_world_size_is_refused(plan, capsys):
    assert main(["run", str(plan), "--local", "3"]) == 2
    assert "the plan has 4 ranks; --local 3 cannot run it" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_metrics_count_steps_as_the_console_does(tmp_path):
    """metrics.jsonl's "step" is the console's `step k/N` (1-based: Note [step numbers] in runtime/report.py)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    plan_dir, metrics = tmp_path / "single", tmp_path / "m.jsonl"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(plan_dir)]) == 0
    done = subprocess.run([sys.executable, "-m", "hetc", "run", str(plan_dir), "--local", "--steps", "2",
                           "--metrics", str(metrics)], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    console = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")]
    assert console == ["1/2", "2/2"]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def _other_than_default(action) -> list[str]:
    """An option of `hetc run` with a value that is not its default (for every kind of option it declares)."""
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    value = next(v for v in ({float: "7.5", int: "5"}.get(action.type, f"x-{action.dest}"), "8.5" if action.type is
                             float else "6") if str(v) != str(action.default))     # Path and str: a name
    return [flag, value]


def test_every_option_of_hetc_run_reaches_the_ranks_of_local_but_the_launchers_own():
    """Issue 30: `--local` built the ranks' options from a hand-kept list and left --heartbeat-timeout out.
    Every option the parser declares, set to a value that is not its default, comes back from the ranks'
    argv, except LAUNCHER_ONLY (named in one place, hetc/commands/run.py)."""
    from hetc.cli import build_parser
    from hetc.commands.run import LAUNCHER_ONLY, _rank_argv, run_options

    passed = [a for a in run_options() if a.dest not in LAUNCHER_ONLY]
    assert {"heartbeat_timeout", "timeout", "init_timeout", "on_nonfinite"} <= {a.dest for a in passed}
    argv = ["run", "plan", "--local", "2", *(word for a in passed for word in _other_than_default(a))]
    args = build_parser().parse_args(argv)
    assert all(getattr(args, a.dest) != a.default for a in passed)     # each one was set
    again = build_parser().parse_args(_rank_argv(args))
    assert again.local is None
    assert {a.dest: getattr(again, a.dest) for a in passed} == {a.dest: getattr(args, a.dest) for a in passed}
