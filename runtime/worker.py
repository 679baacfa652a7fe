"""One rank of `hetc run`: set up from the environment torchrun provides, train, report.

Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT like any
torch.distributed program (torchrun sets them; `hetc run --local` too).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hetc.passes.verify import verify
from hetc.plandir import read_plan, read_program
from hetc.runtime.cluster_check import ClusterMismatch, check_cluster, local_info
from hetc.runtime.comm import make_groups
from hetc.runtime.data import make_data_source
from hetc.runtime.evaluate import make_evaluator
from hetc.runtime.report import Reporter
from hetc.runtime.setup import build_rank
from hetc.runtime.watchdog import Watchdog, store_client
from hetc.spec import DeviceSpec

__all__ = ["EnvError", "PeerFailure", "RunOptions", "run_worker"]

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
    resume: bool = False
    timeout_s: float = 120.0
    heartbeat_timeout_s: float = 10.0
    quiet: bool = False


def _env() -> tuple[int, int, int]:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise EnvError(f"not launched by torchrun ({', '.join(missing)} unset): use "
                       "`torchrun --nproc-per-node N -m hetc run DIR` or `hetc run DIR --local`")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def run_worker(plan_dir: Path, opts: RunOptions) -> int:
    rank, world, local_rank = _env()
    _, checked = read_plan(plan_dir)
    program = read_program(plan_dir)
    spec, pipeline = checked.spec, checked.pipeline
    verify(program, pipeline, spec)
    if world != program.world_size:
        raise EnvError(f"the plan has {program.world_size} ranks but WORLD_SIZE is {world}")
    kind = pipeline.world[rank].device
    device = _device(kind, local_rank)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timeout, **({"device_id": device} if device.type == "cuda" else {}))
    watchdog = Watchdog(store_client(), rank, world,
                        timeout=opts.heartbeat_timeout_s)
    watchdog.start()
    completed = False
    try:
        _train(plan_dir, opts, rank, local_rank, spec, pipeline, program, device, timeout)
        completed = True
    except (RuntimeError, dist.DistError) as err:
        if isinstance(err, ClusterMismatch) or not _is_comm_failure(err):
            raise
        dead = watchdog.silent_ranks()
        if len(dead) == 1:
            watchdog.declare_dead(dead[0])
        who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}" if dead else "another rank"
        detail = str(err).splitlines()[0].split(" This is typically")[0]
        raise PeerFailure(f"{who} stopped responding (noticed by rank {rank}: {detail[:300]})") from None
    finally:
        watchdog.finish(completed)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _is_comm_failure(err: BaseException) -> bool:
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "Timed out", "timed out",
                            "NCCL", "gloo"))


def _train(plan_dir: Path, opts: RunOptions, rank: int, local_rank: int, spec, pipeline, program,
           device: torch.device, timeout: datetime.timedelta) -> None:
    infos = check_cluster(pipeline, local_info(local_rank, device))
    groups = make_groups(program.groups, timeout)
    data = make_data_source(spec.model, spec.train, plan_dir)
    rt = build_rank(spec, pipeline, program, rank, groups, data, device)
    evaluator = make_evaluator(spec, pipeline, program, rank, plan_dir)
    reporter = Reporter(rank, spec, pipeline, program, infos, opts, device)
    start = _resume(rt, opts) if opts.resume else 0
    steps = spec.train.steps if opts.steps is None else opts.steps
    for step in range(start, steps):
        traced = opts.trace is not None and step == steps - 1
        result = rt.interpreter.run_step(step, trace=traced, classes=opts.metrics is not None)
        val_loss = evaluator.run(rt.interpreter) if evaluator is not None and evaluator.due(step + 1) else None
        reporter.step(step, steps, result, val_loss)
        if _saves_after(opts, step + 1, steps):
            _save(rt, opts, step + 1)
    reporter.finish()


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


def _save(rt, opts: RunOptions, step: int) -> None:
    from hetc.runtime.checkpoint import save_checkpoint

    save_checkpoint(rt, opts.checkpoint, step)


def _resume(rt, opts: RunOptions) -> int:
    from hetc.runtime.checkpoint import load_checkpoint

    if opts.checkpoint is None:
        raise EnvError("--resume needs --checkpoint DIR")
    return load_checkpoint(rt, opts.checkpoint)
