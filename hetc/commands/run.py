"""`hetc run DIR`: execute a compiled plan on torch.distributed.

Under torchrun every rank runs `hetc run DIR`; with `--local [N]` this
command starts the plan's N ranks itself on this machine (gloo on CPU,
NCCL on GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.commands.argtypes import finite_number
from hetc.ir.errors import UsageError
from hetc.ir.outdir import PLAN_FILE
from hetc.passes.validate_runtime import require_trainable_dtype
from hetc.passes.verify import VerifyError
from hetc.ir.program import ProgramFormatError
from hetc.runtime.inject import check_ranks, parse_injection
from hetc.runtime.local import LAUNCHER_ENV
from hetc.runtime.options import RUN_OPTIONS_ENV, NonFinite, RunOptions
from hetc.runtime.rebalance import RebalanceOptions

__all__ = ["register", "run_options"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "run", help="train a compiled plan (under torchrun, or --local)",
        description="Execute DIR's per-rank programs. Under torchrun (which sets RANK, WORLD_SIZE, "
                    "MASTER_ADDR, ...) each process runs its rank; with --local the plan's ranks are started "
                    "here. Rank 0 prints a line per step.",
        epilog="examples:\n  hetc run out/demo --local --steps 20 --metrics m.jsonl\n"
               "  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m hetc run out/plan\n"
               "  hetc launch out/plan --node big[0]     # torchrun for one node of a mixed cluster\n"
               "  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --max-restarts 3 ... \\\n"
               "      -m hetc run job.het --elastic --checkpoint ckpt --every 10",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, metavar="DIR",
                   help="a plan directory from `hetc compile` (with --elastic: a spec, planned on the nodes present)")
    p.add_argument("--local", nargs="?", const=-1, type=int, metavar="N",
                   help="start the plan's ranks on this machine (N must equal the plan's world size)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the spec's train.steps)")
    p.add_argument("--metrics", type=Path, metavar="FILE",
                   help="one JSON line per step (rank 0); its fields: docs/metrics.md")
    p.add_argument("--tensorboard", type=Path, metavar="DIR",
                   help="rank 0 writes TensorBoard event files of each step's numbers here (loss, lr, grad_norm, "
                        "tokens_per_s, mfu, step_time_s, peak memory over ranks); view with `tensorboard "
                        "--logdir DIR`; needs the tensorboard package")
    p.add_argument("--wandb", metavar="PROJECT",
                   help="rank 0 logs the same numbers to this Weights & Biases project (needs `pip install wandb` "
                        "and a login; WANDB_MODE=offline keeps the run on disk)")
    p.add_argument("--trace", type=Path, metavar="FILE", help="measured timeline of the last step")
    p.add_argument("--checkpoint", type=Path, metavar="DIR",
                   help="save DCP checkpoints here (DIR/step-N, DIR/latest); any plan of the model can resume")
    p.add_argument("--every", type=int, default=0, metavar="K",
                   help="save every K steps (and always after the last step)")
    p.add_argument("--keep", type=int, metavar="N",
                   help="keep only the newest N complete checkpoints (older ones go once a newer one is complete)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint DIR/latest names in --checkpoint DIR (if it is missing or "
                        "corrupt, from the newest intact step-N, saying which it passed over); the model, "
                        "optimizer and data must be the checkpoint's; a DIR holding no checkpoint is an error")
    p.add_argument("--resume-if-present", action="store_true",
                   help="like --resume, but start at step 0 when --checkpoint DIR holds no checkpoint yet "
                        "(for a job script that is rerun after every interruption)")
    p.add_argument("--load-weights-only", type=Path, metavar="CHECKPOINT",
                   help="fine-tuning: start at step 0 from the weights of CHECKPOINT (a step-N folder, or the "
                        "checkpoint --resume would pick in a directory) with fresh optimizer state; the model "
                        "must match it, the optimizer and data may differ; with --resume-if-present, a "
                        "checkpoint in --checkpoint DIR wins")
    p.add_argument("--elastic", action="store_true",
                   help="under torchrun --nnodes MIN:MAX: on every (re)start re-plan SPEC on the nodes present, "
                        "compile, verify and resume from the latest complete checkpoint")
    p.add_argument("--exit-after", "--exit-duration-in-mins", type=finite_number, metavar="MIN",
                   help="a time limit (a scheduler's, less a step and a save): once MIN minutes have passed since "
                        "a rank started, every rank stops after the same step, saves it and exits 0; rerun with "
                        "--resume-if-present to go on (Megatron-LM's --exit-duration-in-mins); needs --checkpoint")
    p.add_argument("--stop-timeout", type=finite_number, default=30.0, metavar="S",
                   help="on SIGTERM, finish the step in flight and save within S seconds, then exit with "
                        "status 143 (torchrun restarts)")
    p.add_argument("--heartbeat-timeout", type=finite_number, default=10.0, metavar="S",
                   help="a rank whose heartbeat stops for S seconds is taken for dead and every rank exits "
                        "(raise it where ranks share starved CPUs)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="after a step whose loss or gradient norm is NaN or infinite: stop before saving it "
                        "(exit 3; every checkpoint keeps finite weights), or skip its update and go on, "
                        "counted and reported, as Megatron's and DeepSpeed's loss scalers do (needs "
                        "train.grad_clip)")
    p.add_argument("--rebalance", action="store_true",
                   help="live rebalancing: measure every lane's compute rate each step and, when a lane becomes "
                        "slower than it was (a throttled GPU, a noisy neighbour), re-route its stage's microbatches "
                        "around it from the next step, without a restart, and give them back when it recovers; a "
                        "line and a --metrics record (\"event\": \"rebalance\") for each detection and change")
    p.add_argument("--rebalance-window", type=int, default=RebalanceOptions.window, metavar="N",
                   help="steps whose median is a lane's rate; the N steps after the first are its reference "
                        f"(default {RebalanceOptions.window})")
    p.add_argument("--rebalance-threshold", type=finite_number, default=RebalanceOptions.threshold, metavar="X",
                   help="a lane X times slower than its reference is slow; it recovers below halfway back "
                        f"(default {RebalanceOptions.threshold}: above the step-to-step noise, docs/benchmarks.md)")
    p.add_argument("--rebalance-link-threshold", type=finite_number, default=RebalanceOptions.link_threshold, metavar="X",
                   help="a link whose messages take X times as long as at its reference is slow (default "
                        f"{RebalanceOptions.link_threshold}: a starved host reads as slow links, docs/metrics.md)")
    p.add_argument("--rebalance-cooldown", type=int, default=RebalanceOptions.cooldown, metavar="N",
                   help=f"steps between two changes of routing (default {RebalanceOptions.cooldown})")
    p.add_argument("--rebalance-min-gain", type=finite_number, default=RebalanceOptions.min_gain, metavar="F",
                   help="take a new routing only where the simulation predicts F more throughput "
                        f"(default {RebalanceOptions.min_gain}: 5 %%)")
    p.add_argument("--rebalance-split-gain", type=finite_number, default=RebalanceOptions.split_gain, metavar="F",
                   help="where no routing helps (a slow lane alone in its stage), move layers off it when the "
                        f"simulation predicts F more throughput (default {RebalanceOptions.split_gain}); goes "
                        "through a checkpoint of the step, in the same processes: needs --checkpoint")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="fault injection for tests and demos: 'slow rank=R factor=F from=S [until=U]' makes plan "
                        "rank R compute F times slower over steps S..U-1 (0-based; repeatable); 'slow link=A-B "
                        "factor=F from=S [until=U]' makes every message between plan ranks A and B arrive F times "
                        "as late (the plan's time of the message, stretched on the receiving rank); either with world=N "
                        "holds only while the run has N ranks (an --elastic run re-plans and renumbers its ranks)")
    p.add_argument("-q", "--quiet", action="store_true", help="print no line per step")
    p.add_argument("--log-every", "--log-interval", type=int, default=1, metavar="N",
                   help="print a step line every N steps (and the last): their mean loss, tokens/s and step "
                        "time, the last one's learning rate, and how many skipped their update (Megatron-LM's "
                        "--log-interval); --metrics keeps every step")
    p.add_argument("--timeout", type=finite_number, default=120.0, metavar="S",
                   help="a step's collective or message that waits S seconds fails the run (raise it for steps "
                        "that take minutes)")
    p.add_argument("--init-timeout", type=finite_number, default=300.0, metavar="S",
                   help="how long the ranks wait for each other to start and form their process groups "
                        "(raise it for a large or slowly starting cluster); --timeout holds from the first step")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.elastic:
        _check_elastic(args)
    elif not (args.dir / PLAN_FILE).is_file():
        spec = "; or run the spec itself with --elastic, planned on the nodes present" if args.dir.is_file() else ""
        raise UsageError(f"{args.dir} is not a plan directory (write one with `hetc compile SPEC -o DIR`){spec}")
    if args.steps is not None and args.steps < 1:
        raise UsageError("--steps must be positive")
    if args.every < 0:
        raise UsageError("--every must not be negative")
    if args.keep is not None and args.keep < 1:
        raise UsageError("--keep must be at least 1")
    if args.stop_timeout <= 0:
        raise UsageError("--stop-timeout must be positive")
    if args.log_every < 1:
        raise UsageError("--log-every must be at least 1")
    if args.exit_after is not None and args.exit_after <= 0:
        raise UsageError("--exit-after must be a positive number of minutes")
    if args.heartbeat_timeout <= 0:
        raise UsageError("--heartbeat-timeout must be positive")
    if args.rebalance_window < 1 or min(args.rebalance_threshold, args.rebalance_link_threshold) <= 1 \
            or args.rebalance_cooldown < 0 \
            or args.rebalance_min_gain < 0 or args.rebalance_split_gain < 0:
        raise UsageError("--rebalance-window must be at least 1, both thresholds above 1, "
                         "--rebalance-cooldown and the gains not negative")
    for text in args.inject:
        parse_injection(text)       # a UsageError quoting it, before any rank starts
    if args.timeout <= 0 or args.init_timeout <= 0:
        raise UsageError("--timeout and --init-timeout must be positive")
    for flag in ("resume", "resume_if_present", "every", "keep", "exit_after"):
        if getattr(args, flag) and args.checkpoint is None:
            raise UsageError(f"--{flag.replace('_', '-')} needs --checkpoint DIR")
    _check_checkpoint_flags(args)
    _check_telemetry_flags(args)
    _check_outputs(args)
    try:
        if args.local is not None:
            return _local(args)
        return _rank(args)
    except VerifyError as err:
        print(f"hetc run: error: {args.dir}'s programs are unsafe:\n{err.render()}", file=sys.stderr, flush=True)
        return 2
    except ProgramFormatError as err:
        print(f"{err.source or args.dir}:{err.line}: error: {str(err).split(': ', 1)[-1]}", file=sys.stderr)
        return 2


def _check_checkpoint_flags(args: argparse.Namespace) -> None:
    """What the checkpoint flags need, checked before any rank starts: Note [Which checkpoint --resume loads]
    in runtime/checkpoint.py."""
    from hetc.runtime.checkpoint_files import CheckpointError, check_writable, has_checkpoint, nothing_to_resume

    if args.resume and args.resume_if_present:
        raise UsageError("--resume and --resume-if-present exclude each other: pick one")
    if args.resume and args.load_weights_only is not None:
        raise UsageError("--load-weights-only starts from its CHECKPOINT only when there is nothing to resume: "
                         "use it with --resume-if-present, not --resume")
    if args.load_weights_only is not None and not args.load_weights_only.exists():
        raise UsageError(f"--load-weights-only: {args.load_weights_only} does not exist")
    if args.resume and not args.elastic and not has_checkpoint(args.checkpoint):
        raise UsageError(nothing_to_resume(args.checkpoint))
    if args.local is not None and args.checkpoint is not None and args.checkpoint.is_dir():
        _refuse_busy_checkpoint(args.checkpoint)     # first: a run in progress is the likelier story
    continues = args.resume or args.resume_if_present or args.elastic
    if args.checkpoint is not None and not continues and has_checkpoint(args.checkpoint):
        raise UsageError(f"{args.checkpoint} holds the checkpoints of an earlier run; starting at step 0 would "
                         "overwrite them: add --resume to continue that run, or give this one another "
                         "--checkpoint DIR")
    if args.checkpoint is not None:
        try:
            check_writable(args.checkpoint)
        except CheckpointError as err:
            raise UsageError(str(err)) from None


def _check_outputs(args: argparse.Namespace) -> None:
    """--metrics and --trace replace no file the run reads, no plan directory file and not each other (Note
    [output files])."""
    from hetc.compiler import spec_inputs
    from hetc.ir.outdir import check_output_file

    if args.metrics is None and args.trace is None:
        return
    reads = spec_inputs(args.dir)
    if args.metrics is not None:
        check_output_file(Path(args.metrics), "--metrics", reads)
    if args.trace is not None:
        check_output_file(Path(args.trace), "--trace", reads + [(Path(p), "the --metrics file")
                                                               for p in [args.metrics] if p])


def _check_telemetry_flags(args: argparse.Namespace) -> None:
    """--tensorboard and --wandb write through packages hetc does not need otherwise: refuse a flag whose
    package is missing before any rank starts."""
    from hetc.runtime.scalars import missing_package

    for flag, value in (("--tensorboard", args.tensorboard), ("--wandb", args.wandb)):
        if value is not None and (error := missing_package(flag)) is not None:
            raise UsageError(error)
    if args.tensorboard is not None:
        from hetc.ir.outdir import make_directory

        make_directory(args.tensorboard, "--tensorboard")


def _check_elastic(args: argparse.Namespace) -> None:
    if args.local is not None:
        raise UsageError("--elastic runs under torchrun --nnodes MIN:MAX, not --local")
    if args.checkpoint is None or not args.every:
        raise UsageError("--elastic needs --checkpoint DIR and --every N (a restart resumes from there)")
    if not args.dir.is_file():
        raise UsageError(f"--elastic wants a spec file to plan on the nodes present; {args.dir} is not a file")
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1" and "TORCHELASTIC_RUN_ID" in os.environ:
        # torch 2.13 + gloo: restarted workers fail to re-initialise on the shared store (stale keys)
        raise UsageError("--elastic needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                         "(`hetc launch SPEC --elastic` sets it)")


def _rank(args: argparse.Namespace) -> int:
    from hetc.hf.config import HfError
    from hetc.runtime.data import DataError
    from hetc.runtime.placement import ClusterMismatch
    from hetc.runtime.checkpoint_lock import CheckpointBusy
    from hetc.rank import run_worker
    from hetc.runtime.worker import CommTimeout, DeviceOutOfMemory, EnvError, PeerFailure, describe_latest

    # a rank of `--local` runs with its launcher's options (runtime/options.py), not with its own command line
    opts = RunOptions.from_json(os.environ[RUN_OPTIONS_ENV]) if RUN_OPTIONS_ENV in os.environ else run_options(args)
    try:
        if args.elastic:
            from hetc.elastic import run_elastic

            return run_elastic(args.dir, opts)
        return run_worker(args.dir, opts)
    except (EnvError, ClusterMismatch, DataError, CheckpointBusy, HfError) as err:   # HfError: pretrained weights
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        if os.environ.get("RANK") == "0" and LAUNCHER_ENV not in os.environ:
            print(f"hetc run: interrupted; {describe_latest(args.checkpoint)}", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as err:
        from hetc.runtime.checkpoint_files import CheckpointError

        if isinstance(err, CheckpointError):    # a checkpoint that cannot be read or saved: bad input, exit 2
            print(err.render() if err.path is not None else f"hetc run: error: {err}", file=sys.stderr, flush=True)
            return 2
        from hetc.runtime.nccl_order import NcclOrderDeadlock

        if not isinstance(err, PeerFailure | CommTimeout | DeviceOutOfMemory | NcclOrderDeadlock):
            raise
        print(f"hetc run: error: {err}", file=sys.stderr, flush=True)
        return 1


def run_options(args: argparse.Namespace) -> RunOptions:
    """The options of `hetc run` as the ranks take them."""
    return RunOptions(steps=args.steps, metrics=args.metrics, tensorboard=args.tensorboard, wandb=args.wandb,
                      trace=args.trace, checkpoint=args.checkpoint,
                      every=args.every, keep=args.keep, resume=args.resume,
                      resume_if_present=args.resume_if_present or args.elastic,
                      weights_from=args.load_weights_only, timeout_s=args.timeout, init_timeout_s=args.init_timeout,
                      grace_s=args.stop_timeout, heartbeat_timeout_s=args.heartbeat_timeout,
                      exit_after_s=None if args.exit_after is None else 60 * args.exit_after,
                      elastic=args.elastic, quiet=args.quiet, log_every=args.log_every, on_nonfinite=NonFinite(args.on_nonfinite),
                      rebalance=RebalanceOptions(args.rebalance_window, args.rebalance_threshold,
                                                 args.rebalance_cooldown, args.rebalance_min_gain,
                                                 args.rebalance_split_gain, args.rebalance_link_threshold)
                      if args.rebalance else None,
                      inject=tuple(parse_injection(text) for text in args.inject))


def _local(args: argparse.Namespace) -> int:
    from hetc.plandir import read_plan, read_program, unverified_files, verify_and_record
    from hetc.passes.verify import verify
    from hetc.runtime.local import spawn_local
    from hetc.runtime.placement import node_label

    _, checked = read_plan(args.dir)
    require_trainable_dtype(checked.spec)    # fp16's loss scale needs clipping: refused once, before any rank starts
    program = read_program(args.dir)
    world = checked.pipeline.world_size
    # the launcher checks edits once, before any rank starts, and records them for its ranks (Note [verified once])
    edited = unverified_files(args.dir, range(world))
    if edited is None:
        verify(program, checked)     # a plan directory from before markers
    elif edited:
        verify_and_record(args.dir, program, checked)
    if args.local not in (-1, world):
        raise UsageError(f"the plan has {world} ranks; --local {args.local} cannot run it")
    options = run_options(args)
    check_ranks(options.inject, world)
    if problem := options.plan_problem(checked.train):
        raise UsageError(problem)
    from hetc.runtime.nccl_order import emulation_from_env

    emulation_from_env()    # a bad HETC_EMULATE_NCCL: one message here, not one from every rank
    print(f"hetc run: starting {world} local rank{'s' if world > 1 else ''}", file=sys.stderr, flush=True)
    places = [(node_label(*gpu.host), gpu.local) for gpu in checked.pipeline.world]
    argv = [*(["--debug"] if getattr(args, "debug", False) else []), "run", str(args.dir)]
    status = spawn_local(world, argv, places, stop_timeout_s=args.stop_timeout,
                         env={RUN_OPTIONS_ENV: options.to_json()})
    if status == 130:
        from hetc.runtime.worker import describe_latest

        print(f"hetc run: interrupted; {describe_latest(args.checkpoint)}", file=sys.stderr, flush=True)
    return status


def _refuse_busy_checkpoint(directory: Path) -> None:
    """Fail before `--local` starts any rank when another run holds `directory` (plan rank 0 takes the lock
    itself once started: Note [Checkpoint directory lock]): one message instead of one per rank. Not under
    torchrun, where this check on every rank could hold the lock just when rank 0 takes it."""
    from hetc.runtime.checkpoint_lock import CheckpointBusy, lock_checkpoint_dir

    try:
        lock_checkpoint_dir(directory).release()
    except CheckpointBusy as err:
        raise UsageError(str(err)) from None
