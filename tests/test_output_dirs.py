"""hetc never deletes what it did not write, and a plan directory is checked against its plan.het before any
rank starts (issue 28, findings 1 and 13; Note [output directories] in hetc/ir/outdir.py, Note [transfers against
the plan] in passes/verify/transfers.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hetc.cli import main
from hetc.ir.errors import UsageError
from hetc.ir.outdir import MARKER, OutputKind, check_output_dir, write_marker, write_output_dir
from tests.conftest import DEMO, SPECS


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def user_folder(tmp_path: Path) -> Path:
    """A user's project: the demo specs (with the catalog they import), a corpus and a script."""
    project = tmp_path / "project"
    shutil.copytree(DEMO, project / "demo")
    shutil.copy(SPECS / "catalog.het", project / "catalog.het")
    (project / "demo" / "train.py").write_text("print('mine')\n")
    (project / "demo" / "model").mkdir()
    (project / "demo" / "model" / "config.json").write_text("{}\n")
    return project / "demo"


def test_compile_into_the_current_directory_is_refused_and_every_file_stays(user_folder, monkeypatch, capsys):
    """Finding 1: `-o .` deleted the spec, the model directory, the corpus and the script."""
    monkeypatch.chdir(user_folder)
    before = _snapshot(user_folder)
    assert main(["compile", "single.het", "-o", "."]) == 2
    assert "refusing to write a plan directory to '.': it is the current directory" in capsys.readouterr().err
    assert _snapshot(user_folder) == before
    assert main(["compile", "single.het", "-o", ".."]) == 2
    assert "it holds the current directory" in capsys.readouterr().err
    assert _snapshot(user_folder) == before


def test_compile_into_a_directory_with_an_unrelated_file_keeps_it(user_folder, tmp_path, capsys):
    """Finding 1: `-o precious` removed an unrelated file."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me\n")
    assert main(["compile", str(user_folder / "single.het"), "-o", str(precious)]) == 2
    err = capsys.readouterr().err
    assert f"hetc compile: error: refusing to replace '{precious}': it holds notes.txt, which hetc did not write" in err
    assert _snapshot(precious) == {"notes.txt": b"keep me\n"}


def test_the_spec_folder_and_the_folders_above_it_are_refused(user_folder, capsys):
    before = _snapshot(user_folder.parent)
    for out, held in ((user_folder, "is the spec's folder"), (user_folder.parent, "holds the spec's folder")):
        assert main(["compile", str(user_folder / "single.het"), "-o", str(out)]) == 2
        assert f"to '{out}': it {held}" in capsys.readouterr().err
    assert _snapshot(user_folder.parent) == before


def test_a_regular_file_is_refused(user_folder, capsys):
    script = user_folder / "train.py"
    assert main(["compile", str(user_folder / "single.het"), "-o", str(script)]) == 2
    assert f"'{script}' is a file; a plan directory is a directory" in capsys.readouterr().err
    assert script.read_text() == "print('mine')\n"


def test_recompiling_over_a_plan_directory_hetc_wrote_replaces_it(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "plan" and re.fullmatch(r"[0-9a-f]{64}", marker["files"]["plan.het"])
    assert set(marker["files"]) == set(_snapshot(out)) - {MARKER}
    (out / "programs" / "rank-0000.txt").write_text("edited by hand\n")   # hetc's file: replaced
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    assert "rank 0 stage=0" in (out / "programs" / "rank-0000.txt").read_text()
    assert (out / "programs" / "rank-0003.txt").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["plan"]   # no temporary sibling left behind
    (out / "mine.txt").write_text("a note\n")                  # a file hetc did not write: refused
    capsys.readouterr()
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 2
    assert "it holds mine.txt, which hetc did not write" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "a note\n" and (out / "programs" / "rank-0003.txt").is_file()


def test_a_plan_directory_from_before_the_marker_is_replaced_but_not_with_extra_files(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    (out / MARKER).unlink()   # what an older hetc wrote
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    assert not (out / "programs" / "rank-0003.txt").exists()
    (out / MARKER).unlink()
    (out / "programs" / "notes.md").write_text("mine\n")
    capsys.readouterr()
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 2
    assert "it holds programs/notes.md, which hetc did not write" in \
        capsys.readouterr().err
    assert (out / "programs" / "notes.md").read_text() == "mine\n"


def test_an_empty_directory_may_be_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    assert (out / "plan.het").is_file()


def test_one_kind_of_output_never_replaces_another(tmp_path):
    out = tmp_path / "out"
    write_output_dir(out, OutputKind.HF_EXPORT, lambda tmp: (tmp / "config.json").write_text("{}"))
    write_output_dir(out, OutputKind.HF_EXPORT, lambda tmp: (tmp / "config.json").write_text("{ }"))
    assert (out / "config.json").read_text() == "{ }"
    with pytest.raises(UsageError, match="it holds a Hugging Face export, not a plan directory"):
        check_output_dir(out, OutputKind.PLAN)


def test_a_marked_directory_answers_for_the_marked_one_inside_it(tmp_path):
    """The demo's OUT holds plan/, a plan directory with its own marker: a stray file in plan/ is named."""
    out = tmp_path / "demo"
    out.mkdir()
    write_marker(out, OutputKind.DEMO, planned=["metrics.jsonl", "plan/"])
    write_output_dir(out / "plan", OutputKind.PLAN, lambda tmp: (tmp / "plan.het").write_text("# plan\n"))
    (out / "metrics.jsonl").write_text("{}\n")
    check_output_dir(out, OutputKind.DEMO)     # its own files, planned or written, and a marked plan/
    (out / "plan" / "draft.het").write_text("# mine\n")
    with pytest.raises(UsageError, match="it holds plan/draft.het, which hetc did not write"):
        check_output_dir(out, OutputKind.DEMO)
    write_output_dir(out / "old-plan", OutputKind.PLAN, lambda tmp: (tmp / "plan.het").write_text("# plan\n"))
    with pytest.raises(UsageError, match="it holds old-plan/, plan/draft.het, which"):   # not the demo's
        check_output_dir(out, OutputKind.DEMO)


def test_the_demo_outputs_of_an_older_hetc_are_replaced_but_not_with_extra_files(tmp_path):
    from hetc.commands.demo import LEGACY_DEMO

    out = tmp_path / "demo"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out / "plan")]) == 0
    (out / "plan" / MARKER).unlink()
    (out / "metrics.jsonl").write_text("{}\n")
    check_output_dir(out, OutputKind.DEMO, legacy=LEGACY_DEMO)
    (out / "plan" / "notes.txt").write_text("mine\n")
    with pytest.raises(UsageError, match="it holds plan/notes.txt, which hetc did not write"):
        check_output_dir(out, OutputKind.DEMO, legacy=LEGACY_DEMO)


def test_export_hf_over_a_directory_hetc_did_not_write_is_refused(tmp_path, capsys):
    downloaded = tmp_path / "my-llama"
    downloaded.mkdir()
    (downloaded / "tokenizer.json").write_text("{}\n")
    assert main(["export", "hf", str(tmp_path / "ckpt" / "step-2"), "-o", str(downloaded)]) == 2
    assert f"refusing to replace '{downloaded}': it holds tokenizer.json" in capsys.readouterr().err
    assert _snapshot(downloaded) == {"tokenizer.json": b"{}\n"}
    checkpoint = tmp_path / "ckpt"
    assert main(["export", "hf", str(checkpoint / "step-2"), "-o", str(checkpoint)]) == 2
    assert "it holds the checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_runs_and_runs_again_into_its_own_outputs(tmp_path, capsys):
    """The README's first command: its run writes metrics.jsonl and trace.json into the demo's folder, which
    the marker lists as still to come (Note [output files]: only a file written with its digest is kept)."""
    out = tmp_path / "out"
    for _ in range(2):
        assert main(["demo", "--plan", "single", "--steps", "2", "-o", str(out)]) == 0
        assert {"metrics.jsonl", "trace.json", "schedule.html", "schedule.chrome.json"} <= set(_snapshot(out))
        assert "loss " in capsys.readouterr().out


def test_demo_into_a_directory_with_user_files_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("1,2\n")
    assert main(["demo", "-o", str(out)]) == 2
    assert f"refusing to replace '{out}': it holds results.csv" in capsys.readouterr().err
    assert _snapshot(out) == {"results.csv": b"1,2\n"}


@pytest.fixture(scope="module")
def pp_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "pp"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    return out


def _edited(plan: Path, tmp_path: Path, old: str, new: str, file: str = "plan.het") -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(plan, copy)
    text = (copy / file).read_text()
    assert old in text
    (copy / file).write_text(text.replace(old, new))
    return copy


def test_an_edited_hidden_size_is_refused_before_any_rank_starts(pp_plan, tmp_path, capsys):
    """Finding 13: a `hidden` edited in plan.het passed the pre-run check, then gloo aborted (exit 134)."""
    edited = _edited(pp_plan, tmp_path, "hidden = 64", "hidden = 48")
    assert main(["run", str(edited), "--local", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "starting" not in err
    assert ("rank 0, instruction 2 `send act ms=0 mb=0 to=2 shape=2x32x64 h=2`: the plan moves this tensor as "
            "2x32x48 (micro_batch x tokens x hidden), not 2x32x64: plan.het and the programs disagree (was "
            "plan.het edited since `hetc compile`? compile the spec again); 15 more sends and receives disagree") in err
    assert main(["verify", str(edited)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "note: changed since `hetc compile` wrote them: plan.het"


def test_a_shape_edited_in_both_listings_is_refused(pp_plan, tmp_path, capsys):
    """A send and its receive edited alike still match each other; the plan says what goes on the wire."""
    edited = _edited(pp_plan, tmp_path, "to=2 shape=2x32x64 h=2", "to=2 shape=2x32x32 h=2",
                     "programs/rank-0000.txt")
    listing = edited / "programs" / "rank-0002.txt"
    listing.write_text(listing.read_text().replace("recv act ms=0 mb=0 from=0 shape=2x32x64",
                                                   "recv act ms=0 mb=0 from=0 shape=2x32x32"))
    assert main(["verify", str(edited)]) == 2
    err = capsys.readouterr().err
    assert "the plan moves this tensor as 2x32x64 (micro_batch x tokens x hidden), not 2x32x32" in err
    assert "; 1 more sends and receives disagree" in err
    assert err.splitlines()[-1] == ("note: changed since `hetc compile` wrote them: programs/rank-0000.txt, "
                                    "programs/rank-0002.txt")


def test_an_edit_of_plan_het_the_programs_still_fit_is_accepted(pp_plan, tmp_path, capsys):
    """plan.het may be edited where the programs stay right (a learning rate): verified, not refused."""
    text = (pp_plan / "plan.het").read_text()
    lr = re.search(r"lr = [^\n]+", text)
    assert lr is not None
    edited = _edited(pp_plan, tmp_path, lr.group(0), "lr = 0.5")
    assert main(["verify", str(edited)]) == 0
    assert "ok: 4 ranks" in capsys.readouterr().out


# ---------------------------------------------------------------- one-file outputs (Note [output files])

_ONE_FILE_CASES = [
    # (argv with {plan}/{spec}/{tmp}, the file that must stay, what the error says)
    (["plan", "{spec}", "-o", "{spec}"], "{spec}", "-o '{spec}' is the spec, which this command reads"),
    (["profile", "{spec}", "-o", "{spec}"], "{spec}", "-o '{spec}' is the spec"),
    (["plan", "{spec}", "-o", "{tmp}/demo/job.het"], "{tmp}/demo/job.het",
     "-o '{tmp}/demo/job.het' is a file the spec imports, which this command reads"),
    (["plan", "{spec}", "-o", "{tmp}/demo/data/tiny.txt"], "{tmp}/demo/data/tiny.txt", "is the training data"),
    (["profile", "{spec}", "-o", "{tmp}/demo/job.het"], "{tmp}/demo/job.het", "is a file the spec imports"),
    (["launch", "{spec}", "--emit", "slurm", "-o", "{spec}"], "{spec}", "is the spec"),
    (["launch", "{spec}", "--emit", "slurm", "-o", "{tmp}/demo/job.het"], "{tmp}/demo/job.het",
     "is a file the spec imports"),
    (["launch", "{plan}", "--emit", "slurm", "-o", "{plan}/groups.txt"], "{plan}/groups.txt",
     "is a file of a plan directory hetc wrote"),
    (["viz", "{plan}", "--chrome-trace", "{plan}/timeline.json"], "{plan}/timeline.json",
     ("--chrome-trace '{plan}/timeline.json' is a file of a plan directory hetc wrote ('{plan}'); replacing it "
      "would break that directory")),
    (["viz", "{plan}", "-o", "{plan}/plan.het"], "{plan}/plan.het", "is a file of a plan directory hetc wrote"),
    (["viz", "{plan}", "--chrome-trace", "{tmp}/t.json", "-o", "{tmp}/t.json"], "{tmp}/t.json",
     "is the --chrome-trace output"),
    (["run", "{plan}", "--local", "--metrics", "{plan}/summary.json"], "{plan}/summary.json",
     "--metrics '{plan}/summary.json' is a file of a plan directory"),
    (["run", "{plan}", "--local", "--metrics", "{tmp}/m", "--trace", "{tmp}/m"], "{tmp}/m", "is the --metrics file"),
    (["run", "{spec}", "--elastic", "--checkpoint", "{tmp}/c", "--every", "1", "--metrics", "{tmp}/demo/data/tiny.txt"],
     "{tmp}/demo/data/tiny.txt", "--metrics '{tmp}/demo/data/tiny.txt' is the training data"),
    (["run", "{spec}", "--elastic", "--checkpoint", "{tmp}/c", "--every", "1", "--trace", "{tmp}/demo/job.het"],
     "{tmp}/demo/job.het", "is a file the spec imports"),
    (["calibrate", "{plan}", "--metrics", "{plan}/timeline.json"], "{plan}/timeline.json", "is a file of a plan"),
    (["data", "prepare", "{tmp}/t.json", "--tokenizer", "{tmp}", "-o", "{tmp}/t.json"], "{tmp}/t.json",
     "-o '{tmp}/t.json' is an input, which this command reads"),
    (["data", "prepare", "{tmp}/t.json", "--tokenizer", "{tmp}", "-o", "{tmp}/tokenizer_config.json"],
     "{tmp}/tokenizer_config.json", "-o '{tmp}/tokenizer_config.json' is a file of the tokenizer directory"),
]


@pytest.mark.parametrize("argv, kept, says", _ONE_FILE_CASES, ids=lambda c: " ".join(c) if isinstance(c, list)
                         else None)
def test_a_one_file_output_replaces_no_input_and_no_file_of_a_plan_directory(pp_plan, tmp_path, capsys, argv,
                                                                             kept, says):
    """`hetc plan spec.het -o spec.het` replaced the spec with its filled plan; `viz --chrome-trace
    DIR/timeline.json` left a plan directory that no longer loaded."""
    plan = tmp_path / "plan"
    shutil.copytree(pp_plan, plan)
    shutil.copytree(DEMO, tmp_path / "demo")                # a spec of the user's, and what it imports
    shutil.copy(SPECS / "catalog.het", tmp_path / "catalog.het")
    (tmp_path / "t.json").write_text("{}\n")
    (tmp_path / "m").write_text("{}\n")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}\n')
    names = {"plan": str(plan), "spec": str(tmp_path / "demo" / "pp.het"), "tmp": str(tmp_path)}
    kept_path = Path(kept.format(**names))
    before = kept_path.read_bytes()
    status = main([word.format(**names) for word in argv])
    assert status == 2
    assert says.format(**names) in capsys.readouterr().err
    assert kept_path.read_bytes() == before


_IN_THE_WAY = [   # (argv with {plan}/{spec}, the flag); the output goes under {tmp}/m, which is a file
    (["viz", "{plan}", "--chrome-trace", "{tmp}/m/t.json"], "--chrome-trace '{tmp}/m/t.json'"),
    (["viz", "{plan}", "-o", "{tmp}/m/page.html"], "-o '{tmp}/m/page.html'"),
    (["plan", "{spec}", "-o", "{tmp}/m/planned.het"], "-o '{tmp}/m/planned.het'"),
    (["run", "{plan}", "--local", "--metrics", "{tmp}/m/metrics.jsonl"], "--metrics '{tmp}/m/metrics.jsonl'"),
    (["launch", "{spec}", "--emit", "slurm", "-o", "{tmp}/m/job.sh"], "-o '{tmp}/m/job.sh'"),
    (["compile", "{spec}", "-o", "{tmp}/m/plan"], "'{tmp}/m/plan'"),
]


@pytest.mark.parametrize("argv, flag", _IN_THE_WAY, ids=lambda c: " ".join(c) if isinstance(c, list) else None)
def test_an_output_under_a_file_is_a_usage_error_before_the_work(pp_plan, tmp_path, capsys, argv, flag):
    """An output whose folder is a file ended `hetc viz` and `hetc plan` in an internal error after their work,
    and `hetc run --metrics` in every rank's exit (status 3) after the model was built."""
    (tmp_path / "m").write_text("{}\n")
    names = {"plan": str(pp_plan), "spec": str(DEMO / "pp.het"), "tmp": str(tmp_path)}
    assert main([word.format(**names) for word in argv]) == 2
    assert f"{flag.format(**names)}: '{tmp_path / 'm'}' is a file, not a directory" in capsys.readouterr().err
    assert (tmp_path / "m").read_text() == "{}\n"


def test_a_one_file_output_goes_into_the_folders_it_names(pp_plan, tmp_path, capsys):
    """As `hetc compile -o a/b/plan` makes its folders (an internal error before: no such file or directory)."""
    page, trace = tmp_path / "a" / "b" / "page.html", tmp_path / "c" / "trace.json"
    assert main(["viz", str(pp_plan), "-o", str(page), "--chrome-trace", str(trace)]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>") and json.loads(trace.read_text())["traceEvents"]


def test_a_directory_as_a_one_file_output_is_a_usage_error(pp_plan, tmp_path, capsys):
    assert main(["viz", str(pp_plan), "--chrome-trace", str(tmp_path)]) == 2
    assert f"--chrome-trace '{tmp_path}' is a directory; name a file" in capsys.readouterr().err


def test_vizs_default_page_goes_with_its_plan_directory(tmp_path, capsys):
    """`hetc viz DIR` writes DIR/schedule.html; compiling into DIR again replaces it, as any file of DIR."""
    out = tmp_path / "plan"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    assert main(["viz", str(out)]) == 0 and (out / "schedule.html").is_file()
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    assert not (out / "schedule.html").exists()


def _hf_config(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 128}))
    return folder


_PRINTED = [   # verbs that print their output without -o: `-o -` is that, as for Unix tools (no file named '-')
    ["plan", "{auto}"],
    ["launch", "{plan}", "--emit", "slurm"],
    ["import", "hf", "{hf}"],
]


@pytest.mark.parametrize("argv", _PRINTED, ids=lambda argv: argv[0])
def test_dash_as_the_output_prints_it_as_without_o(argv, pp_plan, tmp_path, monkeypatch, capsys):
    names = {"auto": str(SPECS / "examples" / "auto_demo.het"), "plan": str(pp_plan),
             "hf": str(_hf_config(tmp_path / "hf"))}
    monkeypatch.chdir(tmp_path)
    words = [word.format(**names) for word in argv]
    assert main(words) == 0
    printed = capsys.readouterr().out
    assert main([*words, "-o", "-"]) == 0
    assert capsys.readouterr().out == printed and printed.strip()
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("argv, flag", [
    (["viz", "{plan}", "-o", "-"], "-o"),
    (["viz", "{plan}", "--chrome-trace", "-"], "--chrome-trace"),
    (["profile", "{spec}", "-o", "-"], "-o"),
    (["run", "{plan}", "--local", "--metrics", "-"], "--metrics"),
], ids=lambda c: " ".join(c) if isinstance(c, list) else None)
def test_dash_is_a_usage_error_where_the_output_goes_only_to_a_file(argv, flag, pp_plan, tmp_path, monkeypatch,
                                                                      capsys):
    """It wrote a file named '-' in the current folder."""
    monkeypatch.chdir(tmp_path)
    assert main([word.format(plan=pp_plan, spec=DEMO / "job.het") for word in argv]) == 2
    assert f"{flag} '-': this output goes to a file, not to standard output; name a file" in capsys.readouterr().err
    assert not (tmp_path / "-").exists()
