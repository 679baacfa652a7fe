"""Operations, part one (issue 33, What-to-build items 3, 4 and 5).

Item 3: `hetc export hf` writes a whole model directory (generation config and the tokenizer of the
model's Hugging Face directory), with the modes the umask gives. Item 4: explain, plan and compile of a
plan that does not fit exit 2 after the breakdown; a plan near a device's capacity is warned about, by
rank. Item 5's spec errors are golden cases in tests/invalid/; the rest are here.
"""

from __future__ import annotations

import json
import re
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from hetc.cli import main as hetc_main
from tests.conftest import SPECS
from tests.test_checkpoint_integrity import _run, as_rank0, plans, saved  # noqa: F401 (fixtures)

UMASK = 0o027      # not the usual 022: the modes must come from the umask, not from a constant


@pytest.fixture
def umask() -> Iterator[int]:
    old = os.umask(UMASK)
    yield UMASK
    os.umask(old)


def _modes(directory: Path) -> dict[str, int]:
    """Relative path -> permission bits of `directory` ('.') and everything under it."""
    out = {".": stat.S_IMODE(directory.stat().st_mode)}
    for path in directory.rglob("*"):
        out[path.relative_to(directory).as_posix()] = stat.S_IMODE(path.stat().st_mode)
    return out


def _assert_umask_modes(directory: Path) -> None:
    wrong = {rel: oct(mode) for rel, mode in _modes(directory).items()
             if mode != (0o777 if (directory / rel).is_dir() else 0o666) & ~UMASK}
    assert not wrong, wrong


# ---- item 3: a complete export --------------------------------------------------------------------------

def _save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` ids, saved by transformers as a fast tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(directory)


@pytest.fixture
def hf_checkpoint(as_rank0, tmp_path) -> tuple[Path, Path]:  # noqa: F811 (as_rank0 is the fixture)
    """(the tiny Hugging Face llama with a tokenizer, a checkpoint of one step trained from it)."""
    from tests.test_hf import save_tiny

    hf_dir = save_tiny("llama", tmp_path / "hf")
    _save_tokenizer(hf_dir, 96)
    spec = tmp_path / "job.het"
    spec.write_text(f"""use "{SPECS / 'catalog.het'}"
model tiny {{
  hf = "{hf_dir}"
  seq = 16
  dtype = fp32
}}
cluster local {{
  node host {{
    device = cpu
    gpus = 1
  }}
}}
train {{
  global_batch = 2
  micro_batch = 2
  steps = 1
}}
parallel {{
  stage all {{
    layers = embed..head
    ranks = host
    lanes = 1
  }}
}}
""")
    assert hetc_main(["compile", str(spec), "-o", str(tmp_path / "plan")]) == 0
    assert _run(tmp_path / "plan", "--steps", 1, "--checkpoint", tmp_path / "ckpt") == 0
    return hf_dir, tmp_path / "ckpt" / "step-1"


def test_the_export_loads_with_its_tokenizer_and_follows_the_umask(hf_checkpoint, umask, tmp_path, capsys):
    """Item 3 (finding 3): tokenizer files and generation_config.json travel; 0600/0700 no more."""
    transformers = pytest.importorskip("transformers")
    hf_dir, checkpoint = hf_checkpoint
    out = tmp_path / "export"
    assert hetc_main(["export", "hf", str(checkpoint), "-o", str(out)]) == 0
    assert "and the tokenizer (tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    text = "w3 w7 w42 w95"
    want = transformers.AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == want
    assert json.loads((out / "generation_config.json").read_text()) == \
        json.loads((hf_dir / "generation_config.json").read_text())
    transformers.AutoModelForCausalLM.from_pretrained(out)
    _assert_umask_modes(out)


def test_a_plan_directory_follows_the_umask(umask, tmp_path):
    """Item 3 (finding 3): compile's directory was 0700 (mkdtemp)."""
    assert hetc_main(["compile", str(SPECS / "demo" / "pp.het"), "-o", str(tmp_path / "plan")]) == 0
    _assert_umask_modes(tmp_path / "plan")


def test_an_export_without_a_hugging_face_source_says_it_has_no_tokenizer(saved, tmp_path, capsys):  # noqa: F811
    """Item 3: a model trained from a spec alone gets a generation config made from its config, and one line
    saying there is no tokenizer."""
    out = tmp_path / "export"
    assert hetc_main(["export", "hf", str(saved / "step-4"), "-o", str(out)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "tokenizer" in line]
    assert len(notes) == 1 and notes[0].startswith("note: no tokenizer"), notes
    assert json.loads((out / "generation_config.json").read_text()) == {"_from_model_config": True}


# ---- item 4: a plan that does not fit is an error everywhere; one near capacity is warned about ---------

def _big_job(tmp_path: Path, memory_gib: int) -> Path:
    """A 0.44B-parameter model on two ranks of a `memory_gib` device: rank 0 holds embed..block4 (6.8 GiB with
    its reserve at 7 GiB: 97 %; 6.6 GiB at 4 GiB), rank 1 the rest (under half)."""
    spec = tmp_path / f"big{memory_gib}.het"
    spec.write_text(f"""device box {{
  memory = {memory_gib} GiB
  peak {{
    fp32 = 100 GFLOP/s
  }}
  host_link = 10 GB/s
  memory_bandwidth = 20 GB/s
  efficiency = 0.3
}}
model big {{
  layers = 6
  hidden = 2048
  heads = 16
  ffn = 5632
  vocab = 32000
  seq = 256
  dtype = fp32
}}
cluster local {{
  node host {{
    device = box
    gpus = 2
  }}
}}
train {{
  global_batch = 8
  micro_batch = 2
}}
parallel {{
  stage a {{
    layers = embed..block4
    ranks = host[0, 0]
    lanes = 1
  }}
  stage b {{
    layers = block5..head
    ranks = host[0, 1]
    lanes = 1
  }}
}}
""")
    return spec


@pytest.mark.parametrize("verb", ["explain", "plan", "compile"])
def test_a_plan_that_does_not_fit_exits_2_after_its_breakdown(verb, tmp_path, capsys):
    """Item 4 (finding 4): explain (and plan) exited 0 on a plan that does not fit."""
    spec = _big_job(tmp_path, 4)
    out = ["-o", str(tmp_path / "plan")] if verb == "compile" else []
    assert hetc_main([verb, str(spec), *out]) == 2
    captured = capsys.readouterr()
    assert f"{spec}:30:3: error: stage 'a' does not fit in device memory" in captured.err
    assert re.search(r"rank 0 needs [0-9.]+ GiB \(params [0-9.]+ GiB, grads", captured.err)   # the breakdown
    if verb == "explain":
        assert "** DOES NOT FIT **" in captured.out


def test_explain_json_of_a_plan_that_does_not_fit_is_printed_and_exits_2(tmp_path, capsys):
    assert hetc_main(["explain", str(_big_job(tmp_path, 4)), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["fits"] is False


@pytest.mark.parametrize("verb", ["explain", "plan", "compile"])
def test_a_plan_above_95_percent_of_a_device_is_warned_about_by_rank(verb, tmp_path, capsys):
    """Item 4 (finding 4): 97 % of a device's memory was accepted without a word."""
    spec = _big_job(tmp_path, 7)
    out = ["-o", str(tmp_path / "plan")] if verb == "compile" else []
    assert hetc_main([verb, str(spec), *out]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"hetc {verb}: warning: rank 0 fills more than 95% of its device memory: ")
    assert "rank 0 needs 6.80 GiB of the 7.00 GiB its box holds (97.1%)" in warnings[0]


def test_a_plan_with_room_gets_no_warning(tmp_path, capsys):
    assert hetc_main(["explain", str(_big_job(tmp_path, 8))]) == 0
    assert "warning" not in capsys.readouterr().err


# ---- item 5: the small things -------------------------------------------------------------------------

def test_plan_and_compile_plan_a_spec_that_check_accepts_without_a_parallel_block(tmp_path, capsys):
    """Item 5 (finding 5): check accepted a job without a parallel block that plan refused. plan now plans it
    (a user who runs `hetc plan` on a job asks for exactly that), as `parallel {}` would be."""
    job = tmp_path / "job.het"
    job.write_text(f'use "{SPECS / "demo" / "job.het"}"\n')
    assert hetc_main(["check", str(job)]) == 0
    planned = tmp_path / "planned.het"
    assert hetc_main(["plan", str(job), "-o", str(planned)]) == 0
    text = planned.read_text()
    assert text.startswith(f'use "{SPECS / "demo" / "job.het"}"\n') and "\nparallel {\n" in text
    assert "stage " in text and "auto" not in text
    assert hetc_main(["compile", str(planned), "-o", str(tmp_path / "a")]) == 0
    assert hetc_main(["compile", str(job), "-o", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "plan.het").read_text().split("parallel {")[1] == \
        (tmp_path / "b" / "plan.het").read_text().split("parallel {")[1]


def test_explain_of_a_spec_without_a_parallel_block_still_asks_for_a_plan(tmp_path, capsys):
    job = tmp_path / "job.het"
    job.write_text(f'use "{SPECS / "demo" / "job.het"}"\n')
    assert hetc_main(["explain", str(job)]) == 2
    assert "the spec has no parallel block" in capsys.readouterr().err


@pytest.mark.parametrize("seconds, shown", [
    (25.09502, "25.1 s"), (110.96085, "111 s"), (0.04123, "41.2 ms"), (0.0009, "900 us"), (1.5, "1.5 s"),
    (1234.5, "1,234 s"), (0.0, "0 s"),
])
def test_durations_read_in_their_unit(seconds, shown):
    from hetc.ir.units import human_seconds

    assert human_seconds(seconds) == shown


def test_compile_prints_a_long_step_in_seconds(tmp_path, capsys):
    """Item 5 (finding 5): `25095.02 ms/step` for a 25 s step."""
    assert hetc_main(["compile", str(_big_job(tmp_path, 8)), "-o", str(tmp_path / "plan")]) == 0
    out = capsys.readouterr().out
    assert "ms/step" not in out
    assert re.search(r"predicted 1\d\d s/step \(", out), out


# ---- item 1 (part): the step line and --metrics -------------------------------------------------------

def test_log_every_prints_a_line_per_n_steps_with_their_mean_loss(plans, as_rank0, tmp_path, capsys):  # noqa: F811
    """--log-every (Megatron-LM's --log-interval): a line every N steps and after the last, its loss the mean
    of its steps'; --metrics keeps every step."""
    from hetc.runtime.local import free_port

    metrics = tmp_path / "m.jsonl"
    os.environ["MASTER_PORT"] = str(free_port())
    assert hetc_main(["run", str(plans["demo"]), "--steps", "5", "--log-every", "2", "--metrics", str(metrics)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"], lines
    printed = [float(line.split()[3]) for line in lines]
    assert printed == pytest.approx([sum(losses[0:2]) / 2, sum(losses[2:4]) / 2, losses[4]], abs=6e-5), lines


def test_each_step_reports_lr_and_mfu_and_each_save_is_announced_once(plans, as_rank0, tmp_path, capsys):  # noqa: F811
    """Item 1 (finding 1): lr and MFU/HFU in the step line and the metrics; "saved step N to DIR" once."""
    from hetc.plandir import read_plan
    from hetc.runtime.local import free_port
    from hetc.runtime.optim import lr_at

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    os.environ["MASTER_PORT"] = str(free_port())
    assert hetc_main(["run", str(plans["demo"]), "--steps", "2", "--metrics", str(metrics),
                      "--checkpoint", str(ckpt), "--every", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if line.startswith("step ")]
    assert len(steps) == 2 and all(re.search(r"  lr \d\.\d\de-\d\d  .*  MFU \d+\.\d%  ", s) for s in steps), steps
    assert [line for line in out if line.startswith("saved ")] == [f"saved step {n} to {ckpt / f'step-{n}'}"
                                                                    for n in (1, 2)]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = read_plan(plans["demo"])[1].spec.train
    assert [r["lr"] for r in records] == [lr_at(train, 0), lr_at(train, 1)]
    assert all(0 < r["mfu"] <= r["hfu"] < 1 for r in records), records
