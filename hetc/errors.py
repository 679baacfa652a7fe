"""Source spans and the user-facing error type.

Every user error carries a `Span`; `render` prints it the way compilers do:
`FILE:LINE:COL: error: message`, the source line, and a caret under the
offending text.  Internal invariant violations are plain `AssertionError`s
(or `InternalError`) and are never shown to a user as if they were theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "NO_SPAN",
    "Diagnostic",
    "InternalError",
    "Sources",
    "Span",
    "SpecError",
    "did_you_mean",
]


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """A half-open region of one source file; lines and columns count from 1."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


NO_SPAN = Span("<generated>", 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One located message. `notes` are extra located lines ("defined here")."""

    span: Span
    message: str
    severity: str = "error"
    notes: tuple[tuple[Span, str], ...] = ()

    def render(self, sources: Sources) -> str:
        lines = [self._one(self.span, self.severity, self.message, sources)]
        lines += [self._one(span, "note", msg, sources) for span, msg in self.notes]
        return "\n".join(lines)

    @staticmethod
    def _one(span: Span, severity: str, message: str, sources: Sources) -> str:
        head = f"{span}: {severity}: {message}"
        text = sources.line(span.file, span.line)
        if text is None:
            return head
        width = 1
        if span.end_line == span.line and span.end_col > span.col:
            width = span.end_col - span.col
        caret = " " * (span.col - 1) + "^" + "~" * (width - 1)
        return f"{head}\n    {text}\n    {caret}"


class SpecError(Exception):
    """One or more user errors in spec files; the CLI prints them and exits 2."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = sorted(diagnostics, key=lambda d: d.span)
        super().__init__("\n".join(f"{d.span}: {d.severity}: {d.message}" for d in self.diagnostics))

    @classmethod
    def at(cls, span: Span, message: str) -> SpecError:
        return cls(Diagnostic(span, message))


class InternalError(AssertionError):
    """A broken invariant inside hetc (a bug), never the user's fault."""


@dataclass
class Sources:
    """Source text of every file read, so diagnostics can quote lines."""

    texts: dict[str, list[str]] = field(default_factory=dict)

    def add(self, path: str, text: str) -> None:
        self.texts[path] = _lines(text)

    def line(self, path: str, line: int) -> str | None:
        lines = self.texts.get(path)
        if lines is None and Path(path).is_file():
            try:
                lines = _lines(Path(path).read_text(errors="replace"))
            except OSError:
                return None
            self.texts[path] = lines
        if not lines or not 1 <= line <= len(lines):
            return None
        return lines[line - 1].expandtabs(1)


def _lines(text: str) -> list[str]:
    """Lines as the parser counts them: split at "\n" only (not at \f or \u2028)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def did_you_mean(word: str, choices: list[str] | tuple[str, ...] | set[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when none is close.

    A word that starts a few choices (`A100` of `A100-40`, `A100-80`) names
    them all; otherwise the closest spelling wins, then a case-insensitive match.
    """
    import difflib

    low = word.lower()
    started = sorted(c for c in choices if c.lower().startswith(low) and c != word) if len(word) >= 2 else []
    if 1 <= len(started) <= 3:
        return " (did you mean " + " or ".join(f"'{c}'" for c in started) + "?)"
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        if low in lowered:
            close = [lowered[low]]
    return f" (did you mean '{close[0]}'?)" if close else ""
