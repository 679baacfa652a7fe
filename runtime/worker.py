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

import dataclasses
import datetime
import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hetc.hf.weights import wants_pretrained
from hetc.passes.validate_runtime import require_trainable_dtype
from hetc.ir.plan import Plan
from hetc.ir.program import Program, RankProgram
from hetc.runtime.comm import make_groups
from hetc.runtime.data import make_data_source
from hetc.runtime.evaluate import make_evaluator
from hetc.runtime.gpu_failures import (CommTimeout, DeviceOutOfMemory, creation_timeout, estimate_line,
                                       nccl_environment, out_of_memory_in, out_of_memory_message, timeout_message,
                                       use_step_timeout, waited_for)
from hetc.runtime.inject import LinkSlowdown
from hetc.runtime.links import MessageLog
from hetc.runtime.local import LAUNCHER_ENV, NODE_ENV
from hetc.runtime.nn import collectives
from hetc.runtime.nn.collectives import is_comm_failure
from hetc.runtime.placement import ClusterMismatch, local_gpu, local_process
from hetc.runtime.preempt import PREEMPTED_STATUS, Preemption, StopReason
from hetc.runtime.options import DIVERGED_STATUS, NonFinite, RunOptions
from hetc.runtime.rebalance import Rebalancer, Switch
from hetc.runtime.report import Reporter, StartupProgress
from hetc.runtime.setup import build_rank
from hetc.runtime.watchdog import Watchdog, attempt_prefix, store_client
from hetc.ir.spec import DeviceSpec

__all__ = ["DIVERGED_STATUS", "CommTimeout", "DeviceOutOfMemory", "EnvError", "Launch", "NonFinite", "PeerFailure",
           "RunOptions", "describe_latest", "launch_env", "rendezvous_store", "run_placed"]

log = logging.getLogger("hetc.runtime")


class EnvError(RuntimeError):
    """The launch environment is wrong (missing torchrun variables, wrong world size)."""


class PeerFailure(RuntimeError):
    """Another rank died or stopped answering; the message names it."""


# Note [non-finite steps]
# A step whose loss or global gradient norm is not finite (a diverged run: lr too high, an overflow) has
# already poisoned the weights it updated. By default (`stop`) every rank sees the same all-reduced loss and
# norm, so all stop together after that step, before it is saved, and the run exits DIVERGED_STATUS naming
# the step: every checkpoint it left has the finite weights of an earlier step, and `latest` names one of
# them (a save also refuses non-finite weights: Note [finite saves] in runtime/checkpoint.py). `skip` does
# what Megatron's and DeepSpeed's loss scalers do on an overflow: the optimizer update of that step is not
# applied, and the learning-rate schedule and Adam's step count hold (Note [skipped updates] in
# runtime/optim.py); the skipped step is counted and reported. Deciding before the update needs the global
# gradient norm before any ministage steps, which hetc computes only under clipping (passes/lower/zero.py:
# grad_clip turns off Zorse's interleaved update), so `skip` needs train.grad_clip.


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
    rank, world, local = (_env_int(key, least) for key, least in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if rank >= world:
        raise EnvError(f"RANK={rank} is not below WORLD_SIZE={world}")
    return Launch(rank, world, local, agent, label)


def _env_int(key: str, least: int) -> int:
    """An integer torchrun sets (LOCAL_RANK 0 where unset), or an EnvError naming it."""
    text = os.environ.get(key, "0")
    if not text.strip().isdigit() or int(text) < least:
        raise EnvError(f"{key}={text!r} is not a {'positive' if least else 'non-negative'} integer, as torchrun "
                       "sets it")
    return int(text)


def rendezvous_store(launch: Launch, timeout_s: float):
    """The store the processes meet in: the agent's (torchrun's default, `--local`), or one that launch
    rank 0 hosts (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), as torch's env:// would."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 1)
    try:
        store = dist.TCPStore(host, port, world_size=launch.world, is_master=not agent_store and launch.rank == 0,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistError as err:     # DistNetworkError: nothing answered there in time
        raise EnvError(f"launch rank {launch.rank} could not reach the rendezvous store at {host}:{port} within "
                       f"{timeout_s:g} s (--init-timeout): is every node started, with the same --rdzv? "
                       f"({type(err).__name__})") from None
    return dist.PrefixStore(attempt_prefix(), store)


def discovery_device() -> torch.device:
    """The device a process reports before it knows its plan GPU: its local CUDA device, if any."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_gpu(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()))


def run_placed(plan_dir: Path, plan: Plan, program: Program, rank: int, launch: Launch, store, opts: RunOptions,
               evaluation: RankProgram | None = None, on_resumed: Callable[[int, float], None] | None = None,
               on_first_step: Callable[[], None] | None = None, progress: StartupProgress | None = None) -> int:
    """Train as plan rank `rank` (placed by discovery): the process group, the watchdog, the steps.
    `evaluation`: the rank's evaluation program as compile wrote it (None: none written).

    `on_resumed(step, seconds)` hears where the run resumed and how long the load took,
    `on_first_step()` when the first step is done (elastic reports); `progress` tells the start-up
    phases on rank 0 (its clock running since placement)."""
    require_trainable_dtype(plan.spec)   # fp16's loss scale needs clipping (torchrun and elastic ranks get here)
    world = program.world_size
    device = _device(plan.pipeline.world[rank].device, launch.local_rank)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        nccl_environment()
    init_timeout = creation_timeout(backend, datetime.timedelta(seconds=opts.init_timeout_s),
                                    datetime.timedelta(seconds=opts.timeout_s))    # Note [Init and step timeouts]
    dist.init_process_group(backend, store=dist.PrefixStore("hetc/pg", store), rank=rank, world_size=world,
                            timeout=init_timeout, device_id=device if backend == "nccl" else None)
    watchdog = Watchdog(store_client(), rank, world,
                        timeout=opts.heartbeat_timeout_s)
    watchdog.start()
    completed = False
    preemption = Preemption(store, rank, opts.grace_s, opts.exit_after_s)
    try:
        hooks = _Hooks(progress or StartupProgress(rank == 0 and not opts.quiet), on_resumed, on_first_step)
        status = _train(plan_dir, opts, rank, plan, program, evaluation, device, init_timeout, preemption, hooks)
        completed = True
    except (RuntimeError, dist.DistError) as err:
        if (oom := out_of_memory_in(err)) is not None:
            raise _out_of_memory(plan, program, rank, device, err, oom) from None
        if isinstance(err, ClusterMismatch) or not is_comm_failure(err):
            raise
        raise _communication_failure(err, watchdog, rank, program, opts, backend) from None
    finally:
        watchdog.finish(completed)
        preemption.close()
    if status == 0:
        dist.barrier()
    dist.destroy_process_group()
    return status


def _communication_failure(err: BaseException, watchdog: Watchdog, rank: int, program, opts: RunOptions,
                           backend: str) -> PeerFailure | CommTimeout:
    """A dead peer, named, or a timeout while every peer lives: Note [A timeout or a dead peer]."""
    dead = watchdog.silent_ranks()
    notes = getattr(err, "__notes__", ())       # the interpreter's instruction
    if not dead:
        waited = waited_for(notes, rank, program.ranks[rank].instrs, program.groups)
        return CommTimeout(timeout_message(rank, waited, opts.timeout_s, opts.init_timeout_s, backend,
                                           _first_line(err)))
    if len(dead) == 1:
        watchdog.declare_dead(dead[0])
    who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}"
    where = "".join(f"{note}: " for note in notes)
    return PeerFailure(f"{who} stopped responding (noticed by rank {rank}: {where}{_first_line(err)[:300]})")


def _first_line(err: BaseException) -> str:
    """A backend's message without its advice and the C++ source it was raised at (`[.../pair.cc:589] `)."""
    line = (str(err).splitlines() or [type(err).__name__])[0].split(" This is typically")[0]
    return re.sub(r"^\[[^\]\s]+:\d+\] ", "", line)


def _out_of_memory(plan, program, rank: int, device: torch.device, err: BaseException,
                   oom: BaseException) -> DeviceOutOfMemory:
    """The paragraph for a CUDA out-of-memory anywhere in the run (`err` holds it, maybe as a cause)."""
    notes = [*getattr(err, "__notes__", ()), *(getattr(oom, "__notes__", ()) if oom is not err else ())]
    where = next((note for note in notes if note.startswith(f"[rank {rank}]")), "")
    # torch's first line: what was asked, what was free, what this process held; not the link to its docs
    detail = (str(oom).splitlines() or ["CUDA out of memory"])[0].split("  See documentation")[0]
    rp = program.ranks[rank]
    kind = plan.pipeline.world[rank].device.name
    return DeviceOutOfMemory(out_of_memory_message(rank, rp.stage, rp.lane, f"on {device}, planned as a {kind}",
                                                   where, detail, estimate_line(plan, program, rank)))


def _train(plan_dir: Path, opts: RunOptions, rank: int, plan: Plan, program: Program, evaluation: RankProgram | None,
           device: torch.device, timeout: datetime.timedelta, preemption: Preemption, hooks: _Hooks) -> int:
    """`timeout` is what the groups are created with (`creation_timeout`); then the step timeout holds."""
    groups = make_groups(program.groups, timeout)
    hooks.progress.done("process groups up")
    data = make_data_source(plan.model, plan.train, plan_dir)
    start_from = _start_point(opts, plan, rank)
    from hetc.runtime.nccl_order import emulation_from_env    # HETC_EMULATE_NCCL, read once as the rank starts

    rt = build_rank(program, plan, rank, groups, data, device, resumes=start_from is not None,
                    emulation=emulation_from_env())
    hooks.progress.done(_built(plan, resumes=start_from is not None))
    evaluator = make_evaluator(program, plan, rank, plan_dir, evaluation)
    if problem := opts.plan_problem(plan.train):
        raise EnvError(problem)
    rt.interpreter.skip_nonfinite = opts.on_nonfinite is NonFinite.SKIP
    rt.interpreter.injected = opts.inject
    if any(isinstance(inj, LinkSlowdown) for inj in opts.inject):     # Note [a slowed link]
        rt.interpreter.message_time = _message_time(plan)
    if opts.rebalance is not None:
        rt.interpreter.messages = MessageLog()      # Note [link transit]
    saver, lock = _checkpointer(rt, opts, timeout, rank)
    use_step_timeout(datetime.timedelta(seconds=opts.timeout_s))    # every group exists now
    try:
        return _steps(rt, opts, rank, plan, program, device, saver, evaluator, preemption, hooks, start_from,
                      plan_dir)
    finally:
        if lock is not None:
            lock.release()


def _steps(rt, opts: RunOptions, rank: int, plan: Plan, program: Program, device: torch.device, saver, evaluator,
           preemption: Preemption, hooks: _Hooks, start_from: _Start | None, plan_dir: Path) -> int:
    if opts.elastic:        # every rank: the load time below is the load's, not the wait for the last rank to start
        collectives.barrier()
    loading = time.perf_counter()
    start = _load(rt, start_from) if start_from is not None else 0
    if hooks.on_resumed is not None:
        hooks.on_resumed(start, time.perf_counter() - loading)
    reporter = Reporter(rank, plan, program, opts, device, append=start > 0)
    rebalancer = None if opts.rebalance is None else \
        Rebalancer(plan_dir, plan, rank, opts.rebalance, reporter.store, reporter.event,
                   can_reshard=saver is not None)
    steps = plan.train.steps if opts.steps is None else opts.steps
    if start >= steps and rank == 0:   # a resume past the end: say so, or the run looks as if it trained
        print(f"hetc run: no step to run: resumed at step {start}, and the run ends at step {steps} "
              f"({'--steps' if opts.steps is not None else 'train.steps'})", file=sys.stderr, flush=True)
    skipped = 0
    for step in range(start, steps):
        traced = opts.trace is not None and step == steps - 1
        result = rt.interpreter.run_step(step, trace=traced, classes=opts.metrics is not None or rebalancer is not None)
        val_loss = evaluator.run(rt.interpreter) if evaluator is not None and evaluator.due(step + 1) else None
        reporter.step(step, steps, result, val_loss)
        if step == start and hooks.on_first_step is not None:
            hooks.on_first_step()
        what = _nonfinite(result)
        if what and not result.skipped:
            reporter.flush_line()
            return _diverged(saver, rank, step + 1, what, opts)
        skipped += result.skipped
        if preemption.should_stop(step + 1) and step + 1 < steps:
            reporter.flush_line()       # the steps since the last line, before the stop's message
            if preemption.reason is StopReason.TIME_LIMIT:
                return _time_limit(saver, rank, step + 1, opts)
            return _preempted(saver, rank, step + 1)
        saving = saver is not None and _saves_after(opts, step + 1, steps)
        if saving and not _saved(saver, step + 1):
            reporter.flush_line()
            return _diverged(saver, rank, step + 1, "its weights or optimizer state are not finite", opts)
        if saver is not None and not saving:
            saver.poll()
        if rebalancer is not None and step + 1 < steps:
            assert rt.interpreter.messages is not None   # set with --rebalance
            switch = rebalancer.after_step(step, result.classes.get("compute", 0.0), result.seconds,
                                           rt.interpreter.messages)
            if switch is not None:
                rt, rebalancer = _switched(switch, step, rt, rebalancer, saver, saving, reporter, opts, plan_dir)
                evaluator = evaluator if evaluator is None or switch.evaluation is None else \
                    dataclasses.replace(evaluator, program=switch.evaluation)
    if saver is not None:
        saver.wait()
    reporter.finish()
    if skipped and rank == 0:
        scaler = rt.interpreter.scaler
        why = "(--on-nonfinite skip)" if scaler is None else \
            f"(fp16 overflows; the loss scale is now {scaler.scale:g})"
        print(f"hetc run: {skipped} of {steps - start} steps skipped their update: a non-finite gradient norm "
              f"{why}", file=sys.stderr, flush=True)
    return 0


def _switched(switch: Switch, step: int, rt, rebalancer: Rebalancer, saver, saved: bool, reporter: Reporter,
              opts: RunOptions, plan_dir: Path):
    """After `step`: the runtime (and rebalancer) that run the programs live rebalancing switched to
    (Note [live rebalancing]): the same with new programs after a new routing, a new one resharded from a
    checkpoint of this step after a new layer split (Note [a new layer split])."""
    if switch.full is not None and switch.plan is not None:     # rank 0: a trace reads every rank's
        reporter.program, reporter.plan = switch.full, switch.plan
    if switch.resplit is None or switch.whole is None:
        rt.interpreter.program = switch.program
        return rt, rebalancer
    from hetc.runtime.nccl_order import emulation_from_env

    done, plan = step + 1, switch.resplit
    if not saved:
        saver.save(done)
    saver.wait()
    collectives.barrier(group=saver.group)     # the leader has published step-N when every rank goes on
    old = rt.interpreter
    rt.buffers.clear()      # the checkpoint holds this state now; free it before the new split's is built
    groups = make_groups(switch.whole.groups, datetime.timedelta(seconds=opts.timeout_s))
    rt = build_rank(switch.whole, plan, old.program.rank, groups, old.data, old.device, resumes=True,
                    emulation=emulation_from_env())
    rt.interpreter.skip_nonfinite, rt.interpreter.injected = old.skip_nonfinite, old.injected
    rt.interpreter.message_time, rt.interpreter.messages = old.message_time, old.messages
    _load(rt, _Start(saver.directory / f"step-{done}", False))
    saver.rt = rt
    assert opts.rebalance is not None   # it switched
    return rt, Rebalancer(plan_dir, plan, rt.rank, opts.rebalance, reporter.store, reporter.event,
                          can_reshard=True, version=rebalancer.version)


def _message_time(plan: Plan) -> Callable[[int, int, float], float]:
    """The plan's time of a message (src, dst, bytes) on its link: what a slowed link stretches."""
    from hetc.passes.cost import CostModel

    return CostModel(plan).p2p_transfer_time


def _saved(saver, done: int) -> bool:
    """Start saving step `done`; False when the state is not finite (the loss can still be, when an
    optimizer state overflowed first), which is a diverged step too."""
    from hetc.runtime.checkpoint import NonFiniteState

    try:
        saver.save(done)
    except NonFiniteState:
        return False
    return True


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _nonfinite(result) -> str:
    """What was not finite in a step (the same on every rank: both values are all-reduced), or ''."""
    parts = [f"the loss is {result.loss}" if not math.isfinite(result.loss) else "",
             f"the gradient norm is {result.grad_norm}"
             if result.grad_norm is not None and not math.isfinite(result.grad_norm) else ""]
    return " and ".join(p for p in parts if p)


def _diverged(saver, rank: int, done: int, what: str, opts: RunOptions) -> int:
    """Every rank stops after step `done`, unsaved: Note [non-finite steps]."""
    if saver is not None:
        saver.wait()        # a save of an earlier, finite step still in flight completes
    if rank == 0:
        hint = "lower the learning rate, set train.grad_clip" + (
            "" if opts.on_nonfinite is NonFinite.SKIP else ", or skip such steps with --on-nonfinite skip")
        print(f"hetc run: error: step {done}: {what}; stopped without saving it. "
              f"{_sentence(describe_latest(opts.checkpoint))}. To go on: {hint}", file=sys.stderr, flush=True)
    return DIVERGED_STATUS


def _built(plan: Plan, resumes: bool) -> str:
    """The start-up line once the model is built; a checkpoint's load says `resumed from` itself."""
    if resumes:
        return "model built"
    if wants_pretrained(plan.model):
        return "model built with its pretrained weights"
    return f"model built; weights initialised from seed {plan.train.seed}"


@dataclass(frozen=True)
class _Hooks:
    progress: StartupProgress       # rank 0's start-up lines
    on_resumed: Callable[[int, float], None] | None = None
    on_first_step: Callable[[], None] | None = None


def _checkpointer(rt, opts: RunOptions, timeout: datetime.timedelta, rank: int):
    """The run's saver and, on plan rank 0, the directory's lock (Note [Checkpoint directory lock]);
    every rank raises CheckpointBusy when another run holds it."""
    if opts.checkpoint is None:
        return None, None
    from hetc.runtime.checkpoint import Checkpointer
    from hetc.runtime.checkpoint_lock import CheckpointBusy, lock_checkpoint_dir

    # a gloo group of its own for the background writer: see Note [Async saves]
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timeout, backend="gloo")
    lock, refusal = None, [""]
    if rank == 0:
        try:
            lock = lock_checkpoint_dir(opts.checkpoint)
        except CheckpointBusy as err:
            refusal = [str(err)]
    dist.broadcast_object_list(refusal, src=0, group=group)
    if refusal[0]:
        raise CheckpointBusy(refusal[0])
    return Checkpointer(rt, opts.checkpoint, opts.keep, group, asynchronous=True), lock


def _preempted(saver, rank: int, done: int) -> int:
    """Every rank stops after `done` steps: save them (completely) and exit; see Note [Preemption]."""
    if saver is not None:
        saver.save(done)
        saver.wait()
    if rank == 0:
        where = f"checkpoint {saver.directory / f'step-{done}'} is complete" if saver else "no --checkpoint"
        why = "" if LAUNCHER_ENV in os.environ else " so that torchrun restarts"    # --local restarts nothing
        print(f"hetc run: SIGTERM: stopped after step {done}; {where}; exiting with status {PREEMPTED_STATUS}{why}",
              file=sys.stderr, flush=True)
    return PREEMPTED_STATUS


def _time_limit(saver, rank: int, done: int, opts: RunOptions) -> int:
    """--exit-after: every rank stops after `done` steps, saves them and exits 0 (Note [Preemption])."""
    assert saver is not None and opts.exit_after_s is not None     # the flag needs --checkpoint
    saver.save(done)
    saver.wait()
    if rank == 0:
        print(f"hetc run: --exit-after {opts.exit_after_s / 60:g} min: stopped after step {done}; checkpoint "
              f"{saver.directory / f'step-{done}'} is complete; rerun with --resume-if-present to go on",
              file=sys.stderr, flush=True)
    return 0


def describe_latest(directory: Path | None) -> str:
    """Which checkpoint a rerun with --resume would start from (for messages after an interruption)."""
    if directory is None:
        return "no checkpoint was being saved (no --checkpoint)"
    from hetc.runtime.checkpoint import CheckpointError, complete_steps, latest_checkpoint

    try:
        path = latest_checkpoint(directory)
    except CheckpointError:
        path = None     # --resume passes over it: Note [Which checkpoint --resume loads]
    steps = complete_steps(directory)
    if path is None and steps:
        path = Path(directory) / f"step-{steps[-1]}"
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
    device = torch.device("cuda", local_gpu(local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class _Start:
    """The checkpoint a run starts from, and whether it takes only its weights (--load-weights-only)."""

    path: Path
    weights_only: bool


def _start_point(opts: RunOptions, plan: Plan, rank: int) -> _Start | None:
    """The checkpoint this run loads, if any. Plan rank 0 chooses it (it alone reads the checksums and
    compares the checkpoint with the spec) and broadcasts the choice or the error, so that every rank loads
    the same one or raises the same error: Notes [Which checkpoint --resume loads], [What a checkpoint is of]."""
    if not (opts.resume or opts.resume_if_present or opts.weights_from is not None):
        return None     # no import of the checkpoint module (torch.distributed.checkpoint takes a second)
    if (opts.resume or opts.resume_if_present) and opts.checkpoint is None:
        raise EnvError("--resume needs --checkpoint DIR")
    from hetc.runtime.checkpoint import CheckpointError

    answer: list[object] = [None, False, "", None]     # path, weights only, error, the error's file
    if rank == 0:
        try:
            start = _choose_start(opts, plan)
            answer = [str(start.path) if start else None, start.weights_only if start else False, "", None]
        except CheckpointError as err:
            answer = [None, False, str(err), str(err.path) if err.path is not None else None]
    dist.broadcast_object_list(answer, src=0)
    path, weights_only, error, where = answer
    if error:
        raise CheckpointError(str(error), Path(str(where)) if where else None)
    return _Start(Path(str(path)), bool(weights_only)) if path else None


def _choose_start(opts: RunOptions, plan: Plan) -> _Start | None:
    from hetc.runtime.checkpoint import CheckpointError, find_resumable
    from hetc.runtime.checkpoint_files import nothing_to_resume
    from hetc.runtime.checkpoint_identity import check_resumable

    start = None
    if (opts.resume or opts.resume_if_present) and opts.checkpoint is not None:
        point = find_resumable(opts.checkpoint)
        if point.path is not None and point.passed_over:
            log.warning("--resume: %s; resuming from %s", "; ".join(point.passed_over), point.path)
        if point.path is None and opts.resume:
            raise CheckpointError(nothing_to_resume(opts.checkpoint))
        start = _Start(point.path, weights_only=False) if point.path is not None else None
    if start is None and opts.weights_from is not None:
        start = _Start(_weights_checkpoint(opts.weights_from), weights_only=True)
    if start is not None:
        check_resumable(start.path, plan.model, plan.train, start.weights_only)
    return start


def _weights_checkpoint(path: Path) -> Path:
    """--load-weights-only's checkpoint: a step-N folder, or the one --resume would pick in a directory."""
    from hetc.runtime.checkpoint import CheckpointError, find_resumable
    from hetc.runtime.checkpoint_files import verify_manifest

    if (path / ".metadata").is_file():
        verify_manifest(path)
        return path
    found = find_resumable(path).path if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"--load-weights-only: {path} is neither a checkpoint (a step-N folder) nor a "
                              "directory holding one")
    return found


def _load(rt, start: _Start) -> int:
    """Load `start` into `rt`; the next step (0 after --load-weights-only)."""
    from hetc.runtime.checkpoint import restore

    step = restore(rt, start.path, start.weights_only)
    updates = rt.interpreter.updates
    if rt.interpreter.program.rank == 0:   # once, as a save says `saved step N to DIR`
        skipped = f" (updates applied: {updates}, skipped: {step - updates})" if updates != step else ""
        print(f"loaded the weights of {start.path}; starting at step 0" if start.weights_only
              else f"resumed from {start.path} at step {step}{skipped}", flush=True)
    return step
