"""Two "nodes" on loopback: two torchrun launches of 2 processes each run a compiled 4-rank plan.

torchrun's c10d rendezvous assigns global ranks in the order the agents
join (it ignores --node-rank), so either launch may hold rank 0; each gets
its own metrics file and exactly one of them (rank 0's) is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from hetc.runtime.local import free_port
from tests.conftest import ROOT
from tests.rank_pool import assert_losses_close

STEPS = 3


@pytest.mark.slow
def test_two_torchrun_launches_run_a_4_rank_plan(demo_plan_dirs, demo_reference, tmp_path):
    port = free_port()
    with contextlib.ExitStack() as stack:
        launches = []
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "-m", "hetc", "run", str(demo_plan_dirs["pp"]), "--steps", str(STEPS),
                   "--metrics", str(tmp_path / f"node{node}.jsonl")]
            out = stack.enter_context(open(tmp_path / f"node{node}.log", "w"))
            proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out,
                                    stderr=subprocess.STDOUT)
            stack.callback(lambda p=proc: p.poll() is None and p.kill())
            launches.append(proc)
        codes = [proc.wait(timeout=240) for proc in launches]
    logs = "\n".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1))
    assert codes == [0, 0], logs
    written = [p for p in tmp_path.glob("node*.jsonl")]
    assert len(written) == 1, logs
    records = [json.loads(line) for line in written[0].read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))   # 1-based, as the console counts
    assert len(records[0]["peak_memory_bytes"]) == 4
    assert_losses_close(tuple(r["loss"] for r in records), demo_reference.losses[:STEPS])
