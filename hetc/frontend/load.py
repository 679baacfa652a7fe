"""Read a spec file and its `use` imports into one Spec.

Imports are resolved relative to the importing file, then in the bundled
specs/ folder (so `use "catalog.het"` works from anywhere). A file imported
twice along different paths is read once; a cycle is a located error.
"""

from __future__ import annotations

import dataclasses
import stat
from dataclasses import dataclass, field
from pathlib import Path

from hetc.frontend import syntax
from hetc.frontend.convert import to_spec
from hetc.hf.files import model_files
from hetc.ir.outdir import PLAN_FILE
from hetc.ir.errors import MAX_SOURCE_BYTES, Diagnostic, Sources, Span, SpecError, did_you_mean
from hetc.ir.spec import ParallelSpec, Spec, declared_path
from hetc.ir.userfile import file_kind

__all__ = ["BUNDLED_SPECS", "LoadedSpec", "load_spec", "parse_file", "read_spec_bytes", "with_plan_to_fill"]

BUNDLED_SPECS = Path(__file__).resolve().parents[2] / "specs"
NEAR_MISS = 0.8     # spelling similarity (difflib's ratio) of a file name suggested for a missing one


@dataclass
class LoadedSpec:
    spec: Spec
    path: Path
    sources: Sources
    files: list[Path] = field(default_factory=list)

    def inputs(self) -> list[tuple[Path, str]]:
        """(path, what it is) of every file the spec reads (its own, its data's, its models'), which an
        output must not replace (Note [output files])."""
        found = [(self.path, "the spec")] + [(f, "a file the spec imports") for f in self.files if f != self.path]
        model, train = self.spec.model, self.spec.train
        if model is not None and (hf := model.hf_dir(self.path.parent)) is not None:
            found += [(p, "a file of the model's hf directory") for p in model_files(hf)]
        for data, what in ((train.data, "the training data"), (train.eval, "the validation data")) \
                if train is not None else ():
            for file in data.files() if data is not None else ():
                if file.path:
                    found += [(p, what) for p in _data_files(file.resolve(self.path.parent))]
                if file.tokenizer:
                    tokenizer = declared_path(file.tokenizer, file.span, self.path.parent)
                    found += [(p, "a file of the tokenizer directory") for p in model_files(tokenizer)]
        return found


def _data_files(path: Path) -> list[Path]:
    """A data `path` and the files read with it: a Megatron PREFIX's .bin and .idx, a raw file's sidecar."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    named = [path, prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")]
    return named + [p.with_name(p.name + ".json") for p in named]


def parse_file(path: Path, sources: Sources, at: Span | None = None) -> syntax.File:
    """Parse one file; unreadable, oversized or non-UTF-8 input is a located error."""
    data = read_spec_bytes(path, at or Span.file_start(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        sources.add(str(path), data.decode("utf-8", errors="replace"))
        raise SpecError.at(Span(str(path), line, col, line, col + 1),
                           "the file is not UTF-8 text") from None
    if "\x00" in text:
        nul = text.index("\x00")
        line, col = text.count("\n", 0, nul) + 1, nul - text.rfind("\n", 0, nul)
        raise SpecError.at(Span(str(path), line, col, line, col + 1), "the file contains a NUL byte")
    sources.add(str(path), text)
    return syntax.parse_text(text, str(path))


def read_spec_bytes(path: Path, where: Span) -> bytes:
    """The bytes of a regular file of at most MAX_SOURCE_BYTES, or a SpecError located at `where`.

    Note [untrusted paths]: `use "/dev/zero"` or a named pipe would block or
    stream for ever, so only regular files are opened, and a file that grows
    past the cap while being read is still read no further than the cap.
    The same holds for every other file a user names (a spec's data paths,
    a timeline, a metrics file, a profile, another system's JSON):
    hetc/ir/userfile.py.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise SpecError.at(where, f"cannot find '{path}'{_nearby_spec(path)}") from None
    except OSError as err:
        raise SpecError.at(where, f"cannot read '{path}': {err.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        plan = path / PLAN_FILE
        inside = f"; its plan is the spec '{plan}'" if plan.is_file() else ""
        raise SpecError.at(where, f"'{path}' is a directory, not a spec file{inside}")
    if not stat.S_ISREG(info.st_mode):
        raise SpecError.at(where, f"'{path}' is {file_kind(info.st_mode)}, not a regular file; "
                                  "a spec is read only from a regular file")
    too_big = SpecError.at(where, f"'{path}' is larger than {MAX_SOURCE_BYTES >> 20} MiB, the limit for a "
                                  "spec file")
    if info.st_size > MAX_SOURCE_BYTES:
        raise too_big
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
    except OSError as err:
        raise SpecError.at(where, f"cannot read '{path}': {err.strerror}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise too_big
    return data


def _nearby_spec(missing: Path) -> str:
    """' (did you mean 'catalog.het'?)': the closest spec file beside `missing` or among the bundled specs
    (where `use` looks next). Only a near miss: names in one folder share words (`_missing.het`), and a
    suggestion that merely shares them misleads."""
    import difflib

    names: set[str] = set()
    for folder in (missing.parent, BUNDLED_SPECS):
        try:
            names.update(p.name for p in folder.glob("*.het"))
        except OSError:
            continue
    near = {n for n in names if n != missing.name   # the same name: the folder is what is wrong
            and difflib.SequenceMatcher(None, missing.stem, Path(n).stem).ratio() >= NEAR_MISS}
    return did_you_mean(missing.name, near)


def _resolve(use: syntax.Use, importer: Path) -> Path:
    local = (importer.parent / use.path)
    if local.exists() or Path(use.path).is_absolute():
        return local
    bundled = BUNDLED_SPECS / use.path
    return bundled if bundled.exists() else local


class _Collector:
    def __init__(self, sources: Sources):
        self.sources = sources
        self.done: set[Path] = set()
        self.files: list[Path] = []
        self.errors: list[Diagnostic] = []

    def collect(self, path: Path, stack: tuple[Path, ...], at: Span | None) -> list[syntax.Item]:
        """The items of `path` after those of the files it uses; `at`: the `use` line (None: the root)."""
        key = path.resolve()
        if key in stack:
            chain = " -> ".join(p.name for p in (*stack[stack.index(key):], key))
            self.errors.append(Diagnostic(at or Span.file_start(path), f"import cycle: {chain}"))
            return []
        if key in self.done:
            return []
        self.done.add(key)
        try:
            tree = parse_file(path, self.sources, at)
        except SpecError as err:
            self.errors += err.diagnostics
            return []
        self.files.append(path)
        if not any(not isinstance(i, syntax.Comment) for i in tree.items):
            self.errors.append(Diagnostic(at or Span.file_start(path), f"'{path}' is empty: a spec file holds "
                                          "blocks (model, cluster, train, parallel, device) or `use` lines"))
            return []
        items: list[syntax.Item] = []
        for item in tree.items:
            if isinstance(item, syntax.Use):
                items += self.collect(_resolve(item, path), (*stack, key), item.span)
        return items + [i for i in tree.items if not isinstance(i, syntax.Use)]


def with_plan_to_fill(loaded: LoadedSpec) -> LoadedSpec:
    """`loaded`, planned as `parallel {}` (every choice `auto`) when it has a model, a cluster and a training
    job but no parallel block.

    `hetc check` accepts such a spec (a job meant to be imported, or planned), so `hetc plan` and
    `hetc compile` plan it rather than refuse it: writing the plan is their job. The block is located at
    the file's start, where `hetc plan` appends the plan it chose (passes/plan/output.py).
    """
    spec = loaded.spec
    if spec.parallel is not None or spec.model is None or spec.cluster is None or spec.train is None:
        return loaded
    return dataclasses.replace(loaded, spec=dataclasses.replace(spec, parallel=ParallelSpec(
        span=Span.file_start(loaded.path))))


def load_spec(path: str | Path) -> LoadedSpec:
    """Parse, import and convert; raise one SpecError with every problem found."""
    path = Path(path)
    collector = _Collector(Sources())
    items = collector.collect(path, (), None)
    if collector.errors:
        raise SpecError(collector.errors)
    return LoadedSpec(to_spec(items, Span.file_start(path)), path, collector.sources, collector.files)
