"""A rank of `hetc run`: its plan directory read (the plan, the group table and its own listings, checked
against what `hetc compile` verified), its place among the ranks found, then the runtime's steps.

The plan directory belongs to the drivers (hetc/plandir.py); the runtime below them takes the plan and
the program as values (runtime/worker.py `run_placed`).
"""

from __future__ import annotations

import time
from pathlib import Path

from hetc.plandir import open_program, read_eval_rank, read_plan, require_verified
from hetc.runtime.inject import check_ranks
from hetc.runtime.options import RunOptions
from hetc.runtime.placement import discover, place
from hetc.runtime.report import StartupProgress
from hetc.runtime.worker import EnvError, discovery_device, launch_env, rendezvous_store, run_placed

__all__ = ["run_worker"]


def run_worker(plan_dir: Path, opts: RunOptions) -> int:
    started = time.perf_counter()
    launch = launch_env()
    _, plan = read_plan(plan_dir)
    program = open_program(plan_dir, len(plan.pipeline.world))    # Note [a rank reads its own]
    if launch.world != program.world_size:
        raise EnvError(f"the plan has {program.world_size} ranks but WORLD_SIZE is {launch.world}")
    if not opts.elastic:    # an elastic job's plans change size; an injection holds where its ranks exist
        check_ranks(opts.inject, program.world_size)
    store = rendezvous_store(launch, opts.init_timeout_s)
    procs = discover(store, launch.process(discovery_device()), launch.world)
    placement = place(plan.pipeline.world, procs)
    rank = placement.plan_rank[launch.rank]
    require_verified(plan_dir, [rank], program, plan)    # Note [verified once] in hetc/plandir.py
    progress = StartupProgress(rank == 0 and not opts.quiet, since=started)
    progress.done(f"placed {launch.world} rank{'s' if launch.world > 1 else ''}")
    return run_placed(plan_dir, plan, program, rank, launch, store, opts, read_eval_rank(plan_dir, rank),
                      progress=progress)
