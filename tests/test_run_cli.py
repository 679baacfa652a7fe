"""`hetc run` refuses unsafe or malformed programs before starting any rank."""

from __future__ import annotations

import argparse
import shutil

import pytest

from hetc.cli import main
from hetc.commands.argtypes import finite_number
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
    numeric = {float: "7.5", finite_number: "7.5", int: "5"}.get(action.type)
    value = next(v for v in (numeric or f"x-{action.dest}", "8.5" if numeric == "7.5" else "6")
                 if str(v) != str(action.default))     # Path and str: a name
    return [flag, value]


def test_the_ranks_of_local_take_every_option_of_the_launcher_as_one_value():
    """Issue 30: `--local` built the ranks' options from a hand-kept argv list and left --heartbeat-timeout
    out. Now the launcher hands its RunOptions to its ranks as one value (runtime/options.py): every option
    of `hetc run` but --local, set to a value that is not its default, lands in it and comes back equal."""
    import dataclasses

    from hetc.cli import build_parser
    from hetc.commands.run import run_options
    from hetc.runtime.options import RunOptions

    parser = build_parser()
    run = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    options = [a for a in run._actions if a.option_strings and a.dest not in ("local", "help")]
    assert {"heartbeat_timeout", "timeout", "init_timeout", "on_nonfinite", "rebalance"} <= {a.dest for a in options}
    argv = ["run", "plan", "--local", *(word for a in options for word in _other_than_default(a))]
    argv = [w if not w.startswith("x-inject") else "slow rank=1 factor=2" for w in argv]
    opts = run_options(parser.parse_args(argv))
    unset = [f.name for f in dataclasses.fields(RunOptions) if getattr(opts, f.name) == getattr(RunOptions(), f.name)]
    assert unset == [], f"options that never reach RunOptions: {unset}"
    assert RunOptions.from_json(opts.to_json()) == opts
    assert opts.heartbeat_timeout_s == 7.5

def test_a_spec_given_to_run_is_told_of_compile_and_of_elastic(tmp_path, capsys):
    """`hetc run SPEC`: a spec is no plan directory; `--elastic` runs one, planned on the nodes present."""
    assert main(["run", str(DEMO / "pp.het"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "is not a plan directory (write one with `hetc compile SPEC -o DIR`); or run the spec itself with " \
           "--elastic" in err
    assert main(["run", str(tmp_path / "missing"), "--steps", "1"]) == 2
    assert "--elastic" not in capsys.readouterr().err   # not a spec either


def test_a_plan_directory_given_where_a_spec_goes_names_the_spec_it_holds(tmp_path, capsys):
    """`hetc explain DIR` of a plan directory: its plan.het is the spec to name."""
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"{out}:1:1: error: '{out}' is a directory, not a spec file; its plan "
                                              f"is the spec '{out / 'plan.het'}'")
    assert main(["explain", str(tmp_path)]) == 2
    assert capsys.readouterr().err.rstrip().endswith("is a directory, not a spec file")
