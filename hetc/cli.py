"""The `hetc` command line: one entry point, one module per verb.

Each module in `hetc.commands` exposes `register(subparsers)`, which adds its
parser and sets `func(args) -> int`. User errors (`SpecError`, `UsageError`)
print located messages and exit 2; anything else is a bug in hetc and says so
(`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
from typing import NoReturn

from hetc import __version__
from hetc.ir.errors import Sources, SpecError, UsageError
from hetc.ir.interrupt import seen, watch
from hetc.runtime.local import take_signals_as_rank

__all__ = ["BROKEN_PIPE_STATUS", "INTERRUPTED_STATUS", "VERBS", "main", "program"]

# `hetc explain X | head`: the reader went away. A shell reports a program killed by
# SIGPIPE as 128 + 13; Python ignores the signal, so hetc says the same in its status.
BROKEN_PIPE_STATUS = 128 + 13
INTERRUPTED_STATUS = 128 + 2    # Ctrl-C: what a shell reports for a program SIGINT ended

# verb modules, in the order `hetc --help` lists them
VERBS = ["demo", "check", "fmt", "plan", "compile", "verify", "run", "launch", "viz", "explain", "profile",
         "calibrate", "import_", "export", "data"]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the arguments, only the verb they name (Note [one verb's parser])."""
    parser = argparse.ArgumentParser(
        prog="hetc",
        description="Compile and run LLM training plans for heterogeneous GPU clusters.",
        epilog="Run `hetc VERB --help` for each verb. Spec language: docs/language.md.",
    )
    parser.add_argument("--version", action="version", version=f"hetc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks of internal errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for name in _verbs_to_register(argv):
        importlib.import_module(f"hetc.commands.{name}").register(sub)
    return parser


# Note [one verb's parser]: each verb's module imports what its verb needs (`check` the whole compiler),
# so registering all fifteen costs every process the imports of verbs it does not run, and each rank of
# `hetc run` is a process (0.05 s for `run`, whose own imports are most of them; more for lighter verbs).
# Where the arguments name a verb (the first word not an option: hetc's own options take no value), only
# that verb is registered; `hetc --help`, no verb or an unknown word register them all, so that usage,
# help and "invalid choice" errors list every verb.


def _verbs_to_register(argv: list[str] | None) -> list[str]:
    words = [word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")]
    module = {verb.rstrip("_"): verb for verb in VERBS}.get(words[0]) if words else None   # `import_` is `import`
    return [module] if module else VERBS


def main(argv: list[str] | None = None) -> int:
    """Run one verb in this process and return its exit status (what tests call)."""
    return _run(build_parser(argv).parse_args(argv))


# Note [ending a one-shot process at once]: `hetc plan` builds hundreds of thousands of small objects
# (option tables, the winner's per-rank programs and the verifier's posted ops), some in cycles. Once the
# answer is printed, collecting and freeing them takes about a second at 2048 GPUs (benchmarks/planner.py)
# and changes nothing: the process is about to end. A verb that writes nothing after its output and
# starts no threads or child processes sets `quick_exit`: as a program (`hetc ...`, `python -m hetc`),
# it runs with the cyclic collector off, and once its output and logs are flushed the process ends
# without tearing the interpreter down (`os._exit`). In-process callers (`main`) keep the usual ending,
# and so does a process run under a profiler or tracer, which writes its findings at the end.


def program() -> NoReturn:
    """`hetc` as a process (Note [ending a one-shot process at once])."""
    watch()                  # as `python -m hetc` does first: Note [a Ctrl-C an import swallows]
    take_signals_as_rank()   # a rank `hetc run --local` started: Note [signals under --local]
    try:
        _program()
    except KeyboardInterrupt:   # Ctrl-C where `_run` does not catch it: while the verbs import, say
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_STATUS)
    except Exception:
        # a Ctrl-C that surfaced as another error: Python re-raises an exception in a class body's
        # __set_name__ (lark's, while a verb imports) as a RuntimeError
        if not seen():
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_STATUS)


def _program() -> NoReturn:
    gc.disable()   # while the verbs import; back on below unless the verb ends at once
    args = build_parser(sys.argv[1:]).parse_args()
    # a profiler or tracer (cProfile, coverage) writes its findings as the interpreter ends: let it
    quick = bool(getattr(args, "quick_exit", False)) and sys.getprofile() is None and sys.gettrace() is None
    if not quick:
        gc.enable()
    status = _run(args)
    if not quick:
        sys.exit(status)
    logging.shutdown()   # flushes every handler
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        status = BROKEN_PIPE_STATUS
    sys.stderr.flush()
    os._exit(status)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        status = args.func(args) or 0
        sys.stdout.flush()   # here, not at exit, so that a closed pipe is handled below
        return status
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_STATUS
    except SpecError as err:
        sources = Sources()  # reads the quoted lines back from disk
        for diag in err.diagnostics:
            print(diag.render(sources), file=sys.stderr)
        count = len(err.diagnostics)
        if count > 1:
            print(f"{count} errors", file=sys.stderr)
        return 2
    except UsageError as err:
        print(f"hetc {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except Exception as err:  # noqa: BLE001 - the last line of defence
        if args.debug:
            raise
        notes = "".join(f"\n  {note}" for note in getattr(err, "__notes__", ()))   # e.g. the interpreter's
        print(f"hetc {args.verb}: internal error: {type(err).__name__}: {err}{notes}\n"
              "this is a bug in hetc; rerun with --debug for the traceback", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    program()
