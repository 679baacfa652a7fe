"""`hetc viz DIR`: the schedule as an HTML page, a Chrome trace, or a terminal grid."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hetc.viz.classgap import ClassGap, class_gaps, gap_table, read_measured
from hetc.commands import Subparsers
from hetc.ir.errors import UsageError
from hetc.ir.userfile import read_user_text
from hetc.plandir import PROFILE_ENV, TIMELINE_FILE, read_program
from hetc.commands.prediction import plan_prediction
from hetc.commands.profileargs import add_profile_option
from hetc.ir.program import ProgramFormatError
from hetc.ir.timeline import Timeline, mean_class_times

__all__ = ["parse_ranks", "read_timeline", "register"]

log = logging.getLogger(__name__)


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "viz", help="draw a plan's schedule (HTML page, Chrome trace, text grid)",
        description="Draw the schedule of a plan directory written by `hetc compile` (its predicted "
                    "timeline.json), or a trace measured by `hetc run --trace`. The page is one "
                    "self-contained HTML file: a row per rank grouped by stage and lane, tracks for "
                    "compute, P2P, collectives and copies, send->recv arrows, bubbles and memory. With --profile (or "
                    f"${PROFILE_ENV}) other than the profiles DIR was compiled with, the prediction is made "
                    "again with them. --compare shows the gap per time class (compute, comm_wait, optimizer, "
                    "offload) and says when the profiles of DIR's prediction have changed.",
    )
    p.add_argument("dir", metavar="DIR", help="plan directory (or a timeline .json file)")
    p.add_argument("-o", "--output", metavar="FILE.html",
                   help="write the page here (default DIR/schedule.html when nothing else is asked for)")
    p.add_argument("--trace", metavar="MEASURED.json", help="draw this measured timeline instead of DIR's prediction")
    p.add_argument("--compare", action="store_true",
                   help="with --trace: predicted and measured side by side (each rank's rows one above the other)")
    p.add_argument("--metrics", metavar="METRICS.jsonl",
                   help="with --compare: the measured time per class from `hetc run --metrics` (median of "
                        "its steps after the first; default: the trace's step)")
    add_profile_option(p)
    p.add_argument("--chrome-trace", metavar="FILE.json",
                   help="also write the Trace Event format (open in ui.perfetto.dev or chrome://tracing)")
    p.add_argument("--text", action="store_true", help="print the programs as a steps x ranks grid")
    p.add_argument("--ranks", metavar="LIST", help="with --text: only these ranks, e.g. 0,2,8-11")
    p.add_argument("--title", help="page title (default: the directory name)")
    p.set_defaults(func=run)


def parse_ranks(text: str, world: int) -> list[int]:
    """'0,2,8-11' -> [0, 2, 8, 9, 10, 11], each a rank of a program of `world` ranks."""
    ranks: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise UsageError(f"--ranks: '{part}' is not a rank or a range like 8-11") from None
        if lo > hi or lo < 0:
            raise UsageError(f"--ranks: bad range '{part}'")
        if hi >= world:     # before the range is spelt out: 0-99999999999 is a few words
            raise UsageError(f"--ranks: no rank {hi} in a program of {world} ranks")
        ranks.extend(range(lo, hi + 1))
    if not ranks:
        raise UsageError(f"--ranks '{text}' names no rank")
    return ranks


def read_timeline(path: Path) -> Timeline:
    """A timeline file, or a UsageError that names it and says what is wrong."""
    try:
        return Timeline.from_json(read_user_text(path, "timeline"))
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not JSON ({err})") from None
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: not a timeline ({type(err).__name__}: {err})") from None


def _gaps(args: argparse.Namespace, predicted: Timeline, measured: Timeline) -> tuple[list[ClassGap], float]:
    """The per-class gaps of --compare and the measured step they go with."""
    if args.metrics:
        classes, step = read_measured(Path(args.metrics))
    else:
        classes, step = mean_class_times(list(measured.classes)), measured.step_time
    return class_gaps(mean_class_times(list(predicted.classes)), classes), step


def _timelines(args: argparse.Namespace, path: Path) -> list[Timeline]:
    """What to draw: [predicted], [measured], or [predicted, measured] with --compare."""
    predicted = plan_prediction(path, args.profile, "viz", args.compare)
    measured = read_timeline(Path(args.trace)) if args.trace else None
    if args.compare:
        if predicted is None or measured is None:
            raise UsageError("--compare needs DIR/timeline.json and --trace MEASURED.json")
        return [predicted, measured]
    if measured is not None:
        return [measured]
    if predicted is None:
        raise UsageError(f"{path} has no {TIMELINE_FILE}; pass --trace MEASURED.json (from `hetc run --trace`)")
    return [predicted]


def _check_outputs(args: argparse.Namespace, path: Path, output: str | None) -> None:
    """Neither output replaces an input, the other output or a file of a plan directory (Note [output files])."""
    from hetc.ir.outdir import check_output_file

    reads = [(Path(p), what) for p, what in ((args.trace, "the --trace timeline"), (args.metrics, "the --metrics file"))
             if p] + ([(path, "the timeline drawn")] if path.is_file() else [])
    if args.chrome_trace:
        check_output_file(Path(args.chrome_trace), "--chrome-trace", reads)
    if output:
        check_output_file(Path(output), "-o", reads + [(Path(p), "the --chrome-trace output")
                                                      for p in [args.chrome_trace] if p])


def run(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    if not path.exists():
        raise UsageError(f"{path}: no such directory")
    if path.is_file() and path.suffix == ".het":
        raise UsageError(f"{path} is a spec, and viz draws a plan directory: run `hetc compile {path} -o DIR` "
                         "and then `hetc viz DIR`")
    if args.ranks and not args.text:
        raise UsageError("--ranks goes with --text")
    if args.metrics and not args.compare:
        raise UsageError("--metrics goes with --compare")
    if args.profile and path.is_file():
        raise UsageError("--profile predicts a plan directory's programs again; DIR is a timeline file")
    unused = [flag for flag, given in (("--trace", args.trace), ("--profile", args.profile), ("--title", args.title))
              if given]
    if args.text and unused and not (args.output or args.chrome_trace or args.compare):
        raise UsageError(f"{', '.join(unused)} go{'es' if len(unused) == 1 else ''} with a drawing of the timeline "
                         "(-o FILE.html, --chrome-trace FILE.json or --compare); --text alone prints the programs")
    if args.text:
        _print_grid(path, args.ranks)
    output = args.output
    if output is None and not args.text and not args.chrome_trace:
        output = str((path.parent if path.is_file() else path) / "schedule.html")
    if output is None and not args.chrome_trace and not args.compare:
        return 0
    _check_outputs(args, path, output)
    timelines = _timelines(args, path)
    gaps: list[ClassGap] = []
    if args.compare:
        gaps, measured_step = _gaps(args, timelines[0], timelines[1])
        if args.text:
            print("time per class, mean per rank, one step:")
            print(gap_table(gaps, timelines[0].step_time, measured_step))
    if output is None and not args.chrome_trace:
        return 0
    if args.chrome_trace:
        from hetc.viz.chrome import chrome_trace_json
        Path(args.chrome_trace).write_text(chrome_trace_json(timelines))
        print(f"wrote {args.chrome_trace} (open it in ui.perfetto.dev or chrome://tracing)")
    if output:
        from hetc.viz.page import render_page
        title = args.title or f"{path.resolve().name} schedule"
        html = render_page(timelines, title, gaps)
        Path(output).write_text(html)
        events = sum(len(t.events) for t in timelines)
        size = f"{len(html) / 1e6:.1f} MB" if len(html) >= 100_000 else f"{len(html) / 1e3:.0f} kB"
        print(f"wrote {output} ({len(timelines[0].ranks)} ranks, {events} events, {size})")
    return 0


def _print_grid(path: Path, ranks: str | None) -> None:
    from hetc.ir.grid import render_grid
    try:
        program = read_program(path)
    except (ProgramFormatError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    wanted = parse_ranks(ranks, program.world_size) if ranks is not None else None
    try:
        grid = render_grid(program, ranks=wanted)
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(grid, flush=True)   # a closed pipe (`| head`) is hetc.cli's to handle, as for every verb
