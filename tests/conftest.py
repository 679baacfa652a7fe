"""Shared fixtures and paths for the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
DEMO = SPECS / "demo"
SHARED_DATA = ROOT.parent / "shared" / "data"

# One intra-op thread per process (also for ranks that tests spawn): on the
# shared 2-core machines, OpenMP threads spinning against other processes made
# tiny CPU models ~40x slower. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def all_spec_files() -> list[Path]:
    return sorted(SPECS.rglob("*.het"))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"reference data not present at {SHARED_DATA} (only in the development workspace)")
    return SHARED_DATA
