"""A plan is verified once, by `hetc compile` (or `hetc verify` after an edit): ranks check hashes, never
verify or lower (Note [verified once] in hetc/plandir.py)."""

from __future__ import annotations

import cProfile
import json
import pstats
import shutil
from pathlib import Path

import pytest

from hetc.cli import main as hetc_main
from hetc.ir.outdir import MARKER
from hetc.plandir import open_program, read_plan, read_program, require_verified
from hetc.ir.program import ProgramFormatError
from tests.test_eval import EVAL_KEYS, eval_job
from tests import test_gpu_failures

as_rank0 = test_gpu_failures.as_rank0    # the fixture: this process as launch rank 0 of 1

# the functions a rank must not run: the verifier, lowering and the evaluation program's derivation
PASSES = {("passes/verify/__init__.py", "verify"), ("passes/lower/__init__.py", "lower"),
          ("passes/verify/__init__.py", "verified_evaluation"), ("passes/lower/forward_only.py", "forward_only")}


@pytest.fixture(scope="module")
def eval_plan(tmp_path_factory) -> Path:
    """The 1-rank demo plan of a job that evaluates, compiled."""
    root = tmp_path_factory.mktemp("verified_once")
    eval_job(root, EVAL_KEYS.replace("eval_every = 2", "eval_every = 1"))
    (root / "single.het").write_text((Path(__file__).parent.parent / "specs/demo/single.het").read_text())
    assert hetc_main(["compile", str(root / "single.het"), "-o", str(root / "plan")]) == 0
    return root / "plan"


def _passes_called(argv: list[str]) -> tuple[int, set[tuple[str, str]]]:
    """(exit status, which of PASSES ran) of `hetc argv` in this process."""
    profile = cProfile.Profile()
    status = profile.runcall(hetc_main, argv)
    called = {(file, name) for (path, _, name) in pstats.Stats(profile).stats  # type: ignore[attr-defined]
              for file, want in PASSES if path.endswith(file) and name == want}
    return status, called


def test_compile_writes_each_ranks_evaluation_program_and_records_it(eval_plan):
    listing = eval_plan / "programs" / "eval-rank-0000.txt"
    assert listing.is_file() and "fwd" in listing.read_text() and "bwd" not in listing.read_text()
    assert "programs/eval-rank-0000.txt" in json.loads((eval_plan / MARKER).read_text())["files"]


def test_a_rank_neither_verifies_nor_lowers(eval_plan, as_rank0, tmp_path):
    status, called = _passes_called(["run", str(eval_plan), "-q", "--steps", "1", "--metrics",
                                     str(tmp_path / "m.jsonl")])
    assert status == 0 and not called
    assert all("val_loss" in json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines())


def test_a_plan_from_before_markers_is_verified_by_its_rank(eval_plan, as_rank0, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for f in eval_plan.rglob("*"):
        if f.is_file() and f.name != MARKER and not f.name.startswith("eval-"):
            (old / f.relative_to(eval_plan)).parent.mkdir(parents=True, exist_ok=True)
            (old / f.relative_to(eval_plan)).write_bytes(f.read_bytes())
    status, called = _passes_called(["run", str(old), "-q", "--steps", "1"])
    assert status == 0 and ("passes/verify/__init__.py", "verify") in called


def _edited_plan(eval_plan: Path, tmp_path: Path) -> Path:
    """A fresh compile of the plan, with rank 0's listing edited (a comment: it still verifies)."""
    plan = tmp_path / "plan"
    assert hetc_main(["compile", str(eval_plan / "plan.het"), "-o", str(plan)]) == 0
    listing = plan / "programs" / "rank-0000.txt"
    listing.write_text(listing.read_text() + "# reviewed\n")
    return plan


def test_a_rank_refuses_an_edited_listing_until_hetc_verify_records_it(eval_plan, as_rank0, tmp_path, capsys):
    plan = _edited_plan(eval_plan, tmp_path)
    capsys.readouterr()
    assert hetc_main(["run", str(plan), "-q", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "programs/rank-0000.txt changed since `hetc compile` verified it" in err
    assert f"hetc verify {plan}" in err and "Traceback" not in err
    assert hetc_main(["verify", str(plan)]) == 0
    assert "recorded as verified" in capsys.readouterr().out
    status, called = _passes_called(["run", str(plan), "-q", "--steps", "1"])
    assert status == 0 and not called


def test_the_local_launcher_verifies_an_edit_once_for_its_ranks(eval_plan, tmp_path, capsys):
    plan = _edited_plan(eval_plan, tmp_path)
    status, called = _passes_called(["run", str(plan), "--local", "-q", "--steps", "1"])
    assert status == 0 and ("passes/verify/__init__.py", "verify") in called
    assert hetc_main(["verify", str(plan)]) == 0 and "recorded as verified" in capsys.readouterr().out


def test_verify_under_other_rules_than_the_plans_records_nothing(eval_plan, as_rank0, tmp_path, capsys):
    plan = _edited_plan(eval_plan, tmp_path)
    assert hetc_main(["verify", str(plan), "--backend", "nccl"]) == 0     # a CPU plan runs on gloo
    assert "recorded" not in capsys.readouterr().out
    assert hetc_main(["run", str(plan), "-q", "--steps", "1"]) == 2


@pytest.fixture(scope="module")
def four_ranks(demo_plan_dirs) -> Path:
    """The 4-rank heterogeneous demo plan, compiled."""
    return demo_plan_dirs["hetero"]


def test_a_rank_starts_from_its_own_listing_alone(four_ranks, tmp_path):
    """Note [a rank reads its own]: with every other rank's listing gone, rank 2 still checks its files
    against the marker and gets its program; a listing nobody asked for is never read."""
    plan = tmp_path / "plan"
    shutil.copytree(four_ranks, plan)
    for listing in (plan / "programs").glob("rank-*.txt"):
        if listing.name != "rank-0002.txt":
            listing.unlink()
    _, checked = read_plan(plan)
    program = open_program(plan, len(checked.pipeline.world))
    require_verified(plan, [2], program, checked)
    assert program.world_size == 4 and program.groups == read_program(four_ranks).groups
    assert program.ranks[2] == read_program(four_ranks).ranks[2]
    with pytest.raises(FileNotFoundError, match="rank 1 has no listing"):
        program.ranks[1]


def test_a_listing_of_another_rank_is_refused_where_it_is_read(four_ranks, tmp_path):
    plan = tmp_path / "plan"
    shutil.copytree(four_ranks, plan)
    shutil.copy(plan / "programs" / "rank-0003.txt", plan / "programs" / "rank-0001.txt")
    program = open_program(plan, 4)
    assert program.ranks[3].rank == 3
    with pytest.raises(ProgramFormatError, match="expected the program of rank 1, found rank 3"):
        program.ranks[1]
