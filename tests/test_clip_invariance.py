"""Global gradient-norm clipping is plan-invariant too.

The demo job has no clipping, so these plans rerun it with `grad_clip`
small enough to clip every step. Clipping needs the norm over every
parameter exactly once (ZeRO shards, replicas, TP slices, ministages on
other stages) before any step, which also moves Zorse's interleaved
optimizer steps to after the norm.
"""

from __future__ import annotations

import shutil

import pytest

from hetc.runtime.checkpoint import latest_checkpoint
from tests.conftest import DEMO, REFERENCE_STEPS, demo_job
from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, assert_params_close, compile_plans

CLIP = 0.05
PLANS = ["single", "zero3", "hsdp", "pp", "zero3_offload", "tp2_cp2", "hetero_tp"]


@pytest.fixture(scope="module")
def clip_plans(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("clip")
    (folder / "job.het").write_text(demo_job(("  lr = 3e-3\n", f"  lr = 3e-3\n  grad_clip = {CLIP}\n")))
    for name in PLANS:
        shutil.copy(DEMO / f"{name}.het", folder / f"{name}.het")
    return compile_plans([folder / f"{name}.het" for name in PLANS], folder / "plans")


@pytest.fixture(scope="module")
def clip_reference(clip_plans):
    from hetc.plandir import read_plan
    from hetc.runtime.reference import train_reference

    _, checked = read_plan(clip_plans["single"])
    assert checked.spec.train.grad_clip == CLIP
    result = train_reference(checked.spec.model, checked.spec.train, base_dir=clip_plans["single"],
                             steps=REFERENCE_STEPS)
    assert all(norm > CLIP for norm in result.grad_norms), "the test wants every step clipped"
    return result


@pytest.mark.parametrize("plan", PLANS)
def test_clipped_plan_matches_reference(plan, rank_pool, clip_plans, clip_reference, tmp_path):
    reports = rank_pool.run(PlanJob(clip_plans[plan], REFERENCE_STEPS, save_to=tmp_path))
    assert_losses_close(agreed_losses(reports), clip_reference.losses)
    assert_params_close(latest_checkpoint(tmp_path), clip_reference.params)
