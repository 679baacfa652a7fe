"""`hetc run SPEC --elastic`: on every (re)start, plan SPEC on the nodes present and resume.

Note [Elastic runs]
Membership and restarts are torchrun's (torch.distributed.elastic): with
`--nnodes MIN:MAX --max-restarts K`, a node that leaves makes the
survivors' workers fail (a peer stops answering, runtime/watchdog.py) and
their agents restart them in a new rendezvous round; a node that joins
makes the agents restart theirs (SIGTERM first, which saves the step in
flight, Note [Preemption]). Each start of the workers is one pass here:

  1. every process reports itself in the store (placement by discovery);
  2. the spec's cluster is cut down to the nodes present (a node group keeps
     as many nodes as were launched for it, Note [Placement by discovery]);
  3. launch rank 0 plans it (`plan_checked`), compiles and verifies it into
     CHECKPOINT/elastic/plan-R (R counts the starts), and names the folder in the
     store; the rest wait for the name and check their files against what
     compile verified (Note [verified once] in hetc/plandir.py);
  4. processes the plan uses run it, resuming as --resume-if-present does
     (the newest intact checkpoint, or step 0 on the first start: Note
     [Which checkpoint --resume loads]; plan-free, so resharded on load);
     the others idle until the run ends;
  5. plan rank 0 prints what changed and the reconfiguration time split into
     re-plan, compile+verify and checkpoint load, and appends it to
     CHECKPOINT/elastic/reconfig.jsonl (benchmarks/elastic.py reads it).

Training continues on the same data order: the data source is a function
of (step, microbatch), so the losses are those of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from hetc.ir.errors import SpecError
from hetc.ir.plan import Plan
from hetc.plandir import open_program, read_eval_rank, read_plan, require_verified
from hetc.runtime.placement import Process, discover, node_label, place
from hetc.runtime.local import process_start_time
from hetc.runtime.worker import Launch, RunOptions, discovery_device, launch_env, rendezvous_store, run_placed
from hetc.ir.spec import Spec
from hetc.ir.topology import Topology

__all__ = ["ELASTIC_DIR", "ReconfigError", "present_spec", "run_elastic"]

log = logging.getLogger("hetc.runtime")

ELASTIC_DIR = "elastic"
PLAN_KEY = "hetc/elastic/plan"
FINISHED_KEY = "hetc/elastic/finished"
PLAN_WAIT_S = 600.0


class ReconfigError(RuntimeError):
    """The nodes present cannot run the spec (the message says why)."""


def present_spec(spec: Spec, procs: list[Process]) -> tuple[Spec, list[Process]]:
    """The spec on the nodes `procs` were launched on, and `procs` labelled with their nodes in it."""
    cluster = spec.cluster
    if cluster is None:
        raise ReconfigError("the spec has no cluster block: an elastic run places its ranks on the cluster's nodes")
    placement = place(Topology(cluster, spec.devices).gpus, procs, elastic=True, partial=True)
    present: dict[str, list[int]] = {}
    for host in sorted(set(placement.nodes.values()), key=lambda h: (h[0], h[1])):
        present.setdefault(host[0], []).append(host[1])
    renumber = {(g, old): new for g, olds in present.items() for new, old in enumerate(olds)}
    nodes = tuple(dataclasses.replace(n, count=len(present[n.name])) for n in cluster.nodes if n.name in present)
    gone = {n.name for n in cluster.nodes} - set(present)
    links = tuple(link for link in cluster.links if link.a not in gone and link.b not in gone)
    cut = dataclasses.replace(spec, cluster=dataclasses.replace(cluster, nodes=nodes, links=links))
    relabelled = []
    for proc in procs:
        node = placement.nodes.get(proc.agent)
        label = node_label(node[0], renumber[node]) if node is not None else ""
        relabelled.append(dataclasses.replace(proc, label=label))
    return cut, relabelled


def run_elastic(spec_path: Path, opts: RunOptions) -> int:
    checkpoint = opts.checkpoint
    assert checkpoint is not None, "`hetc run --elastic` requires --checkpoint"
    entered = time.time()
    launch = launch_env()
    store = rendezvous_store(launch, opts.init_timeout_s)
    procs = discover(store, launch.process(discovery_device()), launch.world)
    plan_dir, timings = _plan(spec_path, checkpoint, launch, store, procs)
    _, checked = read_plan(plan_dir)
    program = open_program(plan_dir, len(checked.pipeline.world))    # Note [a rank reads its own]
    _, labelled = present_spec(_load(spec_path), procs)
    placement = place(checked.pipeline.world, labelled, elastic=True)
    rank = placement.rank_of(launch.rank)
    if rank is None:
        print(f"hetc run: launch rank {launch.rank} idles: the plan for the nodes present does not use it",
              file=sys.stderr, flush=True)
        store.wait([FINISHED_KEY], _forever())
        return 0
    check_start = time.perf_counter()
    require_verified(plan_dir, [rank], program, checked)    # compiled on launch rank 0 (Note [verified once])
    timings["compile_verify_s"] += time.perf_counter() - check_start
    report = _Report(checkpoint, plan_dir, checked, timings, entered) if rank == 0 else None
    status = run_placed(plan_dir, checked, program, rank, launch, store, opts, read_eval_rank(plan_dir, rank),
                        on_resumed=report.resumed if report else None,
                        on_first_step=report.first_step if report else None)
    if rank == 0 and status == 0:
        store.set(FINISHED_KEY, "1")
    return status


def _load(spec_path: Path) -> Spec:
    from hetc.frontend.load import load_spec

    return load_spec(spec_path).spec


def _plan(spec_path: Path, checkpoint: Path, launch: Launch, store: Any, procs: list[Process]) -> tuple[Path, dict[str, float]]:
    """Launch rank 0 plans and compiles; everyone gets (plan directory, its timings) from the store."""
    if launch.rank == 0:
        try:
            message = json.dumps(_plan_here(spec_path, checkpoint, procs))
        except (SpecError, ReconfigError) as err:
            message = json.dumps({"error": _describe(err)})
        store.set(PLAN_KEY, message)
    store.wait([PLAN_KEY], _seconds(PLAN_WAIT_S))
    answer = json.loads(store.get(PLAN_KEY))
    if "error" in answer:
        raise ReconfigError(f"cannot plan {spec_path} on the nodes present: {answer['error']}")
    return Path(answer["plan_dir"]), {"replan_s": answer["replan_s"], "compile_verify_s": answer["compile_s"]}


def _plan_here(spec_path: Path, checkpoint: Path, procs: list[Process]) -> dict[str, Any]:
    from hetc.compiler import compile_spec, write_compiled
    from hetc.passes.plan.planner import plan_checked
    from hetc.plandir import portable_spec
    from hetc.frontend.printer import format_spec

    cut, _ = present_spec(_load(spec_path), procs)
    start = time.perf_counter()
    checked = plan_checked(cut, spec_path.parent)
    planned = time.perf_counter()
    folder = Path(checkpoint) / ELASTIC_DIR
    folder.mkdir(parents=True, exist_ok=True)
    number = len(list(folder.glob("plan-*.het")))
    explicit = folder / f"plan-{number}.het"
    explicit.write_text(format_spec(portable_spec(checked.spec, spec_path.parent, folder)))
    out = folder / f"plan-{number}"
    write_compiled(compile_spec(explicit), out)
    return {"plan_dir": str(out.resolve()), "replan_s": planned - start, "compile_s": time.perf_counter() - planned}


def _describe(err: Exception) -> str:
    if isinstance(err, SpecError):
        return "; ".join(d.message for d in err.diagnostics)
    return str(err)


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def _forever() -> datetime.timedelta:
    return _seconds(7 * 24 * 3600.0)


class _Report:
    """What plan rank 0 says about a reconfiguration; see Note [Elastic runs]."""

    def __init__(self, checkpoint: Path, plan_dir: Path, checked: Plan, timings: dict[str, float], entered: float):
        self.folder = Path(checkpoint) / ELASTIC_DIR
        self.plan_dir, self.checked, self.timings, self.entered = plan_dir, checked, timings, entered

    def resumed(self, start_step: int, load_s: float) -> None:
        now = _layout(self.checked)
        last_file = self.folder / "last.json"
        before = json.loads(last_file.read_text()) if last_file.is_file() else None
        change = "first start" if before is None else \
            "unchanged" if before == now else f"was {before['summary']}"
        t = self.timings
        print(f"hetc run --elastic: {now['summary']} ({change}); resuming at step {start_step}; "
              f"reconfiguration {t['replan_s'] + t['compile_verify_s'] + load_s:.2f} s: re-plan "
              f"{t['replan_s']:.2f} s, compile+verify {t['compile_verify_s']:.2f} s, checkpoint load "
              f"{load_s:.2f} s", file=sys.stderr, flush=True)
        last_file.write_text(json.dumps(now))
        self.record = {"plan": self.plan_dir.name, "ranks": now["ranks"], "nodes": now["nodes"],
                       "start_step": start_step, "process_start": process_start_time(), "entered": self.entered,
                       **t, "load_s": load_s}

    def first_step(self) -> None:
        with open(self.folder / "reconfig.jsonl", "a") as f:
            f.write(json.dumps({**self.record, "first_step_done": time.time()}) + "\n")


def _layout(checked: Plan) -> dict[str, Any]:
    p = checked.pipeline
    nodes = sorted({node_label(*gpu.host) for gpu in p.world})
    stages = "; ".join(f"{st.name}: {len(st.lanes)} lane{'s' if len(st.lanes) > 1 else ''}" for st in p.stages)
    return {"ranks": p.world_size, "nodes": nodes,
            "summary": f"{p.world_size} ranks on {', '.join(nodes)}, {p.schedule.value}, {stages}"}

