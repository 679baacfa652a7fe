"""`hetc compile SPEC -o DIR`: lower an explicit plan to per-rank programs, verify, write DIR."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TextIO

from hetc.commands import Subparsers
from hetc.commands.planwarnings import print_plan_warnings
from hetc.commands.progress import progress_printer
from hetc.compiler import Compiled, compile_spec, write_compiled
from hetc.membudget import MemoryBudgetExceeded, memory_budget, parse_memory
from hetc.passes.cost.provenance import Provenance, provenance
from hetc.passes.export_torch import why_not_exported
from hetc.passes.lower import PASS_NAMES, PASSES
from hetc.passes.validate_fit import near_capacity_warning, peak_uses
from hetc.passes.verify import VerifyError
from hetc.passes.verify.memory import rank_peaks
from hetc.plandir import PROFILE_ENV, check_plan_out
from hetc.commands.planargs import add_time_limit_option
from hetc.commands.profileargs import add_profile_option, load_profile_args
from hetc.ir.program import Program
from hetc.ir.units import human_seconds

__all__ = ["print_profile_use", "register"]

log = logging.getLogger("hetc.compile")


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "compile", help="lower a plan to per-rank programs and verify them",
        description="Lower SPEC's explicit plan to one instruction program per rank, prove the programs "
                    "deadlock-free and complete (the verifier), and write the plan directory DIR: plan.het, "
                    "programs/rank-NNNN.txt (+ .json), groups.txt, summary.json, profiles.json, and torch/*.csv "
                    "(each lane's pipeline in torch.distributed.pipelining's action format) for plans whose lanes "
                    "line up across stages; for many-to-many pipelines (e.g. Zorse's) torch's format has no "
                    "equivalent, and compile skips torch/ (`hetc -v compile` says why). "
                    f"Measured profiles come from --profile and ${PROFILE_ENV}.",
        epilog="passes: " + "; ".join(f"{n} ({d})" for n, d, _ in PASSES),
    )
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DIR",
                   help="the plan directory to write: a new or empty directory, or one `hetc compile` wrote "
                        "(replaced whole); never the spec's folder or the current directory, and never one "
                        "holding a file hetc did not write")
    p.add_argument("--dump-after", choices=PASS_NAMES + ["all"], metavar="PASS",
                   help=f"print every rank's program after PASS ({', '.join(PASS_NAMES)} or all)")
    p.add_argument("--max-memory", type=parse_memory, metavar="SIZE",
                   help="stop with a message, exit 2, when compile's resident memory passes SIZE (8GiB, 512MB), "
                        "instead of being killed by the kernel with no word of what ran out")
    add_profile_option(p)
    add_time_limit_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()

    def dump(name: str, program: Program) -> None:
        sys.stdout.write(f"# after pass {name}\n")
        for rp in program.ranks:
            sys.stdout.write(rp.to_text() + "\n")

    check_plan_out(args.out, Path(args.spec).parent)   # before the work: the write checks again
    profiles = load_profile_args(args.profile)
    progress = progress_printer("compile", start)
    phase = ["checking"]

    def tell(line: str) -> None:
        phase[0] = f"after: {line}"
        progress(line)
    try:
        with memory_budget(args.max_memory):   # the budget is checked once more as it ends: before the write
            compiled = compile_spec(Path(args.spec), args.dump_after, dump if args.dump_after else None, profiles,
                                    args.time_limit, tell)
            _warn_near_capacity(compiled)
            print_plan_warnings(compiled.plan)
    except VerifyError as err:
        print(f"hetc compile: the lowered programs are unsafe (a bug in hetc's lowering):\n{err.render()}",
              file=sys.stderr)
        return 1
    except MemoryBudgetExceeded as err:
        print(f"hetc compile: error: stopped ({phase[0]}): {err}; nothing was written to {args.out}. Raise "
              "--max-memory, or compile a smaller plan (fewer ranks or microbatches per lane)", file=sys.stderr)
        return 2
    summary = write_compiled(compiled, args.out, args.profile)
    program, step = compiled.program, compiled.timeline.step_time
    took = time.perf_counter() - start
    if (why := why_not_exported(compiled.pipeline)) is not None:   # by design for many-to-many: not news
        log.info("torch/*.csv not written: %s", why)
    print(f"compiled {args.spec}: {program.world_size} ranks, {summary['instructions']} instructions, "
          f"verified; predicted {human_seconds(step)}/step ({summary['tokens_per_s']:,.0f} tokens/s) "
          f"[{took:.2f}s] -> {args.out}/")
    print_profile_use(provenance(compiled.costs), bool(compiled.costs.profiles.sources))
    return 0


def _warn_near_capacity(compiled: Compiled) -> None:
    """The verifier's peaks, as its overflow errors read them: a warning for ranks near capacity."""
    peaks = rank_peaks(compiled.program, compiled.pipeline, compiled.costs)
    warning = near_capacity_warning(compiled.pipeline, peak_uses(peaks), "the verifier finds")
    if warning is not None:
        print(f"hetc compile: warning: {warning}", file=sys.stderr)


def print_profile_use(prov: Provenance, offered: bool, file: TextIO | None = None) -> None:
    """What timed the plan's layers and which profiles offered are unused, and why (Note [provenance])."""
    if offered:
        print("layer times from: " + "; ".join(sorted({s for stage in prov.layers.values() for s in stage})),
              file=file)
    for u in prov.unused:
        print(f"unused profile {u}", file=file)
