"""Random plans train like one rank: the runtime against plans nobody wrote.

`random_demo_plan` (tests/random_plans.py) draws plans of the three demo jobs
on their 4 CPU ranks: any split of the ranks into stages, tp, cp, sequence and
expert parallelism, uneven routing, ministages, activation checkpointing,
offload, hierarchical ZeRO. The first draw of a seed that compiles must train
to its job's 1-rank losses and parameters (tests/test_plan_invariance.py's
check) under gloo's order or NCCL's, and every draw before it must be refused
as a located error, never a crash. A search over a few thousand seeds (by hand)
found two plans that compiled and verified but stopped the runtime:
hierarchical ZeRO over lanes 2 + 1 on two nodes, now refused
(passes/validate_plan.py), and over stages of one node each with across = 1
(`Geometry.outer_group`), which seed 468 of job.het draws again.
"""

from __future__ import annotations

import random
import re

import pytest

from hetc.cli import main as hetc_main
from hetc.runtime.checkpoint import latest_checkpoint
from tests.conftest import DEMO, REFERENCE_STEPS
from tests.random_plans import random_chunks_plan, random_demo_plan
from tests.rank_pool import COMM_ORDERS, PlanJob, agreed_losses, assert_losses_close, assert_params_close

# (job, seed): few enough to run in a quarter of a minute (the suite's 15 minutes are nearly spent)
RANDOM_PLANS = [("job.het", seed) for seed in [0, 1, 2, 468]] + [("moe_job.het", 0), ("tied_job.het", 0)]
# interleaved 1F1B over contiguous chunks: seed 7 draws stages of 1, 3 and 2 chunks behind a stage of two lanes
CHUNK_PLANS = [("job.het", 7)]
REFERENCES = {"job.het": "demo_reference", "moe_job.het": "moe_reference", "tied_job.het": "tied_reference"}
LOCATED = re.compile(r"^\S+\.het:\d+:\d+: error: ", re.MULTILINE)   # the plan's or its job's file, line, column
DRAWS = 20


@pytest.mark.parametrize("job, seed, draw", [(job, seed, random_demo_plan) for job, seed in RANDOM_PLANS] +
                         [(job, seed, random_chunks_plan) for job, seed in CHUNK_PLANS])
def test_a_random_plan_compiles_or_is_refused_located_and_trains_to_the_reference(job, seed, draw, request,
                                                                                rank_pool, tmp_path, capsys):
    rng = random.Random(seed)
    spec, plan_dir = tmp_path / "plan.het", tmp_path / "plan"
    for _ in range(DRAWS):
        spec.write_text(draw(rng, DEMO / job))
        status = hetc_main(["compile", str(spec), "-o", str(plan_dir)])
        err = capsys.readouterr().err
        if status == 0:
            break
        assert status == 2 and LOCATED.search(err) and "internal error" not in err, (spec.read_text(), err)
    else:
        pytest.fail(f"{DRAWS} draws of seed {seed} were all refused")
    reference = request.getfixturevalue(REFERENCES[job])
    order = rng.choice(sorted(COMM_ORDERS))
    reports = rank_pool.run(PlanJob(plan_dir, REFERENCE_STEPS, save_to=tmp_path / "ckpt", emulation=COMM_ORDERS[order]))
    assert_losses_close(agreed_losses(reports), reference.losses)
    assert_params_close(latest_checkpoint(tmp_path / "ckpt"), reference.params)
