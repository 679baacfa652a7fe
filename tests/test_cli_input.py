"""The CLI against untrusted input and a new user's first tries: exact messages, locations, exit status 2."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from hetc.cli import BROKEN_PIPE_STATUS, main
from hetc.ir.errors import MAX_SOURCE_BYTES, MAX_WORD, QUOTE_WIDTH
from tests.conftest import DEMO, ROOT

JOB = DEMO / "job.het"


def _check(capsys, path) -> tuple[int, list[str]]:
    status = main(["check", str(path)])
    return status, capsys.readouterr().err.splitlines()


# ---------------------------------------------------------------- untrusted input


@pytest.mark.timeout(60)
def test_use_of_a_named_pipe_is_a_located_error_not_a_hang(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe.het")
    (tmp_path / "spec.het").write_text('use "pipe.het"\n')
    status, err = _check(capsys, "spec.het")
    assert status == 2
    assert err[0] == ("spec.het:1:1: error: 'pipe.het' is a named pipe, not a regular file; a spec is read "
                      "only from a regular file")


@pytest.mark.timeout(60)
def test_checking_a_named_pipe_itself_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe.het")
    status, err = _check(capsys, "pipe.het")
    assert status == 2
    assert err == [("pipe.het:1:1: error: 'pipe.het' is a named pipe, not a regular file; a spec is read only "
                    "from a regular file")]


def test_a_file_over_the_size_cap_is_refused_with_a_short_message(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big.het").write_text("# " + "x" * MAX_SOURCE_BYTES + "\n")
    status, err = _check(capsys, "big.het")
    assert status == 2
    assert err == [(f"big.het:1:1: error: 'big.het' is larger than {MAX_SOURCE_BYTES >> 20} MiB, the limit for "
                    "a spec file")]


def test_a_long_line_is_quoted_as_a_window_around_the_column(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    word = "x" * 1_000_000
    (tmp_path / "long.het").write_text(f"model m {{ layers = 4 {word} = 3 }}\n")
    status, err = _check(capsys, "long.het")
    assert status == 2
    half = MAX_WORD // 2   # the echoed word `'xx…x':` keeps its first and last `half` characters
    assert err[0] == (f"long.het:1:22: error: expected ',', ';' or a new line before '{'x' * (half - 1)}...{'x' * (half - 2)}': "
                      "statements on one line are separated by ',' or ';'")
    assert err[1] == "    model m { layers = 4 " + "x" * (QUOTE_WIDTH - len("model m { layers = 4 ")) + "..."
    assert err[2] == "    " + " " * 21 + "^" + "~" * (QUOTE_WIDTH - 21 + 2)
    assert len(err) == 3


def test_an_error_far_along_a_line_shows_the_text_around_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = 'model m { doc = "' + "ab " * 100_000 + '" '
    (tmp_path / "wide.het").write_text(before + "= 4 }\n")
    status, err = _check(capsys, "wide.het")
    assert status == 2
    assert err[0] == f"wide.het:1:{len(before) + 1}: error: unexpected '='; expected ',', ';', '}}' or a new line"
    quoted, caret = err[1], err[2]
    assert quoted == "    ..." + (before + "= 4 }")[-QUOTE_WIDTH:]   # the line's end: the last QUOTE_WIDTH
    assert caret == " " * quoted.index('= 4 }') + "^"


def test_deep_nesting_on_one_line_gets_a_short_located_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deep.het").write_text("a { " * 5000 + "}" * 5000 + "\n")
    status, err = _check(capsys, "deep.het")
    assert status == 2
    assert err[0] == "deep.het:1:129: error: blocks and lists are nested more than 32 levels deep here"
    assert sum(len(line) for line in err) < 400


# ---------------------------------------------------------------- a new user's first tries


def test_an_empty_file_fails_check(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.het").write_text("")
    status, err = _check(capsys, "empty.het")
    assert status == 2
    assert err[0] == ("empty.het:1:1: error: 'empty.het' is empty: a spec file holds blocks (model, cluster, "
                      "train, parallel, device) or `use` lines")


@pytest.mark.parametrize("form", ["stage = auto", "stages = auto"])
def test_stage_auto_as_documented_leaves_the_stages_to_the_planner(tmp_path, capsys, form):
    spec = tmp_path / "auto.het"
    spec.write_text(f'use "{JOB}"\nparallel {{\n  {form}\n}}\n')
    assert main(["check", str(spec)]) == 0
    assert capsys.readouterr().out.endswith("; plan: auto\n")


@pytest.mark.parametrize("verb, wants", [("plan", "no train block"), ("explain", "no train, parallel blocks")])
def test_a_spec_short_of_a_block_names_the_blocks_the_verb_needs(tmp_path, capsys, verb, wants):
    """`hetc plan` and `compile` plan a spec without a parallel block, so they do not ask for one; `explain`
    times the plan written, so it does."""
    text = JOB.read_text().replace('use "../catalog.het"', f'use "{ROOT / "specs" / "catalog.het"}"')
    spec = tmp_path / "short.het"
    spec.write_text(text[:text.index("train {")])
    assert main([verb, str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"error: the spec has {wants}; this command needs a whole spec" in err


@pytest.mark.parametrize("body, at", [("parallel { auto }\n", "2:17"), ("parallel {\n  auto\n}\n", "3:7")])
def test_a_lone_auto_in_a_block_is_told_what_to_write(tmp_path, capsys, body, at):
    """`parallel { auto }` reads as a key without its value: the error says what plans everything."""
    spec = tmp_path / "auto.het"
    spec.write_text(f'use "{JOB}"\n{body}')
    status, err = _check(capsys, spec)
    assert status == 2 and err[0].startswith(f"{spec}:{at}: error: unexpected ")
    assert err[0].endswith("; `auto` alone is no statement: an empty `parallel { }` leaves every choice to the "
                           "planner, or write `KEY = auto` for one")
    spec.write_text(f'use "{JOB}"\nparallel {{\n  zero 3\n}}\n')
    assert "alone is no statement" not in _check(capsys, spec)[1][0]


def test_check_counts_parameters_as_model_cards_do(capsys):
    """65,285.7M reads as 65.29B; a demo's fraction of a million stays in M."""
    assert main(["check", str(ROOT / "specs" / "examples" / "megatron_llama65b.het"), str(JOB.parent / "pp.het")]) == 0
    out = capsys.readouterr().out
    assert "(llama, 80 blocks, 65.29B params)" in out and "(llama, 4 blocks, 0.2M params)" in out


def test_viz_of_a_spec_says_it_wants_a_plan_directory(capsys):
    assert main(["viz", str(DEMO / "pp.het")]) == 2
    assert capsys.readouterr().err == (f"hetc viz: error: {DEMO / 'pp.het'} is a spec, and viz draws a plan "
                                       f"directory: run `hetc compile {DEMO / 'pp.het'} -o DIR` and then "
                                       "`hetc viz DIR`\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verb", [["explain", str(DEMO / "pp.het")], ["check", str(DEMO / "pp.het")]],
                         ids=lambda v: v[0])
def test_a_closed_stdout_ends_quietly(verb):
    """`hetc explain X | head`: the reader is gone before hetc writes; no traceback, no "internal error"."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "hetc", *verb], stdout=write_end, stderr=subprocess.PIPE,
                              cwd=ROOT, timeout=100, text=True, check=False)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == BROKEN_PIPE_STATUS


def test_a_plan_directory_whose_plan_was_edited_back_to_auto_is_a_located_error(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    plan = out / "plan.het"
    text = plan.read_text()
    start = text.index("  stage all {")
    plan.write_text(text[:start] + "  stages = auto\n" + text[text.index("  }\n", start) + 4:])
    capsys.readouterr()
    assert main(["verify", str(out)]) == 2
    line = text[:text.index("parallel {")].count("\n") + 1
    assert capsys.readouterr().err.splitlines()[0] == (
        f"{plan}:{line}:1: error: the plan still has `auto` in it; a plan directory holds an explicit plan "
        "(write one with `hetc compile SPEC -o DIR`)")


def test_compile_logs_when_it_skips_torch_csv_and_why(tmp_path, capsys, caplog):
    """Issue 33, finding 5: a heterogeneous compile prints no line about torch's files unless asked (-v)."""
    with caplog.at_level(logging.INFO, logger="hetc.compile"):
        assert main(["compile", str(DEMO / "hetero.het"), "-o", str(tmp_path / "hetero")]) == 0
    assert "torch" not in capsys.readouterr().out
    assert caplog.messages == [("torch/*.csv not written: stage 'head_end' has 1 lane and stage 'middle' 2 lanes: "
                                "a many-to-many pipeline, which torch's action format cannot describe")]
    assert not (tmp_path / "hetero" / "torch").exists()
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(tmp_path / "pp")]) == 0
    assert "not written" not in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "pp" / "torch").iterdir()) == ["lane0.csv", "lane1.csv"]


def test_compile_help_says_which_plans_get_torch_csv(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "torch/*.csv" in help_text and "for plans whose lanes line up across stages" in help_text
    assert "compile skips torch/ (`hetc -v compile` says why)" in help_text


def test_no_grammar_terminal_name_reaches_a_syntax_message():
    """What a syntax error says it expected is words ('a name', "'='"), never lark's names (NAME, _NL, __ANON_0)."""
    from hetc.frontend.syntax import _describe_expected, _parser

    names = [t.name for t in _parser().terminals]
    for name in names:
        said = _describe_expected({name})
        assert said.startswith("; expected ") and not any(n in said for n in names), (name, said)


@pytest.mark.parametrize("argv", [
    ["run", "PLAN", "--local", "--timeout", "nan"], ["run", "PLAN", "--local", "--init-timeout", "inf"],
    ["run", "PLAN", "--local", "--stop-timeout", "NaN"], ["run", "PLAN", "--local", "--heartbeat-timeout", "+inf"],
    ["run", "PLAN", "--local", "--rebalance", "--rebalance-threshold", "nan"],
    ["run", "PLAN", "--local", "--rebalance", "--rebalance-min-gain", "x"],
    ["export", "hf", "CKPT", "-o", "OUT", "--max-shard-size", "nan"],
])
def test_a_number_option_that_is_not_finite_is_a_usage_error(argv, capsys):
    """float() takes "nan" and "inf"; they passed the `<= 0` checks and failed inside the run."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: wants a finite number, not '{argv[-1]}'" in capsys.readouterr().err


def test_demo_refuses_a_step_count_before_it_compiles(tmp_path, capsys):
    assert main(["demo", "--steps", "0", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr()
    assert "hetc demo: error: --steps must be positive, got 0" in err.err and "[2/4]" not in err.out
    assert not (tmp_path / "out").exists()
