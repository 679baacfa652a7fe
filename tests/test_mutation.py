"""Randomized mutations of every spec in specs/: only located SpecErrors, never a crash or a hang.

specs/ is copied once to a scratch folder. Each case breaks one file there
with one to three mutations (delete or duplicate a line, drop a bracket, a
number replaced by 0, -1, 1e30, NaN or a word, or grown a thousandfold, a
typo in a keyword, random bytes, truncation, a self-import, ...), runs the
front-end (load + validate) in-process under a time limit, renders any
diagnostics the way the CLI does, and restores the file. A mutated file is
loaded itself or through a file that imports it, so errors located in
imported files are covered too.

A second test takes the demo specs' mutations that load and explains each
(`hetc explain`): 0 or 2, never an internal error or a hang.

Cases are seeded by (file, index): a failure names its case, and
`HETC_MUTATION_CASE=demo/job.het#17` reruns just that one. The default run is
1200 cases (the suite's time budget); `HETC_MUTATIONS=20000` runs more.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import re
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import hetc.frontend.syntax
from hetc.cli import main
from hetc.ir.errors import Sources, SpecError
from hetc.compiler import load_checked
from tests.conftest import SPECS

TOTAL_CASES = int(os.environ.get("HETC_MUTATIONS", "1200"))
ONLY_CASE = os.environ.get("HETC_MUTATION_CASE", "")
CASE_TIME_LIMIT_S = 2.0

_NUMBER = re.compile(rb"(?<![A-Za-z0-9_.])[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_NAME = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_USE = re.compile(rb'^\s*use\s+"([^"\n]*)"', re.MULTILINE)
_BAD_NUMBERS = [b"0", b"-1", b"1e30", b"NaN", b"nan", b"inf", b"-0", b"1e400", b"0.5",
                b"99999999999999999999999", b"lots", b"auto", b"1f1b", b'"7"']
_ODD_TEXT = ["\x00", "\x0c", "\u2028", "\t", "é", "\r", "\\", '"', "#", "{", "]", "..", "<->", ":", "=", ";"]


# ---------------------------------------------------------------- mutations


def _delete_line(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    return b"\n".join(lines[:i] + lines[i + 1:]), f"delete line {i + 1}"


def _duplicate_line(rng, data):
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    return b"\n".join(lines[:i + 1] + lines[i:]), f"duplicate line {i + 1}"


def _swap_lines(rng, data):
    lines = data.split(b"\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines), f"swap lines {i + 1} and {j + 1}"


def _drop_bracket(rng, data):
    spots = [m.start() for m in re.finditer(rb"[{}\[\]]", data)]
    if not spots:
        return _truncate(rng, data)
    i = rng.choice(spots)
    return data[:i] + data[i + 1:], f"drop {data[i:i + 1]!r} at byte {i}"


def _replace_number(rng, data):
    spots = list(_NUMBER.finditer(data))
    if not spots:
        return _typo(rng, data)
    m, new = rng.choice(spots), rng.choice(_BAD_NUMBERS)
    return data[:m.start()] + new + data[m.end():], f"number {m.group()!r} -> {new!r} at byte {m.start()}"


def _grow_number(rng, data):
    """A number made much larger but still in bounds: 12 nodes -> 12000 (hunts for slowness)."""
    spots = [m for m in _NUMBER.finditer(data) if m.group().isdigit()]
    if not spots:
        return _replace_number(rng, data)
    m, tail = rng.choice(spots), rng.choice([b"0", b"000", b"9999"])
    return data[:m.end()] + tail + data[m.end():], f"number {m.group()!r} -> {m.group() + tail!r}"


def _typo(rng, data):
    spots = list(_NAME.finditer(data))
    if not spots:
        return _random_bytes(rng, data)
    m = rng.choice(spots)
    word = bytearray(m.group())
    k = rng.randrange(len(word))
    how = rng.choice(["drop", "double", "swap", "letter", "case"])
    if how == "drop":
        del word[k]
    elif how == "double":
        word.insert(k, word[k])
    elif how == "swap" and k + 1 < len(word):
        word[k], word[k + 1] = word[k + 1], word[k]
    elif how == "letter":
        word[k] = rng.choice(b"abcdefghijklmnopqrstuvwxyz_0")
    else:
        word = bytearray(bytes(word).swapcase())
    return data[:m.start()] + bytes(word) + data[m.end():], f"typo ({how}) in {m.group()!r} at byte {m.start()}"


def _random_bytes(rng, data):
    i = rng.randrange(len(data) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    return data[:i] + junk + data[i:], f"insert bytes {junk!r} at byte {i}"


def _odd_text(rng, data):
    i = rng.randrange(len(data) + 1)
    odd = rng.choice(_ODD_TEXT).encode()
    return data[:i] + odd + data[i:], f"insert {odd!r} at byte {i}"


def _truncate(rng, data):
    i = rng.randrange(len(data) + 1)
    return data[:i], f"truncate at byte {i}"


def _self_import(rng, data, name: str):
    lines = data.split(b"\n")
    i = rng.randrange(len(lines) + 1)
    lines.insert(i, f'use "{name}"'.encode())
    return b"\n".join(lines), f"self-import at line {i + 1}"


MUTATIONS = [_delete_line, _duplicate_line, _swap_lines, _drop_bracket, _replace_number, _replace_number,
             _grow_number, _typo, _typo, _random_bytes, _odd_text, _truncate, _self_import]


def mutate(rng: random.Random, data: bytes, name: str) -> tuple[bytes, list[str]]:
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.choice(MUTATIONS)
        data, what = op(rng, data, name) if op is _self_import else op(rng, data)
        done.append(what)
    return data, done


# ---------------------------------------------------------------- running one case


class CaseTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """A hang is work without end: the limit is on the CPU time of the thread running the case, not the
    wall clock, so a shared machine's load cannot turn a slow answer into a "hang". ITIMER_PROF counts the
    whole process, whose other threads (an earlier test's process-group or store threads in this worker)
    may spend some of it: when it fires, the handler (on the main thread, which runs the case) reads that
    thread's own CPU time and waits out the rest (a clean-clone run once failed a 0.1 s load this way)."""
    start = time.thread_time()

    def expire(signum, frame):
        spent = time.thread_time() - start
        if spent < seconds:
            signal.setitimer(signal.ITIMER_PROF, max(seconds - spent, 0.01))
            return
        raise CaseTimeout(f"no answer within {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@dataclass(frozen=True)
class Case:
    target: Path      # the file that is mutated (in the scratch copy)
    load: Path        # the file that is loaded: the target or a file importing it
    index: int


def location_problems(err: SpecError) -> list[str]:
    """Each diagnostic must name a readable file, and a line and column inside it."""
    problems = []
    for d in err.diagnostics:
        s = d.span
        try:
            lines = Path(s.file).read_bytes().decode("utf-8", errors="replace").split("\n")
        except OSError:
            problems.append(f"unreadable file in {s}: {d.message}")
            continue
        if not (1 <= s.line <= len(lines) and 1 <= s.col <= len(lines[s.line - 1]) + 1):
            problems.append(f"{s} is outside the file ({len(lines)} lines): {d.message}")
        d.render(Sources())  # the CLI's rendering must not fail either
    return problems


def run_case(case: Case, original: bytes, root: Path) -> str | None:
    """None when the case behaves; otherwise what went wrong."""
    rng = random.Random(f"{case.target.relative_to(root)}#{case.index}")
    data, what = mutate(rng, original, case.target.name)
    case.target.write_bytes(data)
    try:
        with time_limit(CASE_TIME_LIMIT_S):
            load_checked(case.load, require_fit=True)   # as `hetc check` does
    except SpecError as err:
        problems = location_problems(err)
        return f"{'; '.join(what)}: {problems}" if problems else None
    except CaseTimeout as err:
        return f"{'; '.join(what)}: hang: {err}"
    except Exception as err:  # noqa: BLE001 - exactly what this test hunts
        return f"{'; '.join(what)}: traceback: {type(err).__name__}: {err}"
    finally:
        case.target.write_bytes(original)
    return None


# ---------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def scratch_specs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mutation") / "specs"
    shutil.copytree(SPECS, root)
    return root


def importers_of(root: Path) -> dict[Path, list[Path]]:
    """file -> the files that `use` it directly (by a path relative to the importer)."""
    out: dict[Path, list[Path]] = {}
    for f in sorted(root.rglob("*.het")):
        for m in _USE.finditer(f.read_bytes()):
            target = (f.parent / m.group(1).decode()).resolve()
            out.setdefault(target, []).append(f)
    return out


def plan_cases(root: Path) -> list[Case]:
    files = sorted(root.rglob("*.het"))
    users = importers_of(root)
    per_file = max(1, TOTAL_CASES // len(files))
    cases = []
    for f in files:
        loaders = [f] + users.get(f.resolve(), [])
        for i in range(per_file):
            pick = random.Random(f"{f.relative_to(root)}#{i}:load")
            cases.append(Case(f, pick.choice(loaders), i))
    return cases


@pytest.fixture
def cached_parsing(monkeypatch):
    """Parse each distinct text once: imports that were not mutated are shared by most cases."""
    monkeypatch.setattr(hetc.frontend.syntax, "parse_text", functools.lru_cache(maxsize=512)(hetc.frontend.syntax.parse_text))


@pytest.fixture
def settled_heap():
    """The worker's heap from earlier tests (programs of thousands of ranks) out of the collector's way: a
    full collection of it inside a case once spent the case's CPU-time limit in a gc callback."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_mutated_specs_fail_cleanly(scratch_specs, cached_parsing, settled_heap):
    cases = plan_cases(scratch_specs)
    if ONLY_CASE:
        cases = [c for c in cases if str(c.target.relative_to(scratch_specs)) + f"#{c.index}" == ONLY_CASE]
    assert cases
    originals = {c.target: c.target.read_bytes() for c in cases}
    failures, started = [], time.perf_counter()
    for case in cases:
        problem = run_case(case, originals[case.target], scratch_specs)
        if problem is not None:
            failures.append(f"{case.target.relative_to(scratch_specs)}#{case.index} "
                            f"(loading {case.load.name}): {problem}")
    elapsed = time.perf_counter() - started
    assert not failures, f"{len(failures)} of {len(cases)} cases misbehaved:\n" + "\n".join(failures[:30])
    assert len(cases) >= min(TOTAL_CASES, 1000) or ONLY_CASE
    print(f"{len(cases)} mutated specs in {elapsed:.1f} s")


def test_mutations_are_reproducible():
    rng_a, rng_b = random.Random("x#1"), random.Random("x#1")
    data = (SPECS / "demo" / "job.het").read_bytes()
    assert mutate(rng_a, data, "job.het") == mutate(rng_b, data, "job.het")



EXPLAINED_PER_FILE = 6   # cases a demo spec: each mutated spec is explained whole


def _explain(path: Path) -> int | str:
    """`hetc explain PATH`'s exit status, or what hung."""
    try:
        with time_limit(30.0):
            return main(["explain", str(path)])
    except CaseTimeout as err:
        return f"hang: {err}"


def test_mutated_specs_that_load_are_explained_or_refused(scratch_specs, capsys):
    """A mutation the front end accepts (a number changed, a line doubled) is a spec the later passes see:
    `hetc explain` answers it with its prediction or a located error (exit 0 or 2), never an internal error
    (exit 1) or a hang."""
    failures, predicted = [], 0
    for target in sorted((scratch_specs / "demo").glob("*.het")):
        original = target.read_bytes()
        for index in range(EXPLAINED_PER_FILE):
            data, what = mutate(random.Random(f"explain:{target.name}#{index}"), original, target.name)
            target.write_bytes(data)
            try:
                status = _explain(target)
            finally:
                target.write_bytes(original)
            err = capsys.readouterr().err
            predicted += status == 0
            if status not in (0, 2):
                failures.append(f"demo/{target.name}#{index} ({'; '.join(what)}): {status}: {err[-500:]}")
    assert not failures, "\n".join(failures)
    assert predicted >= 20, f"only {predicted} mutated specs were explained: too few to say anything"
    print(f"{predicted} mutated specs explained")
