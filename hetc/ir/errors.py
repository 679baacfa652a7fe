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
    "MAX_SOURCE_BYTES",
    "NO_SPAN",
    "Diagnostic",
    "InternalError",
    "Sources",
    "Span",
    "SpecError",
    "UsageError",
    "clip_words",
    "did_you_mean",
]


# The largest spec file hetc reads (hetc.frontend.load) or quotes: real specs are a few kB.
MAX_SOURCE_BYTES = 4 << 20
# Note [quoting untrusted text]: a message quotes at most this many characters of
# one line of the source around the column, and of any one word of the user's
# text it echoes, so a 4 MB line or token still gets a message a person can read.
# A word may be a file's path, which must survive whole: 200 characters holds
# ordinary ones (a pytest tmp_path and a file in it is about 100).
QUOTE_WIDTH = 100
MAX_WORD = 200
MAX_MESSAGE = 1000


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

    @classmethod
    def file_start(cls, path: str | Path) -> Span:
        """The first character of file `path`: where a problem with the whole file is reported."""
        return cls(str(path), 1, 1, 1, 1)


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
        head = f"{span}: {severity}: {clip_words(message)}"
        text = sources.line(span.file, span.line)
        if text is None:
            return head
        width = 1
        if span.end_line == span.line and span.end_col > span.col:
            width = span.end_col - span.col
        shown, col = _window(text, span.col)
        width = max(1, min(width, len(shown) - col + 1))
        caret = " " * (col - 1) + "^" + "~" * (width - 1)
        return f"{head}\n    {shown}\n    {caret}"


def _window(text: str, col: int) -> tuple[str, int]:
    """At most QUOTE_WIDTH characters of `text` around column `col`, and the column within them."""
    if len(text) <= QUOTE_WIDTH:
        return text, col
    start = max(0, min(col - 1 - QUOTE_WIDTH // 3, len(text) - QUOTE_WIDTH))
    stop = start + QUOTE_WIDTH
    before, after = ("..." if start else ""), ("..." if stop < len(text) else "")
    return before + text[start:stop] + after, col - start + len(before)


def clip_words(message: str) -> str:
    """`message` with every word longer than MAX_WORD cut in the middle (Note [quoting untrusted text])."""
    if len(message) <= MAX_WORD:
        return message
    half = MAX_WORD // 2
    message = " ".join(w if len(w) <= MAX_WORD else f"{w[:half]}...{w[-half:]}" for w in message.split(" "))
    return message if len(message) <= MAX_MESSAGE else f"{message[:MAX_MESSAGE // 2]} ... {message[-MAX_MESSAGE // 2:]}"


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


class UsageError(Exception):
    """A user mistake outside spec files (a missing directory, a bad flag value); the CLI prints it, exits 2."""


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
        if lines is None and _quotable(Path(path)):
            try:
                lines = _lines(Path(path).read_text(errors="replace"))
            except OSError:
                return None
            self.texts[path] = lines
        if not lines or not 1 <= line <= len(lines):
            return None
        return lines[line - 1].expandtabs(1)


def _quotable(path: Path) -> bool:
    """A regular file small enough to read back (never a pipe or a device: Note [untrusted paths])."""
    try:
        return path.is_file() and path.stat().st_size <= MAX_SOURCE_BYTES
    except OSError:
        return False


def _lines(text: str) -> list[str]:
    """Lines as the parser counts them: split at "\n" only (not at \f or \u2028)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def did_you_mean(word: str, choices: list[str] | tuple[str, ...] | set[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when none is close.

    A word that starts a few choices (`A100` of `A100-40`, `A100-80`) names
    them all; a choice that starts the word before a '-' or '_' (`H100` of
    `H100-80GB`) comes next; otherwise the closest spelling wins, then a
    case-insensitive match.
    """
    import difflib

    low = word.lower()
    started = sorted(c for c in choices if c.lower().startswith(low) and c != word) if len(word) >= 2 else []
    if 1 <= len(started) <= 3:
        return " (did you mean " + " or ".join(f"'{c}'" for c in started) + "?)"
    # `H100-80GB`, `a100_sxm`: a choice followed by a suffix the catalog leaves out
    stems = [c for c in choices if len(c) >= 2 and low[len(c):len(c) + 1] in ("-", "_", " ")
             and low.startswith(c.lower())]
    if stems:
        return f" (did you mean '{max(stems, key=len)}'?)"
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        if low in lowered:
            close = [lowered[low]]
    return f" (did you mean '{close[0]}'?)" if close else ""
