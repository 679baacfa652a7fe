"""Time per class (Note [time classes]): `hetc run --metrics`, the simulator's split, `hetc calibrate`."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.ir.program import AllReduce, Backward, Forward, Recv, Send, Step, Tensor, Wait
from hetc.ir.timeline import TimeClass, Timeline, class_times
from tests.conftest import DEMO

CLASSES = {c.value for c in TimeClass}


def test_a_wait_counts_for_the_work_it_waits_for():
    instrs = [Forward(0, 0), Send(Tensor.ACT, 0, 0, peer_to=1, shape=(1, 2), handle=7),
              Recv(Tensor.GRAD, 0, 0, peer_from=1, shape=(1, 2)), Backward(0, 0), Wait(7),
              AllReduce(Tensor.GRADS, "dp", 0), Step(0)]
    split = class_times(instrs, [0.0, 1.0, 1.5, 4.0, 6.0, 6.5, 8.0], 9.0)
    assert split == {TimeClass.COMPUTE: 1.0 + 2.0, TimeClass.COMM_WAIT: 0.5 + 2.5 + 0.5 + 1.5,
                     TimeClass.OPTIMIZER: 1.0, TimeClass.OFFLOAD: 0.0}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "plan"
    assert main(["compile", str(DEMO / "single.het"), "-o", str(out)]) == 0
    return out


def test_the_prediction_is_split_by_class_within_each_ranks_step(tmp_path):
    out = tmp_path / "pp"
    assert main(["compile", str(DEMO / "pp.het"), "-o", str(out)]) == 0
    timeline = Timeline.from_json((out / "timeline.json").read_text())
    assert len(timeline.classes) == len(timeline.ranks)
    for split in timeline.classes:
        assert set(split) == CLASSES and min(split.values()) >= 0
        assert 0 < sum(split.values()) <= timeline.step_time * (1 + 1e-9)
        assert split["comm_wait"] > 0            # a pipeline's ranks wait for their neighbours


@pytest.mark.slow
def test_run_metrics_record_time_per_class_each_step(single, tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert main(["run", str(single), "--local", "--steps", "2", "--metrics", str(metrics), "--quiet"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]   # 1-based, as the console (Note [step numbers])
    for r in records:
        (split,) = r["class_times_s"]            # one rank
        assert set(split) == CLASSES and min(split.values()) >= 0
        assert sum(split.values()) <= r["step_time_s"]
        assert split["compute"] > 0 and split["optimizer"] > 0 and split["offload"] == 0


@pytest.mark.slow
def test_calibrate_lists_each_class_against_the_prediction(single, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    assert main(["calibrate", str(single), "--steps", "2", "--json", "--metrics", str(metrics)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [c["class"] for c in got["classes"]] == [c.value for c in TimeClass]
    predicted = json.loads((single / "summary.json").read_text())["step_time_s"]
    assert got["predicted_step_s"] == pytest.approx(predicted)
    assert all(c["measured_s"] >= 0 and c["predicted_s"] >= 0 for c in got["classes"])
    assert got["most_off"] in CLASSES
    # the run's metrics, compared again without running: the same figures, as a table
    assert main(["calibrate", str(single), "--measured", str(metrics), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["classes"] == got["classes"] and again["measured"] == f"the run of {metrics}"
    assert main(["calibrate", str(single), "--measured", str(metrics)]) == 0
    out = capsys.readouterr()
    table = out.out.splitlines()
    # compiled without a profile: the note says how to make and use one
    assert "no measured profile (the catalog's arithmetic; `hetc profile SPEC -o FILE` measures this machine, " \
           "--profile FILE predicts with it)" in out.err
    assert table[0].startswith(f"{single}: the run of {metrics}; ")
    assert [line.split()[0] for line in table[2:7]] == [c.value for c in TimeClass] + ["step"]
    assert table[7].startswith("most off: ")


def test_calibrate_measured_refuses_what_is_not_a_metrics_file(single, tmp_path, capsys):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"step": 1}\n')
    assert main(["calibrate", str(single), "--measured", str(bad)]) == 2
    assert f"{bad}: no step with class_times_s" in capsys.readouterr().err
    assert main(["calibrate", str(single), "--measured", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    assert main(["calibrate", str(single), "--measured", str(bad), "--metrics", str(bad)]) == 2
    assert "--measured names the metrics of a run made before" in capsys.readouterr().err


_STEP = {"step": 2, "step_time_s": 0.5, "class_times_s": [{"compute": 0.2, "comm_wait": 0.1}]}


@pytest.mark.parametrize("line, says", [
    ("[1]", ":2: expected one JSON object a line, got list"),
    ("{", ":2: not JSON"),
    (json.dumps({**_STEP, "class_times_s": ["x"]}), ":2: class_times_s must list one object a rank"),
    (json.dumps({**_STEP, "class_times_s": 3}), ":2: class_times_s must list one object a rank"),
    (json.dumps({**_STEP, "class_times_s": [{"compute": "fast"}]}), ":2: class_times_s must list"),
    (json.dumps({**_STEP, "class_times_s": [{"offload": -1}]}), ":2: class_times_s must list"),
    (json.dumps({**_STEP, "step_time_s": None}), ":2: step_time_s must be seconds"),
    (json.dumps({**_STEP, "step_time_s": [0.5]}), ":2: step_time_s must be seconds"),
])
def test_a_metrics_line_of_the_wrong_shape_is_named_where(single, tmp_path, capsys, line, says):
    bad = tmp_path / "m.jsonl"
    bad.write_text(json.dumps(_STEP) + "\n" + line + "\n")
    assert main(["calibrate", str(single), "--measured", str(bad)]) == 2
    assert f"{bad}{says}" in capsys.readouterr().err


def test_calibrate_refuses_what_is_not_a_plan_directory(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path)]) == 2
    assert "is not a plan directory" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path), "--steps", "0"]) == 2


def test_viz_compare_shows_the_gap_per_class_from_a_metrics_file(single, tmp_path, capsys):
    split = [{"compute": c, "comm_wait": 0.001, "optimizer": 0.002, "offload": 0.0} for c in (0.5, 0.02, 0.04, 0.03)]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "step_time_s": s["compute"] + 0.004, "class_times_s": [s]})
                               + "\n" for i, s in enumerate(split, start=1)))
    page = tmp_path / "page.html"
    argv = ["viz", str(single), "--compare", "--trace", str(single / "timeline.json"), "--metrics", str(metrics)]
    assert main([*argv, "--text"]) == 0
    table = capsys.readouterr().out.split("time per class, mean per rank, one step:\n")[1]
    rows = {line.split()[0]: line.split() for line in table.splitlines()}
    assert rows["compute"][2] == "30.000"           # the median of the steps after the first, in ms
    assert rows["optimizer"][2] == "2.000" and rows["step"][2] == "34.000"
    assert main([*argv, "-o", str(page)]) == 0
    html = page.read_text()
    assert "Time per class" in html and "30.000 ms" in html
    assert main(["viz", str(single), "--metrics", str(metrics)]) == 2   # --metrics goes with --compare
