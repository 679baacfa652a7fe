"""A plan directory's predicted step, for `hetc viz` and `hetc calibrate`.

The prediction `hetc compile` recorded (DIR/timeline.json), unless the
profiles given now (`--profile`, `$HETC_PROFILES`) are not the ones it was
made with (Note [recorded profiles] in hetc/commands/profileargs.py): then the
programs are simulated again with them, so what is compared is the
prediction those profiles give.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hetc.ir.errors import UsageError
from hetc.commands.profileargs import load_profile_args, read_recorded, same_as_recorded, stale_profiles
from hetc.plandir import TIMELINE_FILE, profile_paths, read_program
from hetc.ir.program import ProgramFormatError
from hetc.ir.timeline import Timeline
from hetc.ir.units import human_seconds

__all__ = ["plan_prediction"]


def plan_prediction(path: Path, profile_args: list[str], verb: str, note_recorded: bool) -> Timeline | None:
    """DIR's predicted Timeline (None when it has none); notes on stderr say what it was made with.

    `note_recorded`: say which profiles the recorded prediction used, and which of them have changed.
    """
    recorded = read_recorded(path) if path.is_dir() else None
    if path.is_dir() and profile_paths(profile_args) and not same_as_recorded(profile_args, recorded):
        return _predict_again(path, profile_args, verb)
    if note_recorded and recorded is not None:
        names = ", ".join(r.path for r in recorded) or ("no measured profile (the catalog's arithmetic; `hetc "
                                                        "profile SPEC -o FILE` measures this machine, --profile "
                                                        "FILE predicts with it)")
        print(f"hetc {verb}: the prediction in {path} was made with {names}", file=sys.stderr)
        for line in stale_profiles(recorded):
            print(f"hetc {verb}: warning: {line}", file=sys.stderr)
    predicted_file = path if path.is_file() else path / TIMELINE_FILE
    if not predicted_file.is_file():
        return None
    from hetc.commands.viz import read_timeline

    return read_timeline(predicted_file)


def _predict_again(path: Path, profile_args: list[str], verb: str) -> Timeline:
    from hetc.commands.compile import print_profile_use
    from hetc.compiler import predict
    from hetc.ir.errors import SpecError
    from hetc.passes.cost.provenance import provenance
    from hetc.plandir import read_plan

    profiles = load_profile_args(profile_args)
    try:
        _, checked = read_plan(path)
        program = read_program(path)
    except (SpecError, ProgramFormatError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    costs, timeline = predict(program, checked, profiles)
    print(f"hetc {verb}: predicted again with {', '.join(profile_paths(profile_args))} "
          f"({human_seconds(timeline.step_time, digits=4)}/step)", file=sys.stderr)
    print_profile_use(provenance(costs), True, file=sys.stderr)
    return timeline
