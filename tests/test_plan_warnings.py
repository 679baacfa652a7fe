"""Plan warnings (passes/plan_warnings.py): located at the spec, on stderr, the exit status unchanged."""

from __future__ import annotations

import random

from hetc.cli import main
from hetc.compiler import compile_spec
from tests.conftest import DEMO
from tests.plans import TEST_SPECS
from tests.random_plans import random_chunks_plan

NEVER_LOOP = "warning: interleaved 1F1B over chunks that never loop"


def test_interleaved_over_chunks_that_never_loop_is_a_located_warning(capsys):
    assert main(["check", "-q", str(TEST_SPECS / "interleaved_hetero.het")]) == 0
    err = capsys.readouterr().err
    assert f"interleaved_hetero.het:8:14: {NEVER_LOOP}" in err and "schedule = interleaved" in err


ONE_STAGE = """use "{job}"

parallel {{
  schedule = interleaved
  stage s0 {{ layers = embed..head, ranks = [host[0, 0]], lanes = 1, ministages = 2 }}
  idle = [host[0, 1], host[1, 0], host[1, 1]]
}}
"""


def test_chunks_that_loop_warn_nothing_nor_one_stage_with_no_fill(tmp_path, capsys):
    one_stage = tmp_path / "one_stage.het"
    one_stage.write_text(ONE_STAGE.format(job=(DEMO / "job.het").as_posix()))
    assert main(["check", "-q", str(DEMO / "interleaved.het"), str(one_stage)]) == 0
    assert capsys.readouterr().err == ""


def test_the_warned_plan_runs_a_longer_step_than_1f1b_and_explain_says_why(tmp_path, capsys):
    """Note [contiguous chunks]'s example: stages of 1, 3 and 2 consecutive chunks (the random chunk plan of
    tests/test_random_plans_train.py) compile to a longer step as interleaved 1F1B than as 1F1B."""
    text = random_chunks_plan(random.Random(7), DEMO / "job.het")
    interleaved, one_f_one_b = tmp_path / "interleaved.het", tmp_path / "1f1b.het"
    interleaved.write_text(text)
    one_f_one_b.write_text(text.replace("schedule = interleaved", "schedule = 1f1b"))
    assert compile_spec(interleaved).timeline.step_time > 1.1 * compile_spec(one_f_one_b).timeline.step_time
    assert main(["explain", str(interleaved)]) == 0
    assert f"interleaved.het:4:14: {NEVER_LOOP}" in capsys.readouterr().err
    assert main(["explain", str(one_f_one_b)]) == 0
    assert NEVER_LOOP not in capsys.readouterr().err
