"""`hetc check SPEC`: parse and validate; located errors and exit 2, or a summary."""

from __future__ import annotations

import argparse

from hetc.commands import Subparsers
from hetc.commands.planwarnings import print_plan_warnings
from hetc.compiler import load_checked
from hetc.passes.cost.params import model_params
from hetc.passes.validate import Checked
from hetc.ir.spec import AUTO
from hetc.ir.units import counted, human_count

__all__ = ["register", "summary"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "check", help="parse and validate a spec",
        description="Parse SPEC and its imports and check every rule of the language. Prints "
                    "FILE:LINE:COL: error: ... for each problem and exits 2, or prints a one-line summary. "
                    "An explicit plan is also checked against device memory with the cost model's estimate "
                    "(`hetc explain` shows the numbers).",
    )
    p.add_argument("specs", nargs="+", metavar="SPEC", help=".het file(s) to check")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for path in args.specs:
        _loaded, checked = load_checked(path, require_fit=True)
        if (plan := checked.explicit()) is not None:
            print_plan_warnings(plan)
        if not args.quiet:
            print(f"{path}: ok: {summary(checked)}")
    return 0


def summary(checked: Checked) -> str:
    spec = checked.spec
    parts: list[str] = []
    if spec.model is not None:
        m = spec.model
        parts.append(f"model {m.name} ({m.arch.value}, {m.layers} blocks, {human_count(model_params(m))} params)")
    if checked.topology is not None:
        kinds = sorted({g.device.name for g in checked.topology.gpus})
        parts.append(f"{checked.topology.num_gpus} GPUs ({', '.join(kinds)})")
    if spec.parallel is not None:
        par = spec.parallel
        if checked.pipeline is not None:
            p = checked.pipeline
            lanes = "/".join(str(len(s.lanes)) for s in p.stages)
            parts.append(f"{p.world_size} ranks in {counted(len(p.stages), 'stage')} (lanes {lanes}), "
                         f"{counted(len(p.ministages), 'ministage')}, "
                         f"{counted(p.num_microbatches, 'microbatch')}, schedule {p.schedule.value}")
        elif par.stages is AUTO or par.schedule is AUTO:
            parts.append("plan: auto")
        else:
            parts.append("plan: partly auto")
    if not parts:
        parts.append(f"{len(spec.devices)} device kinds")
    return "; ".join(parts)
