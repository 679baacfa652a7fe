"""`hetc fmt SPEC [-i]`: print a spec file in canonical form (comments kept)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetc.commands import Subparsers
from hetc.ir.errors import Sources
from hetc.frontend.load import parse_file
from hetc.frontend.printer import format_file

__all__ = ["register"]


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "fmt", help="format a spec file canonically",
        description="Print SPEC in canonical form: one statement per line, two-space indent, comments "
                    "kept. Imports are not followed. Formatting is idempotent.",
    )
    p.add_argument("specs", nargs="+", metavar="SPEC")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-i", "--in-place", action="store_true", help="rewrite the files")
    mode.add_argument("--check", action="store_true", help="exit 1 if a file is not formatted")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    status = 0
    for name in args.specs:
        path = Path(name)
        text = format_file(parse_file(path, Sources()))
        if not (args.in_place or args.check):
            sys.stdout.write(text)
        elif path.read_text() == text:
            continue
        elif args.in_place:
            tmp = path.with_name(path.name + ".fmt.tmp")
            tmp.write_text(text)
            tmp.replace(path)  # atomic: never a half-written spec
        else:
            print(f"{path}: not formatted", file=sys.stderr)
            status = 1
    return status
