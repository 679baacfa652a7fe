"""A persistent pool of gloo ranks that run compiled plans one after another (multi-process tests).

Starting four Python processes that import torch costs seconds on the
2-core test machines; a pool pays it once per session. Per job, the first k
workers (k: the plan's ranks) form a default process group of their own on
a fresh port, exactly as torchrun's k processes would, so the runtime needs
no special case for the pool; they create the plan's groups, build their
rank runtime, run the steps, optionally resume from / save a checkpoint,
destroy every group and report. The other workers sit the job out.

A test of code below the plan (a lane's kernels, say) may instead call a
function of its own on the workers (`RankPool.call`), in a default group of
all four, rather than start four processes of its own.

A job may hold gloo to NCCL's order (`PlanJob.emulation`, per job, since the
workers outlive it; `COMM_ORDERS` names the two ways to run a plan for a
parametrized test: Note [NCCL order on gloo] in runtime/nccl_order.py).

A job that does not answer in time (a hang, a dead worker) fails with
TimeoutError, and the pool starts its workers afresh, so the jobs after it
run on clean processes rather than on ranks still stuck in the old one.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

from hetc.cli import main as hetc_main
from hetc.runtime.nccl_order import NcclEmulation

__all__ = [
    "COMM_ORDERS",
    "LOSS_RTOL",
    "PARAM_ATOL",
    "PARAM_RTOL",
    "CallJob",
    "PlanJob",
    "RankPool",
    "RankReport",
    "agreed_losses",
    "assert_losses_close",
    "assert_params_close",
    "compile_plans",
]

POOL_SIZE = 4
COLLECTIVE_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 240.0
PORT_TRIES = 3      # jobs whose rank 0 found its port taken (RankPool.run)

LOSS_RTOL = 1e-5      # the bound: per-step losses within 1e-5 relative of the 1-rank run
# Parameters after a few AdamW steps: another reduction order changes a
# gradient in its last bits, and Adam's normalised update turns that into
# up to ~6e-7 on weights of ~1e-2 (measured; lr 3e-3). Plans that split the
# sums inside a layer (tensor parallelism, the sequence over cp ranks) move
# the weights with the smallest gradients (below Adam's eps, where
# g / (|g| + eps) is steep) further: up to 5.8e-6 on the TP and CP demo
# plans, and 1.15e-5 on moe_ep2_cp2 (block2 expert 1's w3 [1010]; the same
# code passed at 1e-5 on an earlier machine, so those last bits depend on
# it). 5e-5 still leaves a factor of 60 to a wrong shard (an element stepped
# twice, or not at all), which moves weights by ~lr.
PARAM_RTOL, PARAM_ATOL = 1e-5, 5e-5

# The orders a job's ranks may run their communication in: gloo's own (each op starts when posted), or
# NCCL's (each rank's ops on one communicator start one after another: Note [NCCL order on gloo]). For
# `@pytest.mark.parametrize("order", COMM_ORDERS)` and `PlanJob(..., emulation=COMM_ORDERS[order])`.
COMM_ORDERS: dict[str, NcclEmulation | None] = {"gloo": None, "nccl": NcclEmulation()}


@dataclass(frozen=True)
class PlanJob:
    plan_dir: Path
    steps: int                        # run until this many optimizer steps are done
    resume_from: Path | None = None   # a checkpoint directory to resume from
    save_to: Path | None = None       # save a checkpoint after the last step
    fail_save_on: int | None = None   # test hook: this rank's storage writer fails during the save
    hang_on: int | None = None        # test hook: this rank never answers
    emulation: NcclEmulation | None = None   # hold gloo to NCCL's order (HETC_EMULATE_NCCL=1 of `hetc run`)


@dataclass(frozen=True)
class CallJob:
    """`fn(rank)` on every worker, in a default gloo group of all of them (torch.distributed initialised, as
    torchrun's processes have it); each worker's answer, or its traceback. `fn`: a module-level function (the
    workers unpickle it by name)."""
    fn: Callable[[int], object]
    world: int                        # the workers: the pool's size


@dataclass(frozen=True)
class RankReport:
    rank: int
    start: int                        # the first step run (after resuming)
    losses: tuple[float, ...]         # one per step run (the reduced loss every rank sees)
    error: str | None = None          # the traceback when the job failed on this rank
    val_losses: tuple[float, ...] = ()  # one per evaluation (train { eval_every })
    aux_losses: tuple[dict, ...] = ()   # one per step run: MoE's reported auxiliary losses, by AuxLoss


def compile_plans(specs: list[Path], out: Path) -> dict[str, Path]:
    """`hetc compile` each spec into out/<stem>; {stem: plan directory}."""
    dirs = {}
    for spec in specs:
        target = out / spec.stem
        status = hetc_main(["compile", str(spec), "-o", str(target)])
        assert status == 0, f"hetc compile {spec} exited with {status}"
        dirs[spec.stem] = target
    return dirs


def agreed_losses(reports: list[RankReport]) -> tuple[float, ...]:
    """The step losses of a job, after checking it succeeded and every rank saw the same."""
    failed = [r for r in reports if r.error is not None]
    assert not failed, f"rank {failed[0].rank} failed:\n{failed[0].error}"
    assert all(r.losses == reports[0].losses and r.start == reports[0].start for r in reports), \
        {r.rank: (r.start, r.losses) for r in reports}
    return reports[0].losses


def assert_losses_close(got: tuple[float, ...], want: tuple[float, ...]) -> None:
    assert len(got) == len(want), f"{len(got)} losses, expected {len(want)}"
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= LOSS_RTOL * abs(w), f"step {step}: loss {g!r}, reference {w!r}"


def assert_params_close(checkpoint: Path, want: dict) -> None:
    """The fp32 parameters in `checkpoint` (a step-N directory) equal `want` (by name, any shape)."""
    import torch

    from hetc.runtime.checkpoint import read_params

    got = read_params(checkpoint)
    assert set(got) == set(want), f"names differ: {sorted(set(got) ^ set(want))[:5]}"
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.reshape(-1), rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


class RankPool:
    def __init__(self, size: int = POOL_SIZE) -> None:
        self.size = size
        self.conns: list = []
        self.procs: list = []
        self._start()

    def run(self, job: PlanJob, timeout_s: float = REPLY_TIMEOUT_S) -> list[RankReport]:
        """Run `job` on every worker; the reports of the plan's ranks (workers beyond it report nothing).

        Raises TimeoutError when a worker does not answer within `timeout_s`
        (after restarting the workers, so that the next job is not stuck behind this one).
        """
        return [r for r in self._answers(job, timeout_s) if r is not None]

    def call(self, fn: Callable[[int], object], timeout_s: float = REPLY_TIMEOUT_S) -> list[object]:
        """`fn(rank)` on every worker (`CallJob`), their answers in rank order; a worker's exception fails the
        test with its traceback."""
        answers = self._answers(CallJob(fn, self.size), timeout_s)
        failed = [a for a in answers if isinstance(a, RankReport)]
        assert not failed, f"pool rank {failed[0].rank} failed:\n{failed[0].error}"
        return answers

    def _answers(self, job: PlanJob | CallJob, timeout_s: float) -> list:
        """Every worker's answer to `job`. A port taken between `free_port` and rank 0's listen (another
        process's connection got it: the suite runs two workers, each starting processes) is not the job's
        failure: it runs again on another port."""
        for _ in range(PORT_TRIES - 1):
            answers = self._run_once(job, timeout_s)
            if not any(isinstance(a, RankReport) and a.error is not None and "EADDRINUSE" in a.error
                       for a in answers):
                return answers
        return self._run_once(job, timeout_s)

    def _run_once(self, job: PlanJob | CallJob, timeout_s: float) -> list:
        from hetc.runtime.local import free_port

        port = free_port()
        deadline = time.monotonic() + timeout_s
        answers = []
        try:
            for conn in self.conns:
                conn.send((job, port))
            for rank, conn in enumerate(self.conns):
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"pool rank {rank} did not answer within {timeout_s:.0f} s")
                answers.append(conn.recv())
        except (TimeoutError, EOFError, OSError):
            self._restart()
            raise
        return answers

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass          # the worker is gone already
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def _restart(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()
        self._start()


# ---------------------------------------------------------------- inside a worker


def _serve(rank: int, conn) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    while (message := conn.recv()) is not None:
        job, port = message
        try:
            conn.send(_run_call(job, rank, port) if isinstance(job, CallJob) else _run_job(job, rank, port))
        except BaseException:  # noqa: BLE001 - report every failure to the test, keep serving
            conn.send(RankReport(rank, 0, (), traceback.format_exc()))


def _run_call(job: CallJob, rank: int, port: int) -> object:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job.world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        return job.fn(rank)
    finally:
        dist.destroy_process_group()   # the default group and every group `fn` made from it


def _run_job(job: PlanJob, rank: int, port: int) -> RankReport | None:
    import torch
    import torch.distributed as dist

    from hetc.plandir import read_eval_rank, read_plan, read_program
    from hetc.runtime.checkpoint import latest_checkpoint
    from hetc.runtime.comm import make_groups
    from hetc.runtime.data import make_data_source
    from hetc.runtime.evaluate import make_evaluator
    from hetc.runtime.setup import build_rank

    _, checked = read_plan(job.plan_dir)
    program = read_program(job.plan_dir)
    if rank >= program.world_size:
        return None
    if job.hang_on == rank:
        threading.Event().wait()
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=program.world_size, timeout=timeout)
    try:
        groups = make_groups(program.groups, timeout)
        spec = checked.spec
        data = make_data_source(spec.model, spec.train, job.plan_dir)
        resumes = job.resume_from is not None and latest_checkpoint(job.resume_from) is not None
        rt = build_rank(program, checked, rank, groups, data, torch.device("cpu"), resumes=resumes,
                        emulation=job.emulation)
        evaluation = read_eval_rank(job.plan_dir, rank)
        return _train(rt, job, rank, make_evaluator(program, checked, rank, job.plan_dir, evaluation))
    finally:
        dist.destroy_process_group()   # the default group and every group made from it


def _train(rt, job: PlanJob, rank: int, evaluator) -> RankReport:
    from hetc.runtime.checkpoint import load_checkpoint, save_checkpoint

    start = load_checkpoint(rt, job.resume_from) if job.resume_from is not None else 0
    losses, val_losses, aux = [], [], []
    for step in range(start, job.steps):
        result = rt.interpreter.run_step(step)
        losses.append(result.loss)
        aux.append(result.aux_losses)
        if evaluator is not None and evaluator.due(step + 1):
            val_losses.append(evaluator.run(rt.interpreter))
    if job.save_to is not None:
        with _failing_writer(job.fail_save_on == rank):
            save_checkpoint(rt, job.save_to, job.steps)
    return RankReport(rank, start, tuple(losses), val_losses=tuple(val_losses), aux_losses=tuple(aux))


@contextmanager
def _failing_writer(active: bool):
    """Make this rank's DCP writes fail once its data is on disk (an interrupted save), when `active`."""
    if not active:
        yield
        return
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(writer, plan, planner):
        original(writer, plan, planner).wait()
        raise OSError("simulated failure in the middle of a save")
    FileSystemWriter.write_data = write_data
    try:
        yield
    finally:
        FileSystemWriter.write_data = original
