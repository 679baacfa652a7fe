"""`hetc run DIR`: execute a compiled plan on torch.distributed.

Under torchrun every rank runs `hetc run DIR`; with `--local [N]` this
command starts the plan's N ranks itself on this machine (gloo on CPU,
NCCL on GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetc.cli import UsageError
from hetc.passes.verify import VerifyError, verified_evaluation, verify
from hetc.program import ProgramFormatError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="train a compiled plan (under torchrun, or --local)",
        description="Execute DIR's per-rank programs. Under torchrun (which sets RANK, WORLD_SIZE, "
                    "MASTER_ADDR, ...) each process runs its rank; with --local the plan's ranks are started "
                    "here. Rank 0 prints a line per step.",
        epilog="examples:\n  hetc run out/demo --local --steps 20 --metrics m.jsonl\n"
               "  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m hetc run out/plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", type=Path, metavar="DIR", help="a plan directory from `hetc compile`")
    p.add_argument("--local", nargs="?", const=-1, type=int, metavar="N",
                   help="start the plan's ranks on this machine (N must equal the plan's world size)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the spec's train.steps)")
    p.add_argument("--metrics", type=Path, metavar="FILE", help="one JSON line per step (rank 0)")
    p.add_argument("--trace", type=Path, metavar="FILE", help="measured timeline of the last step")
    p.add_argument("--checkpoint", type=Path, metavar="DIR",
                   help="save DCP checkpoints here (DIR/step-N, DIR/latest); any plan of the model can resume")
    p.add_argument("--every", type=int, default=0, metavar="K",
                   help="save every K steps (and always after the last step)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint")
    p.add_argument("-q", "--quiet", action="store_true", help="print no line per step")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S", help="collective timeout in seconds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (args.dir / "plan.het").is_file():
        raise UsageError(f"{args.dir} is not a plan directory (write one with `hetc compile SPEC -o DIR`)")
    if args.steps is not None and args.steps < 1:
        raise UsageError("--steps must be positive")
    if args.every < 0:
        raise UsageError("--every must not be negative")
    if (args.resume or args.every) and args.checkpoint is None:
        raise UsageError(f"{'--resume' if args.resume else '--every'} needs --checkpoint DIR")
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


def _rank(args: argparse.Namespace) -> int:
    from hetc.runtime.checkpoint import CheckpointError
    from hetc.runtime.cluster_check import ClusterMismatch
    from hetc.runtime.data import DataError
    from hetc.runtime.worker import EnvError, PeerFailure, RunOptions, run_worker

    opts = RunOptions(steps=args.steps, metrics=args.metrics, trace=args.trace, checkpoint=args.checkpoint,
                      every=args.every, resume=args.resume, timeout_s=args.timeout, quiet=args.quiet)
    try:
        return run_worker(args.dir, opts)
    except (EnvError, ClusterMismatch, DataError) as err:
        raise UsageError(str(err)) from None
    except (PeerFailure, CheckpointError) as err:
        print(f"hetc run: error: {err}", file=sys.stderr, flush=True)
        return 1


def _local(args: argparse.Namespace) -> int:
    from hetc.plandir import read_plan, read_program
    from hetc.runtime.local import spawn_local

    _, checked = read_plan(args.dir)
    program = read_program(args.dir)
    verify(program, checked.pipeline, checked.spec)   # before starting any rank
    verified_evaluation(program, checked.pipeline, checked.spec)
    world = checked.pipeline.world_size
    if args.local not in (-1, world):
        raise UsageError(f"the plan has {world} ranks; --local {args.local} cannot run it")
    argv = ["run", str(args.dir)]
    for flag in ("steps", "metrics", "trace", "checkpoint", "every", "timeout"):
        value = getattr(args, flag)
        if value is not None and not (flag == "every" and value == 0):
            argv += [f"--{flag}", str(value)]
    argv += [f"--{flag}" for flag in ("resume", "quiet") if getattr(args, flag)]
    print(f"hetc run: starting {world} local rank{'s' if world > 1 else ''}", file=sys.stderr, flush=True)
    return spawn_local(world, argv)
