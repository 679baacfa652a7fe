"""Checkpoints of tensor-parallel plans hold full parameters: they resume under other layouts.

A TP rank writes its slice of each split parameter at the slice's offsets
in the full parameter (row-parallel slices row by row) and tp rank 0 alone
writes the parameters every tp rank holds whole (runtime/pieces.py), so a
checkpoint saved under one block layout resumes under another and the run
ends on the 1-rank reference (pool of gloo ranks, tests/rank_pool.py).
"""

from __future__ import annotations

import pytest

from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, assert_params_close
from tests.test_checkpoint import SAVED_AT, _save_then_resume


@pytest.mark.parametrize("saver, resumer", [("tp2_cp2", "tp_to_cp"), ("hetero_tp", "single"), ("dp", "tp2")])
def test_resume_under_another_layout(saver, resumer, rank_pool, demo_plan_dirs, demo_reference, tmp_path):
    losses, path = _save_then_resume(rank_pool, demo_plan_dirs, tmp_path, saver, resumer)
    assert_losses_close(losses, demo_reference.losses[SAVED_AT:])
    assert_params_close(path, demo_reference.params)


def test_a_tp_rank_writes_only_its_slices(rank_pool, demo_plan_dirs, tmp_path):
    agreed_losses(rank_pool.run(PlanJob(demo_plan_dirs["tp2"], 1, save_to=tmp_path)))
    from hetc.runtime.checkpoint import latest_checkpoint, read_params

    params = read_params(latest_checkpoint(tmp_path))
    assert params["block0.attention.wq.weight"].numel() == 64 * 64        # the full projection
    assert params["block0.attention.wo.weight"].numel() == 64 * 64
