"""Randomized mutations of a compiled plan directory's files: the verbs that read one (`hetc verify`, `hetc viz`)
answer with success or a located error (exit 2), never an internal error or a hang.

A plan directory is edited by hand (Note [verified once] in hetc/plandir.py) and copied between machines.
tests/test_mutation.py breaks specs the same way (its mutations are reused here); tests/test_verifier_mutations.py
puts faults into programs that still parse. Each case copies the 4-rank demo pipeline's plan directory, breaks
one of its files with one to three mutations and runs one command on it in-process under a CPU-time limit.
Cases are seeded by (file, index): `HETC_PLANDIR_MUTATIONS=2000` runs more.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

from hetc.cli import main as hetc_main
from tests.test_mutation import MUTATIONS, CaseTimeout, time_limit

CASES_PER_FILE = max(1, int(os.environ.get("HETC_PLANDIR_MUTATIONS", "420")) // 7)
FILES = ("programs/rank-0000.txt", "programs/rank-0003.txt", "groups.txt", "timeline.json", "profiles.json",
         "summary.json", "plan.het")
COMMANDS = (("verify",), ("verify", "--backend", "nccl"), ("viz", "--text"), ("viz", "-o", "{out}/page.html"),
            ("viz", "--chrome-trace", "{out}/trace.json"))
CASE_TIME_LIMIT_S = 10.0
_BYTE_MUTATIONS = [m for m in MUTATIONS if m.__name__ != "_self_import"]   # a plan directory imports nothing


def _mutated(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        data, what = rng.choice(_BYTE_MUTATIONS)(rng, data)
        done.append(what)
    return data, done


@pytest.mark.parametrize("name", FILES)
def test_a_broken_plan_directory_is_a_located_error(name, demo_plan_dirs, tmp_path, capsys):
    failures = []
    for index in range(CASES_PER_FILE):
        rng = random.Random(f"{name}#{index}")
        plan = tmp_path / f"case{index}"
        shutil.copytree(demo_plan_dirs["pp"], plan)
        data, what = _mutated(rng, (plan / name).read_bytes())
        (plan / name).write_bytes(data)
        verb, *flags = rng.choice(COMMANDS)
        argv = [verb, str(plan), *(f.format(out=tmp_path) for f in flags)]
        try:
            with time_limit(CASE_TIME_LIMIT_S):
                code = hetc_main(argv)
        except CaseTimeout as err:
            failures.append(f"{name}#{index} ({'; '.join(what)}): hetc {' '.join(argv)}: {err}")
            continue
        err = capsys.readouterr().err
        if code not in (0, 2) or "internal error" in err:
            failures.append(f"{name}#{index} ({'; '.join(what)}): hetc {' '.join(argv)}: exit {code}\n{err[-600:]}")
        shutil.rmtree(plan)
    assert not failures, "\n".join(failures)
