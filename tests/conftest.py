"""Shared fixtures and paths for the test suite."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
DEMO = SPECS / "demo"
SHARED_DATA = ROOT.parent / "shared" / "data"


def all_spec_files() -> list[Path]:
    return sorted(SPECS.rglob("*.het"))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"reference data not present at {SHARED_DATA} (only in the development workspace)")
    return SHARED_DATA
