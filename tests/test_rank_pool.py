"""The test pool of gloo ranks (tests/rank_pool.py): a job that hangs does not poison the jobs after it."""

from __future__ import annotations

import pytest

from tests.rank_pool import PlanJob, RankPool, agreed_losses, assert_losses_close

HANG_TIMEOUT_S = 5.0   # the hung job never answers: any timeout ends it; the next job has the default


@pytest.mark.slow
def test_a_hung_job_times_out_and_the_next_job_runs_on_fresh_workers(demo_plan_dirs, demo_reference):
    pool = RankPool(size=2)
    try:
        plan = demo_plan_dirs["single"]
        hung = pool.procs[0]
        with pytest.raises(TimeoutError, match="pool rank 0 did not answer"):
            pool.run(PlanJob(plan, 1, hang_on=0), timeout_s=HANG_TIMEOUT_S)
        assert not hung.is_alive() and pool.procs[0] is not hung
        losses = agreed_losses(pool.run(PlanJob(plan, 2)))
        assert_losses_close(losses, demo_reference.losses[:2])
    finally:
        pool.close()
