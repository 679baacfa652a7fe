"""The plan directory `hetc compile` writes and `hetc verify` / `run` / `viz` read.

    DIR/plan.het                 the explicit spec (self-contained: devices inline)
    DIR/programs/rank-NNNN.txt   each rank's listing; rank-NNNN.json beside it
    DIR/groups.txt               the group table
    DIR/timeline.json            the predicted timeline of one step
    DIR/torch/laneL.csv          lane-aligned pipelines in torch's compute_comms format
    DIR/summary.json             headline numbers (ranks, step time, tokens/s)
    DIR/profiles.json            the profiles the prediction used, with their sha256 (Note [recorded profiles]
                                 in hetc/commands/profileargs.py)
    DIR/.hetc-output.json        hetc's marker: the sha256 of every file above (Note [output directories]
                                 in hetc/outdir.py: only such a directory is ever replaced)

Listings are the source of truth: a person may edit them by hand and
`hetc verify DIR` / `hetc run DIR` read the text, not the JSON. plan.het may
be edited too (a smaller device, another learning rate); the verifier checks
the programs against it (Note [transfers against the plan] in
passes/verify/transfers.py), so a plan the programs no longer fit is refused
before any rank starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hetc.errors import Span, SpecError
from hetc.frontend.printer import format_spec
from hetc.jsontypes import JsonObject
from hetc.outdir import Legacy, OutputKind, Protected, check_output_dir, write_output_dir
from hetc.program import Program, ProgramFormatError, RankProgram
from hetc.spec import DataKind, DataSpec, Spec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from hetc.frontend.load import LoadedSpec
    from hetc.passes.cost.provenance import UnusedProfile
    from hetc.passes.validate import ExplicitPlan

__all__ = ["LEGACY_PLAN", "PLAN_FILE", "PROFILES_FILE", "PROFILE_ENV", "TIMELINE_FILE", "RecordedProfile", "check_plan_out",
           "fingerprint", "listing_name", "profile_paths", "read_plan", "read_program", "record_profiles", "write_plan_dir"]

PLAN_FILE = "plan.het"
TIMELINE_FILE = "timeline.json"
SUMMARY_FILE = "summary.json"
PROFILES_FILE = "profiles.json"
PROFILE_ENV = "HETC_PROFILES"   # os.pathsep-separated profile files / data folders used by default


def listing_name(rank: int) -> str:
    return f"rank-{rank:04d}.txt"


def portable_spec(spec: Spec, spec_dir: Path, out_dir: Path) -> Spec:
    """The spec with its data paths (training and eval) and its model's hf directory rewritten relative to
    the plan directory."""

    def moved(data: DataSpec, path: str) -> str:
        if not path or os.path.isabs(path):
            return path
        return os.path.relpath(data.resolve(spec_dir, path).resolve(), out_dir.resolve())

    def portable(data: DataSpec) -> DataSpec:
        if data.kind is DataKind.SYNTHETIC:
            return data
        return dataclasses.replace(data, path=moved(data, data.path), tokenizer=moved(data, data.tokenizer))
    model = spec.model
    hf_dir = None if model is None else model.hf_dir(spec_dir)
    if model is not None and hf_dir is not None and not os.path.isabs(model.hf):
        hf = os.path.relpath(hf_dir.resolve(), out_dir.resolve())
        spec = dataclasses.replace(spec, model=dataclasses.replace(model, hf=hf))
    if spec.train is None:   # no job, no data paths
        return spec
    evaluation = spec.train.eval
    train = dataclasses.replace(spec.train, data=portable(spec.train.data),
                                eval=None if evaluation is None else portable(evaluation))
    return dataclasses.replace(spec, train=train)


# What `hetc compile` wrote before plan directories carried a marker (Note [output directories]).
LEGACY_PLAN = Legacy(patterns=(PLAN_FILE, "groups.txt", TIMELINE_FILE, SUMMARY_FILE, PROFILES_FILE,
                               "programs/rank-*.txt", "programs/rank-*.json", "torch/*.csv"),
                     required=(PLAN_FILE, "programs/rank-*.txt"))


def check_plan_out(out: Path, spec_dir: Path) -> None:
    """Raise UsageError unless `out` may become the plan directory of a spec in `spec_dir` (Note [output
    directories] in hetc/outdir.py): never the spec's folder or one above it."""
    check_output_dir(out, OutputKind.PLAN, _guards(spec_dir), LEGACY_PLAN)


def _guards(spec_dir: Path) -> list[Protected]:
    return [Protected(spec_dir, "the spec's folder")]


def write_plan_dir(out: Path, spec: Spec, spec_dir: Path, program: Program, torch_csv: dict[str, str],
                   timeline_json: str | None, summary: JsonObject,
                   profiles: JsonObject | None = None) -> None:
    """Write everything at once into a fresh directory that then replaces `out` (never half a plan), where
    hetc may replace `out` (`check_plan_out`); the marker records every file's sha256."""

    def fill(tmp: Path) -> None:
        (tmp / PLAN_FILE).write_text(format_spec(portable_spec(spec, spec_dir, out)))
        progs = tmp / "programs"
        progs.mkdir()
        for rp in program.ranks:
            (progs / listing_name(rp.rank)).write_text(rp.to_text())
            (progs / listing_name(rp.rank).replace(".txt", ".json")).write_text(json.dumps(rp.to_json()))
        (tmp / "groups.txt").write_text(program.groups_text())
        if torch_csv:
            (tmp / "torch").mkdir()
            for name, text in torch_csv.items():
                (tmp / "torch" / f"{name}.csv").write_text(text)
        if timeline_json is not None:
            (tmp / TIMELINE_FILE).write_text(timeline_json)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        if profiles is not None:
            (tmp / PROFILES_FILE).write_text(json.dumps(profiles, indent=2) + "\n")

    write_output_dir(out, OutputKind.PLAN, fill, _guards(spec_dir), LEGACY_PLAN)


def read_program(plan_dir: Path) -> Program:
    """The listings `programs/rank-*.txt` in rank order, with the group table."""
    listings = sorted((plan_dir / "programs").glob("rank-*.txt"))
    if not listings:
        raise FileNotFoundError(f"{plan_dir}: no programs/rank-*.txt (is it a `hetc compile` directory?)")
    ranks = sorted((RankProgram.from_text(p.read_text(), source=str(p)) for p in listings), key=lambda r: r.rank)
    for expect, rp in enumerate(ranks):
        if rp.rank != expect:
            raise ProgramFormatError(f"expected the program of rank {expect}, found rank {rp.rank}", 1,
                                     str(plan_dir / "programs" / listing_name(expect)))
    groups_file = plan_dir / "groups.txt"
    groups = Program.parse_groups(groups_file.read_text(), str(groups_file)) if groups_file.is_file() else ()
    return Program(tuple(ranks), groups)


def read_plan(plan_dir: Path) -> tuple[LoadedSpec, ExplicitPlan]:
    """(LoadedSpec, ExplicitPlan) of DIR/plan.het; a SpecError if it is missing, broken or not explicit."""
    from hetc.compiler import load_checked

    path = plan_dir / PLAN_FILE
    if not path.is_file():
        raise SpecError.at(Span.file_start(path), f"{plan_dir} is not a plan directory: no {PLAN_FILE} "
                           "(write one with `hetc compile SPEC -o DIR`)")
    loaded, checked = load_checked(path, require_complete=True)
    plan = checked.explicit()
    if plan is None:   # `hetc compile` writes an explicit plan; this one was edited
        where = loaded.spec.span if loaded.spec.parallel is None else loaded.spec.parallel.span
        raise SpecError.at(where, "the plan still has `auto` in it; a plan directory holds an explicit plan "
                           "(write one with `hetc compile SPEC -o DIR`)")
    return loaded, plan


def profile_paths(paths: list[str]) -> list[str]:
    """$HETC_PROFILES's entries, then `paths` (the command line's)."""
    env = [x for x in os.environ.get(PROFILE_ENV, "").split(os.pathsep) if x]
    return env + list(paths)


def fingerprint(path: Path) -> str | None:
    """sha256 of a file, or of a folder's relative file names and contents; None when it is gone."""
    digest = hashlib.sha256()
    if path.is_file():
        digest.update(path.read_bytes())
    elif path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes() + b"\0")
    else:
        return None
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class RecordedProfile:
    path: str      # absolute, as the prediction read it
    sha256: str


def record_profiles(paths: list[str], unused: Iterable[UnusedProfile]) -> JsonObject:
    """DIR/profiles.json's content (Note [recorded profiles]); `unused` is Provenance.unused."""
    used = [RecordedProfile(str(Path(p).resolve()), fingerprint(Path(p)) or "") for p in profile_paths(paths)]
    return {"profiles": [{"path": r.path, "sha256": r.sha256} for r in used],
            "unused_profiles": [{"profile": u.profile, "reason": u.reason} for u in unused]}
