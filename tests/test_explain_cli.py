"""`hetc explain`: JSON fields, the text report, and its errors."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.passes.cost import schedule
from tests.conftest import DEMO, ROOT
from tests.costspecs import plan_text, write_spec
from tests.random_jobs import _node

EXPLICIT_DEMOS = ["single.het", "dp.het", "pp.het", "hetero.het", "zero3_offload.het", "interleaved.het",
                  "zb.het", "gpipe.het", "hsdp.het"]


def _json(capsys, *args) -> dict:
    assert main(["explain", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", EXPLICIT_DEMOS)
def test_json_fields(capsys, name):
    out = _json(capsys, str(DEMO / name))
    assert out["step_time_s"] > 0 and out["tokens_per_s"] > 0
    assert 0 < out["mfu"] <= out["hfu"] <= 1
    assert out["tokens_per_step"] == 8 * 32                      # global_batch × seq of the demo job
    ranks = {m["rank"] for m in out["memory"]}
    assert ranks and ranks == set(range(len(out["memory"])))
    for m in out["memory"]:
        parts = sum(m[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "reserve"))
        assert m["total"] == pytest.approx(parts) and m["capacity"] == 4 * 2**30
    for g in out["traffic"]:
        assert g["kind"] in {"dp", "pp", "tp", "cp"}
        assert g["bytes_per_step"] >= 0 and g["seconds_per_step"] >= 0
    assert out["time"]["pipeline_s"] <= out["estimate_step_s"] + 1e-12     # the closed form's parts


def _compiled_peaks(spec) -> dict:
    """Each rank's memory peak as compile's memory check walks the programs compile lowers from `spec`."""
    from hetc.compiler import load_checked
    from hetc.passes.cost import CostModel
    from hetc.passes.lower.by_class import lower_by_class
    from hetc.passes.verify.memory import rank_peaks

    _, checked = load_checked(spec)
    plan = checked.explicit()
    costs = CostModel(plan, None)
    return {p.rank: p for p in rank_peaks(lower_by_class(plan, costs).program, plan.pipeline, costs)}


@pytest.mark.parametrize("name", ["hetero.het", "zero3.het", "zb.het", "interleaved.het", "gpipe.het",
                                  "offload_act.het", "tied_pp.het", "moe_pp_ep2.het"])
def test_explains_memory_is_compiles_on_every_rank(capsys, name):
    """Note [one step time]: each rank's memory explain prints is its compiled program's peak, part by part
    (ZeRO-3's gathered parameters among the buffers), with the closed form's total beside it."""
    peaks = _compiled_peaks(DEMO / name)
    out = _json(capsys, str(DEMO / name))
    assert out["memory_source"] == "compiled" and {m["rank"] for m in out["memory"]} == set(peaks)
    for m in out["memory"]:
        parts = peaks[m["rank"]].parts
        assert m["total"] == pytest.approx(peaks[m["rank"]].total, rel=1e-9)
        assert m["activations"] == parts["activations"] and m["buffers"] == parts["gathered"] + parts["buffers"]
        assert m["estimate_total"] == pytest.approx(m["total"], rel=0.10)   # the planner's closed form


def test_the_step_is_the_compiled_programs_and_the_estimate_is_beside_it(capsys, tmp_path, monkeypatch):
    """Note [one step time]: explain prints the step `hetc compile` simulates, the closed form beside it; where
    the programs are too many to build in a moment it prints the closed form, and says so."""
    spec = str(DEMO / "interleaved.het")
    assert main(["compile", spec, "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    compiled = json.loads((tmp_path / "out" / "summary.json").read_text())["step_time_s"]
    out = _json(capsys, spec)
    assert out["step_source"] == "simulated" and out["step_time_s"] == pytest.approx(compiled, rel=1e-9)
    assert out["estimate_step_s"] == pytest.approx(compiled, rel=0.10)
    assert main(["explain", spec]) == 0
    assert "(the compiled programs, simulated; the closed-form estimate" in capsys.readouterr().out
    monkeypatch.setattr("hetc.passes.simulated_step.SIMULATED_OPS", 0)
    out = _json(capsys, spec)
    assert out["step_source"] == "estimate" and out["step_time_s"] == out["estimate_step_s"]
    assert main(["explain", spec]) == 0
    assert "simulated" not in capsys.readouterr().out


def test_plan_of_an_auto_spec_prints_the_step_compile_builds(capsys, tmp_path):
    """The planner's winner, as `hetc plan` prints it and `hetc compile` builds it: one step (Note [one step
    time]); the planner's own score stays the closed form's."""
    spec = str(ROOT / "specs" / "examples" / "auto_demo.het")
    assert main(["plan", spec, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["compile", spec, "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    compiled = json.loads((tmp_path / "out" / "summary.json").read_text())["step_time_s"]
    assert planned["step_source"] == "simulated"
    assert planned["step_time_s"] == pytest.approx(compiled, rel=1e-9)
    assert planned["estimate_step_s"] == pytest.approx(compiled, rel=0.10)
    assert planned["memory_source"] == "compiled"       # the same programs' peaks, as explain prints them
    explained = _json(capsys, str(tmp_path / "out" / "plan.het"))    # the plan compile wrote out
    assert [m["total"] for m in planned["memory"]] == pytest.approx([m["total"] for m in explained["memory"]])
    assert main(["plan", spec]) == 0
    summary = [ln for ln in capsys.readouterr().err.splitlines() if "fullest GPU" in ln]
    assert len(summary) == 1 and summary[0].endswith("and their memory peaks)"), summary   # not the estimate's


def test_text_report(capsys):
    assert main(["explain", str(DEMO / "hetero.het")]) == 0
    text = capsys.readouterr().out
    for needle in ("step time", "tokens/s", "MFU", "HFU", "memory per rank", "params", "optimizer",
                   "activations", "traffic per step", "pp  head_end -> middle", "layer times from"):
        assert needle in text


def test_the_report_gives_each_lanes_time_and_marks_the_one_that_paces(capsys):
    """demo hetero's middle stage has a lane of 3 microbatches and one of 1: two rows; the last stage's one lane
    serves both (Note [paced pipeline]) and is marked, as --json's bottleneck says."""
    out = _json(capsys, str(DEMO / "hetero.het"))
    assert main(["explain", str(DEMO / "hetero.het")]) == 0
    text = capsys.readouterr().out.splitlines()
    at = text.index("time per lane (closed form: a microbatch, and busy, its lane's step of them)")
    rows = [ln.split() for ln in text[at + 2:at + 6]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("head_end", "0", "4"), ("middle", "0", "3"), ("middle", "1", "1"),
                                                 ("tail", "0", "4")]
    assert text[at + 6] == ""
    marked = [r[0] for r in rows if r[-3:] == ["paces", "the", "pipeline"]]
    stage, _ = out["time"]["bottleneck"]
    assert marked == [["head_end", "middle", "tail"][stage]]


@pytest.mark.parametrize("dtype, line", [
    ("bf16", "gradients in fp32, parameters in bf16: summed and reduced in fp32"),
    ("bf16\n  grad_dtype = bf16", None), ("fp32", None)])
def test_the_report_says_where_gradients_are_wider_than_the_parameters(dtype, line, capsys, tmp_path):
    """A bf16 model's grads column holds fp32 gradients (Note [gradient dtype]): the report says so."""
    spec = write_spec(tmp_path, plan_text("  stage all {\n    layers = embed..head\n    ranks = n\n    lanes = 8\n  }",
                                          dtype=dtype))
    assert main(["explain", str(spec)]) == 0
    text = capsys.readouterr().out
    assert (line in text) if line else ("gradients in" not in text)


def test_a_peak_after_the_last_backward_says_what_activations_the_step_holds(capsys):
    """Megatron's 65B recipe under ZeRO-1 peaks after its last backward, where the reduced shard sits beside the
    full fp32 gradients and no activations are held: the activations column is 0, and the report says so and
    gives what the step holds, up to the first stage's warm-up, most on the first stage and least on the last."""
    spec = str(ROOT / "specs" / "examples" / "megatron_llama65b.het")
    memory = _json(capsys, spec)["memory"]
    assert all(m["activations"] == 0 for m in memory)
    held = [memory[r]["activations_in_step"] for r in (0, 16, 32, 48)]
    assert held == sorted(held, reverse=True) and held[-1] > 2**30
    assert main(["explain", spec]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if " A100-80 " in ln and "GiB" in ln]
    assert len(rows) == 4 and all("(peak after the last backward; " in ln for ln in rows)
    for m in _json(capsys, str(DEMO / "hetero.het"))["memory"]:
        assert m["activations"] > 0 and m["activations_in_step"] is None


def test_a_tied_embedding_on_two_stages_lists_its_sum_as_the_program_runs_it(capsys):
    """Megatron's embedding group: the tied copies on the first and the last stage are summed once a step, over
    the ranks of both stages, as the compiled programs' `all_reduce tied` runs it; traffic lists it (`emb`)."""
    from hetc.compiler import compile_spec

    traffic = _json(capsys, str(DEMO / "tied_hetero.het"))["traffic"]
    (tied,) = [g for g in traffic if g["kind"] == "emb"]
    ranks = compile_spec(DEMO / "tied_hetero.het").program.group("tied").ranks
    assert tuple(tied["ranks"]) == tuple(ranks) and len(ranks) == 3
    vocab, hidden, fp32 = 256, 64, 4      # the demo model's V × H, its gradients' dtype
    assert tied["bytes_per_step"] == pytest.approx(2 * 2 / 3 * vocab * hidden * fp32) and tied["seconds_per_step"] > 0
    assert not [g for g in _json(capsys, str(DEMO / "tied_single.het"))["traffic"] if g["kind"] == "emb"]


def test_auto_plan_is_an_error(tmp_path, capsys):
    spec = write_spec(tmp_path, plan_text("  schedule = auto", global_batch=8))
    assert main(["explain", str(spec)]) == 2
    assert "run `hetc plan" in capsys.readouterr().err


def test_bad_profile_is_an_error(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text('{"format": "something-else"}')
    assert main(["explain", str(DEMO / "pp.het"), "--profile", str(bad)]) == 2
    assert "not a hetc profile" in capsys.readouterr().err
    assert main(["explain", str(DEMO / "pp.het"), "--profile", str(tmp_path / "none.json")]) == 2
    assert "cannot find the profile" in capsys.readouterr().err
    assert main(["explain", str(DEMO / "pp.het"), "--profile", str(tmp_path)]) == 2
    assert "neither a Sailor data folder" in capsys.readouterr().err


def test_sailor_profile_and_fits_are_used(capsys, shared_data, tmp_path):
    sample = shared_data / "sailor/validation-samples/mit/N4/plan_config_N4_D2.json"
    out = tmp_path / "mit.het"
    assert main(["import", "sailor", "--data", str(shared_data / "sailor"), "--model", "OPT-350",
                 "--plan", str(sample), "-o", str(out)]) == 0
    with_data = _json(capsys, str(out), "--profile", str(shared_data / "sailor"))
    without = _json(capsys, str(out))
    assert with_data["sources"] and without["sources"]
    assert all("profile.json" in s for srcs in with_data["sources"].values() for s in srcs)
    assert all(s.startswith("arithmetic, ") and "of peak" in s for srcs in without["sources"].values() for s in srcs)
    assert with_data["step_time_s"] != without["step_time_s"]


def test_a_device_without_peak_or_profile_is_an_error(tmp_path, capsys):
    text = plan_text("  stage all {\n    layers = embed..head\n    ranks = n[0, 0]\n    lanes = 1\n  }\n"
                     "  idle = [n[0, 1:4], n[1]]", global_batch=4)
    text = text.replace('use "catalog.het"', 'device bare {\n  memory = 16 GiB\n}').replace("A100-40", "bare")
    spec = write_spec(tmp_path, text)
    assert main(["explain", str(spec)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"{spec}:1:1: error: device kind 'bare' declares no peak FLOP/s for fp32 and no profile "
                      "times it; add a peak { ... } block or a profile (hetc profile)")
    assert err[1] == "    device bare {"


# A hand-written ZB plan: three L40S lanes of stage s3 fed by two ZeRO-3 lanes in lockstep, three microbatches
# a lane; its in-flight limit is 3, but each round trip comes back before the lane's next input arrives, so
# the compiled lane holds 2 stashes. On 11 GiB devices the closed form (3 stashes) does not fit, compile does.
FED_BY_LOCKSTEP = """use "CATALOG"

device L40S_small {
  memory = 11 GiB
  peak {
    fp32 = 91.6 TFLOP/s
    tf32 = 183 TFLOP/s
    bf16 = 362 TFLOP/s
    fp16 = 362 TFLOP/s
  }
  host_link = 32 GB/s
  memory_bandwidth = 864 GB/s
  efficiency = 0.69
  sms = 142
}

model m2_7B {
  arch = llama
  layers = 32
  hidden = 2560
  heads = 20
  kv_heads = 20
  ffn = 6912
  vocab = 32000
  seq = 4096
  dtype = fp16
  activation_checkpoint = none
}

cluster mix {
NODES
  link g0 <-> g1 {
    bandwidth = 5 GB/s
    latency = 500 us
  }
  link east <-> west {
    bandwidth = 1 GB/s
    latency = 10 ms
  }
  inter_bandwidth = 100 Gb/s
  inter_latency = 30 us
}

train {
  global_batch = 8
  steps = 10
  lr = 3e-4
  grad_clip = 0
}

parallel {
  schedule = zb
  stage s0 {
    layers = embed..block7
    ranks = g1[:, 0]
    lanes = 1
  }
  stage s1 {
    layers = block8..block14
    ranks = g1[:, 1]
    lanes = 1
  }
  stage s2 {
    layers = block15..block18
    ranks = g0[:, 0:2]
    lanes = 2
    ministages = 4
    zero = 3
  }
  stage s3 {
    layers = block19..block25
    ranks = g0[:, 2:5]
    lanes = 3
    microbatches = [3, 3, 2]
    zero = 1
  }
  stage s4 {
    layers = block26..head
    ranks = g0[:, 5:8]
    lanes = 3
    microbatches = [3, 3, 2]
    zero = 1
  }
}
"""


def test_explain_prints_the_memory_compile_checks_and_its_verdict(capsys, tmp_path, monkeypatch):
    """Note [one step time]: explain's memory per rank is the compiled programs' peak, as compile's memory check
    walks them, with the closed form beside it; where the closed form counts a stash no lane holds, explain
    still says what compile says (it fits) instead of refusing the plan. Stage s3's lanes are fed by two
    lanes in turn, so they hold fewer microbatches than their limit (`schedule.chain_held`, Note [in-flight
    limit]); the closed form counted the limit before it counted the chain, and counts it here again."""
    spec = tmp_path / "fed.het"
    nodes = "\n".join(_node("g0", "L40S_small", 1, 8, "east") + _node("g1", "H100", 1, 2, "west"))
    spec.write_text(FED_BY_LOCKSTEP.replace("CATALOG", str(ROOT / "specs" / "catalog.het")).replace("NODES", nodes))
    chained = _json(capsys, str(spec))["memory"][2]
    assert chained["estimate_total"] == pytest.approx(chained["total"], rel=0.10)
    monkeypatch.setattr(schedule, "chain_held", lambda counts, limits: limits)
    assert main(["compile", str(spec), "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    peaks = _compiled_peaks(spec)
    out = _json(capsys, str(spec))
    assert out["memory_source"] == "compiled"
    assert [m["total"] for m in out["memory"]] == pytest.approx([peaks[m["rank"]].total for m in out["memory"]],
                                                               rel=1e-9)
    s3 = out["memory"][2]                     # stage s3's first lane
    assert s3["estimate_total"] > max(1.1 * s3["total"], s3["capacity"]) and s3["fits"]
    assert main(["explain", str(spec)]) == 0
    assert "(the compiled programs' peaks; the closed-form estimate's furthest rank +" in capsys.readouterr().out
    monkeypatch.setattr("hetc.passes.simulated_step.SIMULATED_OPS", 0)   # too large to lower: the closed form
    assert main(["explain", str(spec), "--json"]) == 2
    printed = json.loads(capsys.readouterr().out)
    assert printed["memory_source"] == "estimate" and not printed["fits"]
