"""One rank of `hetc run`: set up from the environment torchrun provides, train, report.

Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT like any
torch.distributed program (torchrun sets them; `hetc run --local` too).
RANK is only the launch order: placement by discovery (runtime/placement.py)
decides which GPU of the plan this process runs, and the process group is
created with the plan's ranks. SIGTERM stops every rank after the same step
with a checkpoint (runtime/preempt.py); saves are asynchronous
(Note [Async saves]).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hetc.passes.verify import verify
from hetc.plandir import read_plan, read_program
from hetc.runtime.comm import make_groups
from hetc.runtime.data import make_data_source
from hetc.runtime.evaluate import make_evaluator
from hetc.runtime.local import NODE_ENV
from hetc.runtime.nn import collectives
from hetc.runtime.nn.collectives import is_comm_failure
from hetc.runtime.placement import ClusterMismatch, discover, local_process, place
from hetc.runtime.preempt import PREEMPTED_STATUS, Preemption
from hetc.runtime.report import Reporter
from hetc.runtime.setup import build_rank
from hetc.runtime.watchdog import Watchdog, attempt_prefix, store_client
from hetc.spec import DeviceSpec

__all__ = ["EnvError", "Launch", "PeerFailure", "RunOptions", "describe_latest", "launch_env",
           "rendezvous_store", "run_placed", "run_worker"]

log = logging.getLogger("hetc.runtime")


class EnvError(RuntimeError):
    """The launch environment is wrong (missing torchrun variables, wrong world size)."""


class PeerFailure(RuntimeError):
    """Another rank died or stopped answering; the message names it."""


@dataclass(frozen=True)
class RunOptions:
    steps: int | None = None
    metrics: Path | None = None
    trace: Path | None = None
    checkpoint: Path | None = None
    every: int = 0
    keep: int | None = None
    resume: bool = False
    timeout_s: float = 120.0
    heartbeat_timeout_s: float = 10.0
    grace_s: float = 30.0
    elastic: bool = False
    quiet: bool = False


@dataclass(frozen=True)
class Launch:
    """This process as its launcher started it (torchrun or `hetc run --local`)."""

    rank: int            # launch rank: torchrun's RANK, not the plan's
    world: int
    local_rank: int
    agent: str           # which launched node: the `--node` label, else host and the agent's GROUP_RANK
    label: str           # "GROUP[i]" when `hetc launch --node` / `--local` said which plan node this is

    def process(self, device: torch.device):
        return local_process(self.rank, self.local_rank, self.agent, self.label, device)


def launch_env() -> Launch:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise EnvError(f"not launched by torchrun ({', '.join(missing)} unset): use "
                       "`torchrun --nproc-per-node N -m hetc run DIR` or `hetc run DIR --local`")
    label = os.environ.get(NODE_ENV, "")
    agent = label or f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"
    return Launch(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")),
                  agent, label)


def rendezvous_store(launch: Launch, timeout_s: float):
    """The store the processes meet in: the agent's (torchrun's default, `--local`), or one that launch
    rank 0 hosts (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), as torch's env:// would."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=launch.world,
                          is_master=not agent_store and launch.rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(attempt_prefix(), store)


def discovery_device() -> torch.device:
    """The device a process reports before it knows its plan GPU: its local CUDA device, if any."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def run_worker(plan_dir: Path, opts: RunOptions) -> int:
    launch = launch_env()
    _, checked = read_plan(plan_dir)
    program = read_program(plan_dir)
    verify(program, checked.pipeline, checked.spec)
    if launch.world != program.world_size:
        raise EnvError(f"the plan has {program.world_size} ranks but WORLD_SIZE is {launch.world}")
    store = rendezvous_store(launch, opts.timeout_s)
    procs = discover(store, launch.process(discovery_device()), launch.world)
    placement = place(checked.pipeline.world, procs)
    return run_placed(plan_dir, checked, program, placement.plan_rank[launch.rank], launch, store, opts)


def run_placed(plan_dir: Path, checked, program, rank: int, launch: Launch, store, opts: RunOptions,
               on_resumed: Callable[[int, float], None] | None = None,
               on_first_step: Callable[[], None] | None = None) -> int:
    """Train as plan rank `rank` (placed by discovery): the process group, the watchdog, the steps.

    `on_resumed(step, seconds)` hears where the run resumed and how long the load took,
    `on_first_step()` when the first step is done (elastic reports)."""
    spec, pipeline = checked.spec, checked.pipeline
    world = program.world_size
    device = _device(pipeline.world[rank].device, launch.local_rank)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore("hetc/pg", store),
                            rank=rank, world_size=world, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    watchdog = Watchdog(store_client(), rank, world,
                        timeout=opts.heartbeat_timeout_s)
    watchdog.start()
    completed = False
    preemption = Preemption(store, rank, opts.grace_s)
    try:
        hooks = _Hooks(on_resumed, on_first_step)
        status = _train(plan_dir, opts, rank, spec, pipeline, program, device, timeout, preemption, hooks)
        completed = True
    except (RuntimeError, dist.DistError) as err:
        if isinstance(err, ClusterMismatch) or not is_comm_failure(err):
            raise
        dead = watchdog.silent_ranks()
        if len(dead) == 1:
            watchdog.declare_dead(dead[0])
        who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}" if dead else "another rank"
        detail = str(err).splitlines()[0].split(" This is typically")[0]
        where = "".join(f"{note}: " for note in getattr(err, "__notes__", ()))   # the interpreter's instruction
        raise PeerFailure(f"{who} stopped responding (noticed by rank {rank}: {where}{detail[:300]})") from None
    finally:
        watchdog.finish(completed)
        preemption.close()
    if status == 0:
        dist.barrier()
    dist.destroy_process_group()
    return status


def _train(plan_dir: Path, opts: RunOptions, rank: int, spec, pipeline, program, device: torch.device,
           timeout: datetime.timedelta, preemption: Preemption, hooks: _Hooks) -> int:
    groups = make_groups(program.groups, timeout)
    data = make_data_source(spec.model, spec.train, plan_dir)
    rt = build_rank(spec, pipeline, program, rank, groups, data, device, resumes=_resumes(opts))
    evaluator = make_evaluator(spec, pipeline, program, rank, plan_dir)
    saver = _checkpointer(rt, opts, timeout)
    if opts.elastic:        # every rank: the load time below is the load's, not the wait for the last rank to start
        collectives.barrier()
    loading = time.perf_counter()
    start = _resume(rt, opts) if opts.resume else 0
    if hooks.on_resumed is not None:
        hooks.on_resumed(start, time.perf_counter() - loading)
    reporter = Reporter(rank, spec, pipeline, program, opts, device, append=start > 0)
    steps = spec.train.steps if opts.steps is None else opts.steps
    for step in range(start, steps):
        traced = opts.trace is not None and step == steps - 1
        result = rt.interpreter.run_step(step, trace=traced, classes=opts.metrics is not None)
        val_loss = evaluator.run(rt.interpreter) if evaluator is not None and evaluator.due(step + 1) else None
        reporter.step(step, steps, result, val_loss)
        if step == start and hooks.on_first_step is not None:
            hooks.on_first_step()
        if preemption.should_stop(step + 1) and step + 1 < steps:
            return _preempted(saver, rank, step + 1)
        if saver is not None and _saves_after(opts, step + 1, steps):
            saver.save(step + 1)
        elif saver is not None:
            saver.poll()
    if saver is not None:
        saver.wait()
    reporter.finish()
    return 0


@dataclass(frozen=True)
class _Hooks:
    on_resumed: Callable[[int, float], None] | None = None
    on_first_step: Callable[[], None] | None = None


def _checkpointer(rt, opts: RunOptions, timeout: datetime.timedelta):
    if opts.checkpoint is None:
        return None
    from hetc.runtime.checkpoint import Checkpointer

    # a gloo group of its own for the background writer: see Note [Async saves]
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timeout, backend="gloo")
    return Checkpointer(rt, opts.checkpoint, opts.keep, group, asynchronous=True)


def _preempted(saver, rank: int, done: int) -> int:
    """Every rank stops after `done` steps: save them (completely) and exit; see Note [Preemption]."""
    if saver is not None:
        saver.save(done)
        saver.wait()
    if rank == 0:
        where = f"checkpoint {saver.directory / f'step-{done}'} is complete" if saver else "no --checkpoint"
        print(f"hetc run: SIGTERM: stopped after step {done}; {where}; exiting with status {PREEMPTED_STATUS} "
              "so that torchrun restarts", file=sys.stderr, flush=True)
    return PREEMPTED_STATUS


def describe_latest(directory: Path | None) -> str:
    """Which checkpoint a rerun with --resume would start from (for messages after an interruption)."""
    if directory is None:
        return "no checkpoint was being saved (no --checkpoint)"
    from hetc.runtime.checkpoint import CheckpointError, latest_checkpoint

    try:
        path = latest_checkpoint(directory)
    except CheckpointError as err:
        return str(err)
    if path is None:
        return f"no complete checkpoint in {directory} yet"
    return f"the latest complete checkpoint is {path} (continue with --resume)"


def _saves_after(opts: RunOptions, done: int, last: int) -> bool:
    """Checkpoint every `every` steps and after the last one."""
    return opts.checkpoint is not None and (done == last or (opts.every > 0 and done % opts.every == 0))


def _device(kind: DeviceSpec, local_rank: int) -> torch.device:
    if kind.is_cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ClusterMismatch(f"the plan puts a {kind.name} on this rank but CUDA is not available here")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _resumes(opts: RunOptions) -> bool:
    """Whether `_resume` will load a checkpoint (not start at step 0 because none was saved yet)."""
    if not opts.resume or opts.checkpoint is None:
        return False    # no import of the checkpoint module (torch.distributed.checkpoint takes a second)
    from hetc.runtime.checkpoint import latest_checkpoint

    return latest_checkpoint(opts.checkpoint) is not None


def _resume(rt, opts: RunOptions) -> int:
    from hetc.runtime.checkpoint import load_checkpoint

    if opts.checkpoint is None:
        raise EnvError("--resume needs --checkpoint DIR")
    return load_checkpoint(rt, opts.checkpoint)
