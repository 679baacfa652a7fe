"""The measured profiles a verb predicts time with: `--profile FILE` (repeatable) and `$HETC_PROFILES`.

Every verb that predicts time (`plan`, `explain`, `compile`, `viz`,
`calibrate`) takes its profiles through `add_profile_option` and
`load_profile_args`, so they read the same files in the same order: the
environment's first, then the command line's.

Note [recorded profiles]: `hetc compile` writes DIR/profiles.json, the
profiles its prediction (DIR/timeline.json) was made with, each with the
sha256 of its content (a data folder: of its files' names and contents),
and those it offered but did not use, with the reason. `hetc viz --compare`
and `hetc calibrate` read it back: a file since changed or gone is said so,
since the prediction on the page is then not what those files would give.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from hetc.ir.errors import Span, SpecError, UsageError
from hetc.plandir import PROFILE_ENV, PROFILES_FILE, RecordedProfile, fingerprint, profile_paths

if TYPE_CHECKING:
    from hetc.passes.cost import Profiles

__all__ = ["add_profile_option", "load_profile_args", "read_recorded", "same_as_recorded", "stale_profiles"]


def add_profile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="append", default=[], metavar="FILE|DIR",
                   help=f"a `hetc profile` file, a Sailor data folder or a Zorse folder (repeatable; "
                        f"after those in ${PROFILE_ENV})")


def load_profile_args(paths: list[str]) -> Profiles:
    """The Profiles of `profile_paths(paths)`; a SpecError located at the file whose content is wrong, or a
    UsageError naming the file or folder that cannot be read."""
    from hetc.passes.cost import ProfileError
    from hetc.passes.cost.sources import load_profiles

    try:
        return load_profiles([*profile_paths(paths)])
    except ProfileError as err:
        if err.file is not None:
            raise SpecError.at(Span.file_start(err.file), err.message) from None
        raise UsageError(str(err)) from None


def read_recorded(plan_dir: Path) -> list[RecordedProfile] | None:
    """The profiles DIR's prediction was made with; None for a directory older than profiles.json."""
    path = plan_dir / PROFILES_FILE
    if not path.is_file():
        return None
    try:
        return [RecordedProfile(str(r["path"]), str(r["sha256"])) for r in json.loads(path.read_text())["profiles"]]
    except (ValueError, KeyError, TypeError) as err:    # ValueError: not JSON, or not UTF-8
        raise UsageError(f"{path}: not a profiles record ({type(err).__name__}: {err})") from None


def stale_profiles(recorded: list[RecordedProfile]) -> list[str]:
    """One line per recorded profile that has changed or gone since the prediction was made."""
    out = []
    for r in recorded:
        now = fingerprint(Path(r.path))
        if now is None:
            out.append(f"{r.path} is missing (the prediction was made with it)")
        elif now != r.sha256:
            out.append(f"{r.path} has changed since the prediction was made (sha256 {r.sha256[:12]} then, "
                       f"{now[:12]} now)")
    return out


def same_as_recorded(paths: list[str], recorded: list[RecordedProfile] | None) -> bool:
    """Whether `profile_paths(paths)` are the recorded files with the recorded content."""
    if recorded is None:
        return not profile_paths(paths)
    given = [(str(Path(p).resolve()), fingerprint(Path(p))) for p in profile_paths(paths)]
    return given == [(r.path, r.sha256) for r in recorded]
