"""The plan directory `hetc compile` writes and `hetc verify` / `run` / `viz` read.

    DIR/plan.het                 the explicit spec (self-contained: devices inline)
    DIR/programs/rank-NNNN.txt   each rank's listing; rank-NNNN.json beside it
    DIR/programs/eval-rank-NNNN.txt  each rank's evaluation program, when the job evaluates
    DIR/groups.txt               the group table
    DIR/timeline.json            the predicted timeline of one step
    DIR/torch/laneL.csv          lane-aligned pipelines in torch's compute_comms format
    DIR/summary.json             headline numbers (ranks, step time, tokens/s)
    DIR/profiles.json            the profiles the prediction used, with their sha256 (Note [recorded profiles]
                                 in hetc/commands/profileargs.py)
    DIR/.hetc-output.json        hetc's marker: the sha256 of every file above (Note [output directories]
                                 in hetc/ir/outdir.py: only such a directory is ever replaced)

Listings are the source of truth: a person may edit them by hand and
`hetc verify DIR` / `hetc run DIR` read the text, not the JSON. plan.het may
be edited too (a smaller device, another learning rate); the verifier checks
the programs against it (Note [transfers against the plan] in
passes/verify/transfers.py). `hetc run` refuses files edited since they were
verified until `hetc verify DIR` passes (Note [verified once]). A rank of `hetc run` reads the
plan, the group table and its own listings only (Note [a rank reads its own]).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, overload

from hetc.ir.errors import Span, SpecError, UsageError
from hetc.frontend.printer import format_spec
from hetc.ir.jsontypes import JsonObject
from hetc.ir.outdir import PLAN_FILE, Legacy, OutputKind, Protected, check_output_dir, is_marked, restamp, unmarked_or_edited, write_output_dir
from hetc.ir.program import Group, Program, ProgramFormatError, RankProgram
from hetc.ir.spec import DataFileSpec, DataSpec, Spec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from hetc.frontend.load import LoadedSpec
    from hetc.passes.cost.provenance import UnusedProfile
    from hetc.ir.plan import Plan
    from hetc.passes.verify.machine import Backend

__all__ = ["LEGACY_PLAN", "PLAN_FILE", "PROFILES_FILE", "PROFILE_ENV", "TIMELINE_FILE", "Listings", "RecordedProfile",
           "check_plan_out", "eval_listing_name", "fingerprint", "listing_name", "open_program", "plan_files",
           "profile_paths", "read_eval_rank", "read_plan", "read_program", "record_profiles", "record_verified",
           "require_verified", "unverified_files", "verify_and_record", "write_plan_dir"]

TIMELINE_FILE = "timeline.json"
SUMMARY_FILE = "summary.json"
PROFILES_FILE = "profiles.json"
PROFILE_ENV = "HETC_PROFILES"   # os.pathsep-separated profile files / data folders used by default


def listing_name(rank: int) -> str:
    return f"rank-{rank:04d}.txt"


def eval_listing_name(rank: int) -> str:
    """A rank's evaluation program (Note [Evaluation programs] in passes/lower/forward_only.py)."""
    return f"eval-rank-{rank:04d}.txt"


# Note [verified once]
# `hetc compile` verifies every program (and the evaluation programs it writes beside them) and records
# each file's sha256 in the directory's marker (hetc/ir/outdir.py). A rank of `hetc run` therefore neither
# verifies nor lowers: it checks that the files it reads — plan.het, groups.txt, its own listing and its
# own evaluation listing — are still the ones recorded (`unverified_files`), a few hashes instead of a
# verification of the whole job on each of thousands of ranks. A file edited since is refused with the
# command that checks it: `hetc verify DIR` verifies the whole directory and, when it passes, records
# the files as they now are. A plan directory from before markers has no record: its ranks verify, as
# they always did.
def plan_files(plan_dir: Path, ranks: Iterable[int]) -> list[str]:
    """The files ranks `ranks` read from `plan_dir`: the plan, the groups, their listings (and evaluation
    listings, where compile wrote them)."""
    files = [PLAN_FILE, "groups.txt"]
    for rank in ranks:
        files.append(f"programs/{listing_name(rank)}")
        if (plan_dir / "programs" / eval_listing_name(rank)).is_file():
            files.append(f"programs/{eval_listing_name(rank)}")
    return files


def unverified_files(plan_dir: Path, ranks: Iterable[int]) -> list[str] | None:
    """The files of `ranks` changed since they were verified (Note [verified once]); None for a plan
    directory that records nothing (its programs must be verified before they run)."""
    return unmarked_or_edited(plan_dir, plan_files(plan_dir, ranks))


def require_verified(plan_dir: Path, ranks: Iterable[int], program: Program, plan: Plan) -> None:
    """Refuse to run files of `ranks` edited since they were verified; verify the programs of a directory
    that records nothing (Note [verified once])."""
    changed = unverified_files(plan_dir, ranks)
    if changed is None:
        from hetc.passes.verify import verify    # the passes: only for plan directories from before markers

        verify(program, plan)
    elif changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise UsageError(f"{plan_dir}: {', '.join(changed[:3])}{more} changed since `hetc compile` verified "
                         f"{'them' if len(changed) > 1 else 'it'}; run `hetc verify {plan_dir}` to check the "
                         "edits (it records them as verified when they pass)")


def verify_and_record(plan_dir: Path, program: Program, plan: Plan, backend: Backend | None = None) -> bool:
    """Verify `program` and the evaluation programs derived from it under `backend`'s rules (default: the
    plan's), raising VerifyError; when they pass under the plan's own rules, record them (`record_verified`).
    Whether anything was recorded."""
    from hetc.passes.cost import CostModel
    from hetc.passes.verify import plan_backend, verified_evaluation, verify

    own = plan_backend(plan.pipeline)
    backend = backend or own
    verify(program, plan, CostModel(plan), backend=backend)
    evaluation = verified_evaluation(program, plan, backend)
    return backend == own and record_verified(plan_dir, program, evaluation)


def record_verified(plan_dir: Path, program: Program, evaluation: Program | None) -> bool:
    """After `hetc verify DIR` passed: write the evaluation programs derived from the listings as they are
    now, and record every file the ranks read as verified; False (nothing written) for a directory without
    a marker (Note [verified once])."""
    if not is_marked(plan_dir):
        return False
    for rp in evaluation.ranks if evaluation is not None else ():
        (plan_dir / "programs" / eval_listing_name(rp.rank)).write_text(rp.to_text())
    return restamp(plan_dir, plan_files(plan_dir, range(program.world_size)))


def read_eval_rank(plan_dir: Path, rank: int) -> RankProgram | None:
    """Rank `rank`'s evaluation program as compile wrote it; None where it did not (no evaluation, or a plan
    directory from before compile wrote them)."""
    path = plan_dir / "programs" / eval_listing_name(rank)
    return RankProgram.from_text(_listing_text(path), source=str(path)) if path.is_file() else None


F = TypeVar("F", bound=DataFileSpec)


def portable_spec(spec: Spec, spec_dir: Path, out_dir: Path) -> Spec:
    """The spec with its data paths (training and eval) and its model's hf directory rewritten relative to
    the plan directory."""

    def moved(data: DataFileSpec, path: str) -> str:
        if not path or os.path.isabs(path):
            return path
        return os.path.relpath(data.resolve(spec_dir, path).resolve(), out_dir.resolve())

    def portable_file(data: F) -> F:
        return dataclasses.replace(data, path=moved(data, data.path), tokenizer=moved(data, data.tokenizer))

    def portable(data: DataSpec) -> DataSpec:     # a path left empty (synthetic, a blend's own) stays empty
        return dataclasses.replace(portable_file(data), sources=tuple(portable_file(s) for s in data.sources))
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
    directories] in hetc/ir/outdir.py): never the spec's folder or one above it."""
    check_output_dir(out, OutputKind.PLAN, _guards(spec_dir), LEGACY_PLAN)


def _guards(spec_dir: Path) -> list[Protected]:
    return [Protected(spec_dir, "the spec's folder")]


def write_plan_dir(out: Path, spec: Spec, spec_dir: Path, program: Program, torch_csv: dict[str, str],
                   timeline_json: str | None, summary: JsonObject,
                   profiles: JsonObject | None = None, evaluation: Program | None = None) -> None:
    """Write everything at once into a fresh directory that then replaces `out` (never half a plan), where
    hetc may replace `out` (`check_plan_out`); the marker records every file's sha256."""

    def fill(tmp: Path) -> None:
        (tmp / PLAN_FILE).write_text(format_spec(portable_spec(spec, spec_dir, out)))
        progs = tmp / "programs"
        progs.mkdir()
        for rp in program.ranks:
            (progs / listing_name(rp.rank)).write_text(rp.to_text())
            (progs / listing_name(rp.rank).replace(".txt", ".json")).write_text(json.dumps(rp.to_json()))
        for rp in evaluation.ranks if evaluation is not None else ():
            (progs / eval_listing_name(rp.rank)).write_text(rp.to_text())
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
    ranks = sorted((RankProgram.from_text(_listing_text(p), source=str(p)) for p in listings), key=lambda r: r.rank)
    for expect, rp in enumerate(ranks):
        if rp.rank != expect:
            raise ProgramFormatError(f"expected the program of rank {expect}, found rank {rp.rank}", 1,
                                     str(plan_dir / "programs" / listing_name(expect)))
    return Program(tuple(ranks), _read_groups(plan_dir))


# Note [a rank reads its own]
# At 16,384 ranks the plan directory holds 12,288 listings of 40 instructions or more each; a rank that
# read them all to run its own read the whole job, thousands of times over across the cluster. A rank of
# `hetc run` opens the programs instead (`open_program`): the plan's world size, the group table (every
# rank creates every process group, in one order: torch.distributed's new_group is collective over the
# default group), and listings read and parsed the first time something asks for that rank — its own at
# start; the others only where rank 0 builds a measured trace of every rank. Together with the hashes of
# Note [verified once] a rank's start-up reads plan.het, groups.txt, the marker and its own listings.
class Listings(Sequence[RankProgram]):
    """The listings of a plan directory's `world` ranks, each read when it is first asked for."""

    def __init__(self, plan_dir: Path, world: int):
        self._dir, self._world = plan_dir / "programs", world
        self._read: dict[int, RankProgram] = {}

    def __len__(self) -> int:
        return self._world

    @overload
    def __getitem__(self, index: int) -> RankProgram: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RankProgram]: ...

    def __getitem__(self, index: int | slice) -> RankProgram | Sequence[RankProgram]:
        if isinstance(index, slice):
            return [self[i] for i in range(self._world)[index]]
        rank = range(self._world)[index]    # an IndexError past the world, as a tuple's
        if rank not in self._read:
            self._read[rank] = self._listing(rank)
        return self._read[rank]

    def _listing(self, rank: int) -> RankProgram:
        path = self._dir / listing_name(rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the plan has {self._world} ranks but rank {rank} has no listing "
                                    "(is it a `hetc compile` directory?)")
        rp = RankProgram.from_text(_listing_text(path), source=str(path))
        if rp.rank != rank:
            raise ProgramFormatError(f"expected the program of rank {rank}, found rank {rp.rank}", 1, str(path))
        return rp


def open_program(plan_dir: Path, world: int) -> Program:
    """The plan directory's programs for a rank that runs one of them: the group table now, each listing
    when asked for (Note [a rank reads its own])."""
    return Program(Listings(plan_dir, world), _read_groups(plan_dir))


def _read_groups(plan_dir: Path) -> tuple[Group, ...]:
    groups_file = plan_dir / "groups.txt"
    return Program.parse_groups(_listing_text(groups_file), str(groups_file)) if groups_file.is_file() else ()


def _listing_text(path: Path) -> str:
    """A listing's or the group table's text; bytes that are not UTF-8 are a ProgramFormatError at their line
    (the files are edited by hand, Note [verified once])."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProgramFormatError("the file is not UTF-8 text", data[:err.start].count(b"\n") + 1, str(path)) from None


def read_plan(plan_dir: Path) -> tuple[LoadedSpec, Plan]:
    """(LoadedSpec, Plan) of DIR/plan.het; a SpecError if it is missing, broken or not explicit."""
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
