"""Read a spec file and its `use` imports into one Spec.

Imports are resolved relative to the importing file, then in the bundled
specs/ folder (so `use "catalog.het"` works from anywhere). A file imported
twice along different paths is read once; a cycle is a located error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetc import syntax as ast
from hetc.convert import to_spec
from hetc.errors import Diagnostic, Sources, Span, SpecError
from hetc.spec import Spec

__all__ = ["BUNDLED_SPECS", "LoadedSpec", "load_spec", "parse_file"]

BUNDLED_SPECS = Path(__file__).resolve().parent.parent / "specs"
MAX_FILE_BYTES = 16 << 20


@dataclass
class LoadedSpec:
    spec: Spec
    path: Path
    sources: Sources
    files: list[Path] = field(default_factory=list)


def parse_file(path: Path, sources: Sources, at: Span | None = None) -> ast.File:
    """Parse one file; unreadable or non-UTF-8 input is a located error."""
    where = at or Span(str(path), 1, 1, 1, 1)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SpecError.at(where, f"'{path}' is larger than {MAX_FILE_BYTES >> 20} MiB")
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecError.at(where, f"cannot find '{path}'") from None
    except IsADirectoryError:
        raise SpecError.at(where, f"'{path}' is a directory, not a spec file") from None
    except OSError as err:
        raise SpecError.at(where, f"cannot read '{path}': {err.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        sources.add(str(path), data.decode("utf-8", errors="replace"))
        raise SpecError.at(Span(str(path), line, col, line, col + 1),
                           "the file is not UTF-8 text") from None
    if "\x00" in text:
        at = text.index("\x00")
        line, col = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
        raise SpecError.at(Span(str(path), line, col, line, col + 1), "the file contains a NUL byte")
    sources.add(str(path), text)
    return ast.parse_text(text, str(path))


def _resolve(use: ast.Use, importer: Path) -> Path:
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

    def collect(self, path: Path, stack: tuple[Path, ...], at: Span | None) -> list:
        key = path.resolve()
        if key in stack:
            chain = " -> ".join(p.name for p in (*stack[stack.index(key):], key))
            self.errors.append(Diagnostic(at, f"import cycle: {chain}"))
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
        items: list = []
        for item in tree.items:
            if isinstance(item, ast.Use):
                items += self.collect(_resolve(item, path), (*stack, key), item.span)
        return items + [i for i in tree.items if not isinstance(i, ast.Use)]


def load_spec(path: str | Path) -> LoadedSpec:
    """Parse, import and convert; raise one SpecError with every problem found."""
    path = Path(path)
    sources = Sources()
    collector = _Collector(sources)
    items = collector.collect(path, (), None)
    if collector.errors:
        raise SpecError(collector.errors)
    spec = to_spec(items, Span(str(path), 1, 1, 1, 1))
    return LoadedSpec(spec, path, sources, collector.files)
