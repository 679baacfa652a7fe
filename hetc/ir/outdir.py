"""Directories hetc writes as a whole, and the one rule for replacing them (Note [output directories]).

Note [output directories]: `hetc compile -o DIR`, `hetc export hf -o DIR`
and `hetc demo -o OUT` each write a directory as one output: built in a
temporary sibling, then renamed into place, so a reader never sees half of
one. Replacing DIR deletes what it held, so hetc replaces only what it wrote
itself. Every such directory carries a marker, `.hetc-output.json`: the
kind of output and the sha256 of every file hetc wrote there. An existing DIR
is replaced only when

- it is not the current directory, the home directory or a folder that
  holds one of them, nor a folder the command protects (compile: the spec's
  folder and every folder above it) — `-o .` is never a place for an output;
- it is a directory (a regular file is refused), and either empty, or it
  carries the marker of the same kind and holds no file the marker does not
  list (a subdirectory with a marker of its own that the marker lists, such
  as the demo's plan/, answers for itself). A file hetc wrote and a person edited since (a
  listing) is hetc's output and is replaced; a file hetc did not write is
  never deleted;
- or it holds nothing but what a hetc from before the marker wrote as that
  output (`Legacy`: a plan directory's plan.het, programs/rank-*,
  groups.txt, ...; the demo's): scripts that recompile into the same folder,
  and `make demo`, keep working after an upgrade, and those layouts have no
  room for a user's file.

Anything else is a UsageError naming DIR and what hetc did not write there
(exit 2), with every file left in place. The hashes also let `hetc verify`
say which files changed since they were written (`edited_files`).

Note [output files]: a one-file output (`-o FILE`, `--trace`, `--metrics`,
`--chrome-trace`) replaces what is at its path, as any tool's `-o` does,
except where that would lose what the user did not mean to
(`check_output_file`): a directory; a file the same command reads (`hetc
plan spec.het -o spec.het` would put the filled plan over the spec and its
`auto`s, `-o job.het` over the job the spec imports, or over its data or
its `hf` model's files; a measured trace over its metrics); and a file of a directory
hetc wrote as one output that other commands read back (a plan directory's
timeline.json or summary.json: the directory would no longer load; the
demo's folder, read by people, takes its run's metrics and trace). A page
`hetc viz DIR` writes by default, DIR/schedule.html, is the plan kind's
`derived` file: drawn from what DIR holds, it goes with DIR when compile
replaces it.
A one-file output's missing folders are made, as compile makes a plan
directory's (`make_directory`), before the command's work: a file where one
of them would go is a usage error then, not an internal error after the
work (or, for `run --metrics`, every rank's exit once the model was built).
`-` names standard output, as for Unix tools: the verbs that print their
output without `-o` (plan, launch --emit, import) read `-o -` so
(`argtypes.file_or_stdout`); for an output that only goes to a file it is
a usage error, not a file named '-'.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from hetc.ir.errors import UsageError

PLAN_FILE = "plan.het"   # a plan directory's spec: the plan it was compiled from, written out explicit

__all__ = ["MARKER", "STDOUT", "Legacy", "OutputKind", "Protected", "check_output_dir", "check_output_file", "edited_files",
           "file_hashes", "is_marked", "make_directory", "restamp", "unmarked_or_edited", "write_marker", "write_output_dir"]

STDOUT = "-"    # an output path that names standard output (Note [output files])

MARKER = ".hetc-output.json"
MAX_NAMED = 5       # foreign entries a message names before "and N more"



class OutputKind(StrEnum):
    """What a marked directory holds; a directory of one kind is never replaced by another."""

    PLAN = "plan"
    HF_EXPORT = "hf-export"
    DEMO = "demo"

    @property
    def noun(self) -> str:
        return {"plan": "a plan directory", "hf-export": "a Hugging Face export", "demo": "the demo's outputs"}[
            self.value]

    @property
    def read_back(self) -> bool:
        """Whether other commands read such a directory (run a plan, load an export): its files are kept
        whole. The demo's outputs are read by people; a run of its plan writes its metrics there."""
        return self is not OutputKind.DEMO

    @property
    def derived(self) -> tuple[str, ...]:
        """Files another verb writes into such a directory by default, from what it holds, and that go with
        it: `hetc viz DIR`'s page."""
        return ("schedule.html",) if self is OutputKind.PLAN else ()


@dataclass(frozen=True, slots=True)
class Protected:
    """A folder an output must never replace, nor any folder above it; `what` names it in the error."""

    path: Path
    what: str


@dataclass(frozen=True, slots=True)
class Legacy:
    """What a hetc from before the marker wrote as one kind of output, as fnmatch patterns of relative
    paths: an unmarked directory all of whose files match `patterns`, with a match for every one of
    `required`, is taken for such an output."""

    patterns: tuple[str, ...]
    required: tuple[str, ...]

    def matches(self, files: list[str]) -> bool:
        return all(fnmatch.filter(files, r) for r in self.required)

    def foreign(self, files: list[str]) -> list[str]:
        return [f for f in files if not any(fnmatch.fnmatchcase(f, p) for p in self.patterns)]


def check_output_dir(out: Path, kind: OutputKind, protect: Iterable[Protected] = (),
                     legacy: Legacy | None = None) -> None:
    """Raise UsageError unless `out` may be (re)written as `kind` (Note [output directories]); `legacy`:
    what an older hetc wrote as `kind`, replaced too."""
    target = out.resolve()
    for guard in _always_protected() + list(protect):
        if guard.path.resolve().is_relative_to(target):
            held = "is" if guard.path.resolve() == target else "holds"
            raise UsageError(f"refusing to write {kind.noun} to '{out}': it {held} {guard.what}, and the output "
                             "replaces the whole directory; choose a new directory")
    if not target.exists():
        _refuse_a_file_in_the_way(target.parent, f"'{out}'")
        return
    if not target.is_dir():
        raise UsageError(f"'{out}' is a file; {kind.noun} is a directory: choose another path")
    marked = _read_marker(target)
    if marked is not None and marked[0] != kind.value:
        other = OutputKind(marked[0]).noun if marked[0] in set(OutputKind) else f"a '{marked[0]}' output"
        raise UsageError(f"refusing to replace '{out}': it holds {other}, not {kind.noun}; choose another directory")
    foreign = _foreign_entries(target, kind, legacy)
    if foreign:
        raise UsageError(f"refusing to replace '{out}': it holds {_named(foreign)}, which hetc did not write "
                         f"(hetc replaces only an empty directory or {kind.noun} it wrote); "
                         "choose another directory, or move those files yourself")


def write_output_dir(out: Path, kind: OutputKind, fill: Callable[[Path], None],
                     protect: Iterable[Protected] = (), legacy: Legacy | None = None) -> None:
    """Check `out`, let `fill` write into a fresh sibling, mark it, then put it in `out`'s place at once."""
    protect = list(protect)
    check_output_dir(out, kind, protect, legacy)
    target = out.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(tmp)
        write_marker(tmp, kind)
        _follow_umask(tmp)
        check_output_dir(out, kind, protect, legacy)   # again: something may have appeared while `fill` ran
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output_file(out: Path, flag: str, reads: Iterable[tuple[Path, str]] = ()) -> None:
    """Raise UsageError unless the one-file output `out` (given as `flag`) may be written (Note [output
    files]); `reads`: (path, what it is) of each file the command reads."""
    if str(out) == STDOUT:     # the verbs that can print their output read `-o -` as stdout before this
        raise UsageError(f"{flag} '-': this output goes to a file, not to standard output; name a file")
    target = out.resolve()
    if target.is_dir():
        raise UsageError(f"{flag} '{out}' is a directory; name a file")
    for path, what in reads:
        if path.resolve() == target:
            raise UsageError(f"{flag} '{out}' is {what}, which this command reads; writing there would replace "
                             "it: choose another path")
    for folder in target.parents:
        marked = _read_marker(folder)
        if marked is None or marked[0] not in set(OutputKind) or not OutputKind(marked[0]).read_back:
            continue
        if target.relative_to(folder).as_posix() in marked[1]:
            raise UsageError(f"{flag} '{out}' is a file of {OutputKind(marked[0]).noun} hetc wrote ('{folder}'); "
                             "replacing it would break that directory: choose a path outside it")
    make_directory(target.parent, flag, out)


def make_directory(directory: Path, flag: str, given: Path | None = None) -> None:
    """Create `directory` (what `flag` names, or where the file `given` goes) and its parents, as `hetc compile
    -o a/b/plan` does; UsageError where a file stands in the way or it cannot be made. Commands check before
    their work: a missing folder must not end a run at its first write, in a rank."""
    named = f"{flag} '{directory if given is None else given}'"
    _refuse_a_file_in_the_way(directory, named)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{named}: cannot create the directory '{directory}': {err.strerror}") from None


def _refuse_a_file_in_the_way(folder: Path, named: str) -> None:
    """UsageError where `folder`, or a folder above it, exists as a file (`named`: the output, as its flag
    names it)."""
    blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UsageError(f"{named}: '{blocking}' is a file, not a directory; choose another path")


def write_marker(directory: Path, kind: OutputKind, planned: Iterable[str] = ()) -> None:
    """Mark `directory` as `kind`, with the sha256 of every file in it, and null for each nested marked
    directory ('plan/': it answers for itself) and for the names in `planned`, still to be written
    (`hetc demo`)."""
    files: dict[str, str | None] = {name: None for name in planned}
    files.update((sub.relative_to(directory).as_posix() + "/", None) for sub in _marked_subdirectories(directory))
    files.update(file_hashes(directory))
    (directory / MARKER).write_text(json.dumps({"kind": kind.value, "files": files}, indent=1) + "\n")


def file_hashes(directory: Path) -> dict[str, str]:
    """Relative POSIX path -> sha256 of each file under `directory`, outside any nested marked directory."""
    return {rel: _sha256(directory / rel) for rel in _files(directory) if not rel.endswith("/")}


def unmarked_or_edited(directory: Path, names: Iterable[str]) -> list[str] | None:
    """Which of `names` (relative paths) hetc did not write as they are now: edited, gone, or never listed
    by the marker; None when `directory` carries no marker (a plan from before markers)."""
    marked = _read_marker(directory)
    if marked is None:
        return None
    _, files = marked
    return [rel for rel in names if (digest := files.get(rel)) is None or not (directory / rel).is_file()
            or _sha256(directory / rel) != digest]


def is_marked(directory: Path) -> bool:
    """Whether `directory` carries a marker hetc can read."""
    return _read_marker(directory) is not None


def restamp(directory: Path, names: Iterable[str]) -> bool:
    """Record the present contents of `names` (relative paths of files hetc owns there) in `directory`'s
    marker, leaving its other entries as they are; False (nothing written) when it carries none."""
    marked = _read_marker(directory)
    if marked is None:
        return False
    kind, files = marked
    files.update((rel, _sha256(directory / rel)) for rel in names if (directory / rel).is_file())
    (directory / MARKER).write_text(json.dumps({"kind": kind, "files": files}, indent=1) + "\n")
    return True


def edited_files(directory: Path) -> list[str]:
    """The files hetc wrote in `directory` whose contents changed (or that are gone) since; [] when unmarked."""
    marked = _read_marker(directory)
    if marked is None:
        return []
    _, files = marked
    return sorted(rel for rel, digest in files.items()
                  if digest is not None and (not (directory / rel).is_file() or _sha256(directory / rel) != digest))


def _swap_in(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`; an old `target` goes first into a fresh hidden sibling, deleted after."""
    if not target.exists():
        tmp.rename(target)
        return
    graveyard = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    target.rename(graveyard / target.name)
    tmp.rename(target)
    shutil.rmtree(graveyard, ignore_errors=True)


def _follow_umask(directory: Path) -> None:
    """Give `directory` and everything in it the modes a plain `mkdir` and `open` would have.

    mkdtemp makes the directory 0700 and some writers (safetensors) make their files 0600, which would
    keep an export or a plan directory from the rest of a team whose umask shares them.
    """
    umask = os.umask(0)      # the only portable way to read it; set back at once
    os.umask(umask)
    for root, dirs, names in os.walk(directory):
        for d in dirs:
            if not (Path(root) / d).is_symlink():
                os.chmod(Path(root) / d, 0o777 & ~umask)
        for n in names:
            path = Path(root) / n
            if not path.is_symlink():
                executable = path.stat().st_mode & 0o111
                os.chmod(path, (0o777 if executable else 0o666) & ~umask)
    os.chmod(directory, 0o777 & ~umask)


def _always_protected() -> list[Protected]:
    guards = [Protected(Path.cwd(), "the current directory")]
    try:
        guards.append(Protected(Path.home(), "your home directory"))
    except RuntimeError:   # no HOME and no passwd entry: nothing to guard
        pass
    return guards


def _foreign_entries(directory: Path, kind: OutputKind, legacy: Legacy | None = None) -> list[str]:
    """What in `directory` hetc did not write there as `kind`: paths in a directory hetc marked or an older
    hetc wrote (`legacy`), else each top-level entry."""
    marked = _read_marker(directory)
    if marked is None:
        every = _files(directory, skip_marked=False)
        return legacy.foreign(every) if legacy is not None and legacy.matches(every) else _top_level(every)
    _, files = marked
    foreign = [rel for rel in _files(directory) if rel not in files and rel not in kind.derived]
    for sub in _marked_subdirectories(directory):
        name = sub.relative_to(directory).as_posix() + "/"
        sub_kind = _read_marker(sub)
        assert sub_kind is not None
        if name not in files or sub_kind[0] not in set(OutputKind):   # another run's output, moved in here
            foreign.append(name)
        else:
            foreign += [name + rel for rel in _foreign_entries(sub, OutputKind(sub_kind[0]))]
    return sorted(foreign)


def _files(directory: Path, skip_marked: bool = True) -> list[str]:
    """Relative POSIX paths of every entry but a directory under `directory` (links, sockets and empty
    folders count: they too would be deleted), without the marker and, with `skip_marked`, without the
    nested marked directories."""
    out: list[str] = []
    for root, dirs, names in os.walk(directory):
        here = Path(root)
        links = [d for d in dirs if (here / d).is_symlink()]   # not followed: the link itself is the entry
        dirs[:] = [d for d in dirs if d not in links and not (skip_marked and (here / d / MARKER).is_file())]
        names = names + links
        rel = here.relative_to(directory)
        if not dirs and not names and here != directory:
            out.append(rel.as_posix() + "/")
        out += [(rel / n).as_posix() for n in names if not (here == directory and n == MARKER)]
    return sorted(out)


def _marked_subdirectories(directory: Path) -> list[Path]:
    found = []
    for root, dirs, _ in os.walk(directory):
        for d in list(dirs):
            if not (Path(root) / d).is_symlink() and (Path(root) / d / MARKER).is_file():
                found.append(Path(root) / d)
                dirs.remove(d)
    return found


def _read_marker(directory: Path) -> tuple[str, dict[str, str | None]] | None:
    """(kind, files) of `directory`'s marker; None when it has none or one hetc cannot read."""
    path = directory / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        kind, files = data["kind"], data["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(kind, str) or not isinstance(files, dict):
        return None
    return kind, files


def _top_level(paths: list[str]) -> list[str]:
    """'a/b/c' -> 'a/', once per top-level entry, in order."""
    return list(dict.fromkeys(head + sep for head, sep, _ in (p.partition("/") for p in paths)))


def _named(entries: list[str]) -> str:
    shown = ", ".join(entries[:MAX_NAMED])
    return shown if len(entries) <= MAX_NAMED else f"{shown} and {len(entries) - MAX_NAMED} more"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
