"""Shared fixtures and paths for the test suite."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
DEMO = SPECS / "demo"
SHARED_DATA = ROOT.parent / "shared" / "data"

# One intra-op thread per process (also for ranks that tests spawn): on the
# shared 2-core machines, OpenMP threads spinning against other processes made
# tiny CPU models ~40x slower. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Hypothesis times each example (deadline) and its data generation (too_slow) by
# default: durations that pass on a quiet machine and fail on a busy one. Every
# property test also says deadline=None itself; this covers any that forgets. No
# example database: tests write only under tmp_path, not .hypothesis/ in the checkout.
settings.register_profile("hetc", deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
settings.load_profile("hetc")

# Hypothesis' own caches (the constants it collects while pytest collects, unicode
# tables) go to a temporary directory removed at the end, not to .hypothesis/ here.
# Made in pytest's configure, not at import: rank processes and tools that import
# this module for its paths never configure or unconfigure, and each left one behind.
_hypothesis_home: str | None = None


def pytest_configure(config) -> None:
    global _hypothesis_home
    _hypothesis_home = tempfile.mkdtemp(prefix="hetc-hypothesis-")
    set_hypothesis_home_dir(_hypothesis_home)


def pytest_unconfigure(config) -> None:
    if _hypothesis_home is not None:
        shutil.rmtree(_hypothesis_home, ignore_errors=True)


# Note [parallel suite]: `make test` runs the suite on two worker processes (pytest-xdist, `-n 2 --dist
# loadgroup`), one per core: most tests are one CPU-bound process. Each module is one xdist group, so a
# module's fixtures are built once, on one worker; the modules that read tests/planned.py's session-wide
# plans share a group, so the agreement family is planned once. Plain `pytest FILE` runs in one process.
# xdist groups a test by appending `@group` to its node id; where it cannot (pytest 9.2 with xdist 3.8),
# every test goes to whichever worker is free and each worker plans the family again, minutes of CPU
# lost without a word, so a worker that finds a test ungrouped stops the run.
_SHARED_PLANS = frozenset({"test_plan_agreement", "test_step_bound", "test_plan_one_number", "test_lower_by_class"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else item.nodeid
        item.add_marker(pytest.mark.xdist_group("planned" if module in _SHARED_PLANS else module))


def pytest_collection_finish(session) -> None:
    if not getattr(session.config.option, "loadgroup", False):   # set in xdist's workers only
        return
    ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid]
    if ungrouped:   # Note [parallel suite]
        message = (f"pytest-xdist's --dist loadgroup did not group {ungrouped[0]} (and {len(ungrouped) - 1} "
                   f"more): this pytest ({pytest.__version__}) and pytest-xdist do not work together; "
                   f"install the versions pyproject.toml's `test` extra allows")
        sys.stderr.write(f"tests/conftest.py: {message}\n")   # a worker's UsageError alone is not shown
        raise pytest.UsageError(message)


def demo_job(*edits: tuple[str, str], job: str = "job.het") -> str:
    """The demo job specs/demo/JOB with its `use` and data paths absolute, to write into any folder, and then
    each (old, new) edit, which must find its text."""
    text = (DEMO / job).read_text()
    text = text.replace('use "../catalog.het"', f'use "{SPECS / "catalog.het"}"')
    text = text.replace('path = "data/', f'path = "{DEMO / "data"}/')
    for old, new in edits:
        if old not in text:
            raise AssertionError(f"{old!r} is not in specs/demo/{job}")
        text = text.replace(old, new)
    return text


def all_spec_files() -> list[Path]:
    return sorted(SPECS.rglob("*.het"))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"reference data not present at {SHARED_DATA} (only in the development workspace)")
    return SHARED_DATA


# ---------------------------------------------------------------- multi-process runtime tests

REFERENCE_STEPS = 5


@pytest.fixture(scope="session")
def rank_pool():
    """Four gloo ranks shared by every runtime test of the session (tests/rank_pool.py)."""
    from tests.rank_pool import RankPool

    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def demo_plan_dirs(tmp_path_factory) -> dict:
    """Every demo plan compiled once: {stem: plan directory}."""
    from tests.plans import DEMO_PLANS
    from tests.rank_pool import compile_plans

    return compile_plans(DEMO_PLANS, tmp_path_factory.mktemp("demo_plans"))


def _reference_of(demo_plan_dirs, single: str):
    """The 1-process reference run, for REFERENCE_STEPS steps (losses, final params), of the job of demo plan
    `single`."""
    from hetc.plandir import read_plan
    from hetc.runtime.reference import train_reference

    plan_dir = demo_plan_dirs[single]
    _, checked = read_plan(plan_dir)
    return train_reference(checked.spec.model, checked.spec.train, base_dir=plan_dir, steps=REFERENCE_STEPS)


@pytest.fixture(scope="session")
def demo_reference(demo_plan_dirs):
    """The demo job's reference (specs/demo/job.het)."""
    return _reference_of(demo_plan_dirs, "single")


@pytest.fixture(scope="session")
def moe_reference(demo_plan_dirs):
    """The MoE demo job's reference (moe_job.het)."""
    return _reference_of(demo_plan_dirs, "moe_single")


@pytest.fixture(scope="session")
def tied_reference(demo_plan_dirs):
    """The tied demo job's reference (tied_job.het)."""
    return _reference_of(demo_plan_dirs, "tied_single")


# ---------------------------------------------------------------- planned plans


@pytest.fixture(scope="session")
def plan_cache(tmp_path_factory):
    """The agreement family and specs/, each planned and built once per session (tests/planned.py)."""
    from tests.planned import PlanCache
    return PlanCache(tmp_path_factory.mktemp("planned"))
