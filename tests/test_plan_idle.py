"""`hetc plan` says why it leaves a node group idle (passes/plan/idle.py), in its text and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from hetc.cli import main
from hetc.frontend.load import load_spec
from hetc.passes.plan.planner import plan_spec

# Four H100s in one node and one T4 in another: the T4 is far too slow to be worth a stage of its own.
JOB = """use "catalog.het"

model m {{
  arch = llama
  layers = {layers}
  hidden = {hidden}
  heads = {heads}
  ffn = {ffn}
  vocab = {vocab}
  seq = 1024
}}

cluster c {{
  node h100 {{
    device = H100
    count = 1
    gpus = 4
  }}
  node slow {{
    device = {slow}
    count = 1
    gpus = 1
  }}
}}

train {{
  global_batch = 16
  micro_batch = 1
  steps = 10
}}

parallel {{
  schedule = zb
{extra}}}
"""
SMALL = {"layers": 8, "hidden": 2048, "heads": 16, "ffn": 5504, "vocab": 32000}
# a layer of this model needs about 16 GiB of states: nothing of it fits on a V100-16 without offload
LARGE = {"layers": 4, "hidden": 8192, "heads": 64, "ffn": 28672, "vocab": 128000}


def _write(tmp_path: Path, slow: str, model: dict[str, int], extra: str = "") -> Path:
    path = tmp_path / "job.het"
    path.write_text(JOB.format(slow=slow, extra=extra, **model))
    return path


def test_a_slow_group_gets_its_line_in_text_and_json(tmp_path, capsys):
    path = _write(tmp_path, "T4", SMALL)
    result = plan_spec(load_spec(path).spec, base_dir=tmp_path)
    assert result.candidate is not None and result.candidate.idle == ("slow",)
    (reason,) = result.idle
    assert reason.group == "slow" and reason.kind in ("slow", "link", "overall")
    # the search's own numbers: the best plan that uses the T4 is slower than the chosen one
    assert result.score is not None and reason.step_time_s is not None
    assert reason.step_time_s > result.score.step_time_s
    assert main(["plan", str(path)]) == 0
    text = capsys.readouterr().err   # the summary; the planned spec is stdout
    assert f"    idle slow: {reason.text}\n" in text
    assert "stage s0 on slow" in reason.text or "slower overall" in reason.text
    assert main(["plan", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["plan"]["idle_reasons"]
    assert got == [{"group": "slow", "kind": reason.kind, "why": reason.text, "step_time_s": reason.step_time_s}]


def test_a_group_nothing_fits_on_is_named_with_memory(tmp_path):
    path = _write(tmp_path, "V100-16", LARGE, "  offload {\n  }\n")
    result = plan_spec(load_spec(path).spec, base_dir=tmp_path)
    (reason,) = result.idle
    assert reason.group == "slow" and reason.kind == "memory"
    assert "on slow[0, 0] (V100-16, 16.00 GiB)" in reason.text


def test_a_written_idle_group_says_so(tmp_path):
    path = _write(tmp_path, "T4", SMALL, "  idle = [slow]\n")
    result = plan_spec(load_spec(path).spec, base_dir=tmp_path)
    assert [(r.group, r.kind) for r in result.idle] == [("slow", "written")]



def test_a_memory_reason_names_the_gpu_that_does_not_fit_where_the_groups_own_do(tmp_path):
    """The closest plan that uses the group can fail on another kind's GPUs: the reason names that GPU, not the
    group's own fullest one, which fits (the three-kind Llama-70B job left its H100s idle for an L4 over its
    24 GB and said an H100 needed 73.98 of its 80 GiB)."""
    from dataclasses import replace

    from hetc.ir.topology import Topology
    from hetc.passes.plan.idle import _memory
    from hetc.passes.plan.structures import Found, Structures

    path = _write(tmp_path, "T4", SMALL)
    result = plan_spec(load_spec(path).spec, base_dir=tmp_path)
    assert result.score is not None and result.candidate is not None
    search = Structures.__new__(Structures)    # `_memory` reads only the cluster's GPUs
    search.topo = Topology.of(load_spec(path).spec)
    first = {g.group: i for i, g in reversed(list(enumerate(search.topo.gpus)))}
    base = result.score.memory[0]
    mem = (replace(base, params=base.params + 0.9 * base.capacity - base.total),   # the h100s: 90 % full, fit
           replace(base, capacity=16 * 2**30, params=base.params + 20 * 2**30))   # slow: over its 16 GiB
    closest = Found(result.candidate, replace(result.score, memory=mem,
                                              classes=((first["h100"],), (first["slow"],))), None)
    reason = _memory(search, "h100", closest)
    assert reason.kind == "memory" and "on slow[0, 0]" in reason.text, reason.text



def test_a_large_search_scores_leaving_a_kind_idle_exactly(tmp_path):
    """Note [every idle set screened] (passes/plan/search.py): on Llama-3-70B over 8 H100 + 8 A100-40 + 96 L4
    the assignment model ranked every layout using all three kinds above any leaving the H100s idle, and the
    search printed 81.9 s where the H100s idle run 73.1 s. Each idle set's best layout now reaches the exact
    scores: the plan printed is no slower than the one written with the H100s idle. (Since the GEMM curve the
    H100s idle run 156 s and the job plans 72.0 s with that screen or without it: the test holds the property,
    no longer the screen. 4 H100 + 8 A100-40 + 96 L4 breaks the property today, 87.0 s printed against 74.0 s
    with the A100s written idle: the quick look, at tp 1, places none of that idle set's 20 layouts, so one
    of them reaches the layouts screen, which places it under none of its knobs; the plan found with the A100s
    written idle runs tp 2 on another layout.)"""
    from tests.llama_jobs import llama_two_regions

    text = llama_two_regions("70b", 8, 8, 96, 192, activation_checkpoint="auto", grad_dtype="bf16")   # fits all
    steps = []
    for name, spec in (("free.het", text), ("idle.het", text.replace("parallel {", "parallel {\n  idle = [h100]", 1))):
        path = tmp_path / name
        path.write_text(spec)
        steps.append(plan_spec(load_spec(path).spec, base_dir=tmp_path).step_time_s)
    free, h100_idle = steps
    assert free <= h100_idle * (1 + 1e-9), (free, h100_idle)


def test_a_slow_stage_is_placed_by_the_border_it_feeds_or_the_last_stage_by_the_one_that_feeds_it():
    """`_border` reads only the candidate's layer ranges and the model's layer names: a first or middle stage
    feeds the border after it; the last stage feeds none, so its reason names the border it takes in."""
    from types import SimpleNamespace

    from hetc.passes.plan.idle import _border

    model = SimpleNamespace(layer_name=lambda i: {0: "embed", 9: "head"}.get(i, f"block{i - 1}"))
    search = SimpleNamespace(model=model)
    three = SimpleNamespace(stages=[None] * 3, ranges=[[(0, 3)], [(3, 6)], [(6, 10)]])
    assert _border(search, three, 1) == ("it would feed", "feed", "the border s1 -> s2 (block4 | block5)")
    assert _border(search, three, 2) == ("that would feed it", "take in", "the border s1 -> s2 (block4 | block5)")
    one = SimpleNamespace(stages=[None], ranges=[[(0, 10)]])
    assert _border(search, one, 0)[2] == "the whole model (one stage)"
