"""`hetc verify DIR`: re-read a plan directory's programs and prove them safe."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.ir.errors import UsageError
from hetc.ir.outdir import edited_files
from hetc.passes.verify import Backend, VerifyError, plan_backend
from hetc.plandir import read_plan, read_program, verify_and_record
from hetc.ir.program import ProgramFormatError

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "verify", help="verify a plan directory's programs",
        description="Read DIR/plan.het and DIR/programs/rank-*.txt (possibly edited by hand) and run the "
                    "verifier: every send meets its receive, collectives match, no rank blocks forever, every "
                    "microbatch passes every ministage forward and backward once, every step follows its "
                    "gradients, every send and receive moves the tensor plan.het gives it, every rank's memory (cost model) "
                    "fits its device. Exit 0, or name the rank and instruction (and the files changed since "
                    "`hetc compile`) and exit 2.",
    )
    p.add_argument("dir", type=Path, metavar="DIR")
    p.add_argument("--backend", choices=[b.value for b in Backend], default=None,
                   help="whose blocking rule to prove the programs deadlock-free under: gloo (a posted send, "
                        "receive or collective completes once its partners are posted) or nccl (also, a rank's "
                        "operations on one communicator -- the direction of a send or receive (sender to receiver), the group of a "
                        "collective -- start in posting order, one at a time, as they do on a GPU); "
                        "default: the backend the plan's ranks run (nccl where they have GPUs, gloo on CPU)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        raise UsageError(f"{args.dir} is not a directory")
    _, checked = read_plan(args.dir)
    try:
        program = read_program(args.dir)
    except ProgramFormatError as err:
        print(f"{err.source or args.dir}:{err.line}: error: {str(err).split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    backend = Backend(args.backend) if args.backend else plan_backend(checked.pipeline)
    try:   # recorded as verified when it passes under the plan's own rules: what `hetc run` reads
        recorded = verify_and_record(args.dir, program, checked, backend)
    except VerifyError as err:
        print(err.render(), file=sys.stderr)
        if edited := edited_files(args.dir):   # the sha256 compile recorded (hetc/ir/outdir.py)
            print(f"note: changed since `hetc compile` wrote them: {', '.join(edited)}", file=sys.stderr)
        return 2
    print(f"{args.dir}: ok: {program.world_size} ranks, {sum(len(r.instrs) for r in program.ranks)} "
          f"instructions verified ({backend} rules){'; recorded as verified' if recorded else ''}")
    return 0
