"""`hetc import sailor|zorse|hf`: other systems' inputs as a .het spec (DESIGN.md §5)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.commands.argtypes import file_or_stdout

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("import", help="turn Sailor's, Zorse's or Hugging Face's inputs into a .het spec",
                       description="Write a .het spec that carries another system's cluster, model and plan. "
                                   "The spec passes `hetc check`; `hetc explain SPEC --profile DIR` times it "
                                   "with that system's measured profiles.")
    systems = p.add_subparsers(dest="system", metavar="SYSTEM", required=True)
    s = systems.add_parser("sailor", help="a Sailor data folder and plan (or quotas)",
                           description="DIR is laid out like Sailor's: profiles/<MODEL>/<GPU>/profile.json, "
                                       "training_config_*.json, network fits, prices.")
    s.add_argument("--data", required=True, metavar="DIR", help="the Sailor data folder")
    s.add_argument("--model", metavar="NAME",
                   help="Sailor's model name, e.g. OPT-350 (with --plan, by default the model whose layer "
                        "count the plan covers)")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", metavar="PLAN.json", help="a Sailor plan: the spec carries it explicitly")
    which.add_argument("--quotas", metavar="QUOTAS.json",
                       help="{gpu_kind: {zone: GPUs}}: the spec's plan is auto, for hetc plan")
    s.add_argument("-o", "--output", type=file_or_stdout, metavar="OUT.het",
                   help="write here instead of stdout (`-`: stdout)")
    s.set_defaults(func=_sailor)
    z = systems.add_parser("zorse", help="Zorse's cluster_info.json and training_config.json",
                           description="DIR is Zorse's folder with data/model_stats.json and "
                                       "data/model_latencies.json.")
    z.add_argument("--data", required=True, metavar="DIR", help="the Zorse folder")
    z.add_argument("--cluster", required=True, metavar="cluster_info.json",
                   help="Zorse's cluster description")
    z.add_argument("--model", required=True, metavar="NAME",
                   help="Zorse's model name, e.g. deepspeedllama_7b")
    z.add_argument("--plan", metavar="training_config.json", help="a Zorse plan (without: the plan is auto)")
    z.add_argument("-o", "--output", type=file_or_stdout, metavar="OUT.het",
                   help="write here instead of stdout (`-`: stdout)")
    z.set_defaults(func=_zorse)
    h = systems.add_parser("hf", help="a Hugging Face model directory's config.json",
                           description="Print the explicit model block equivalent to `model NAME { hf = "
                                       "\"DIR\" }` (architecture and sizes; the weights stay in DIR).")
    h.add_argument("directory", metavar="DIR", help="a directory with config.json")
    h.add_argument("--name", metavar="NAME", help="the model's name (default: DIR's name)")
    h.add_argument("-o", "--output", type=file_or_stdout, metavar="OUT.het",
                   help="write here instead of stdout (`-`: stdout)")
    h.set_defaults(func=_hf)


def _sailor(args: argparse.Namespace) -> int:
    from hetc.ir.errors import UsageError
    from hetc.importers.sailor import import_sailor, plan_model

    model = args.model
    if model is None:
        if args.plan is None:
            raise UsageError("hetc import sailor --quotas needs --model NAME (Sailor's model name)")
        model = plan_model(args.data, args.plan)
    _check_output(args.output, [(args.plan, "the Sailor plan"), (args.quotas, "the quotas")])
    return _emit(import_sailor(args.data, model, args.plan, args.quotas), args.output)


def _zorse(args: argparse.Namespace) -> int:
    from hetc.importers.zorse import import_zorse

    _check_output(args.output, [(args.cluster, "the Zorse cluster"), (args.plan, "the Zorse plan")])
    return _emit(import_zorse(args.data, args.cluster, args.model, args.plan), args.output)


def _hf(args: argparse.Namespace) -> int:
    from hetc.ir.errors import UsageError
    from hetc.frontend.convert import import_model
    from hetc.hf.config import HfError
    from hetc.frontend.printer import format_spec
    from hetc.ir.spec import Spec

    directory = Path(args.directory)
    _check_output(args.output, [(str(directory / "config.json"), "the model's config.json")])
    name = args.name or directory.resolve().name.replace(".", "_") or "model"
    try:
        model = import_model(directory, name)
    except HfError as err:
        raise UsageError(str(err)) from None
    header = f"# {directory / 'config.json'}; `hf = \"{directory}\"` beside these keys also loads its weights\n"
    return _emit(header + format_spec(Spec(model=model)), args.output)


def _check_output(output: Path | None, reads: list[tuple[str | None, str]]) -> None:
    """-o must not replace an input (Note [output files] in hetc/ir/outdir.py)."""
    from hetc.ir.outdir import check_output_file

    if output is not None:
        check_output_file(output, "-o", [(Path(path), what) for path, what in reads if path])


def _emit(text: str, output: Path | None) -> int:
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)
    return 0
