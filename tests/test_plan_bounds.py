"""Bounded planning (issue 28, finding 11): a time limit the search honours, and a search whose size does not
grow with the model's length (Note [an anytime search], Note [a grid of layer counts])."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.plan import deadline as deadline_module
from hetc.passes.plan.grid import GRID_BLOCKS, grid_counts, layer_grain, residues, steps_down
from hetc.passes.plan.objective import Goal
from hetc.passes.plan.planner import plan_spec
from hetc.passes.plan.search import Search
from hetc.passes.plan.space import space_from_spec
from tests.conftest import ROOT, SPECS

JOB = SPECS / "demo" / "job.het"

# the demo job (its model, cluster and data) with a model `blocks` long, its plan left to the planner
LONG_MODEL = """use "{catalog}"

model demo {{
  arch = llama
  layers = {blocks}
  hidden = 64
  heads = 4
  kv_heads = 2
  ffn = 176
  vocab = 256
  seq = 32
  dtype = fp32
  optimizer adamw {{
    beta1 = 0.9
    beta2 = 0.95
    weight_decay = 0.1
  }}
}}

cluster local {{
  node host {{
    device = cpu
    count = 2
    gpus = 2
    intra {{
      bandwidth = 10 GB/s
      latency = 500 us
    }}
  }}
  inter_bandwidth = 5 GB/s
  inter_latency = 500 us
}}

train {{
  global_batch = 8
  micro_batch = 2
  steps = 30
  lr = 3e-3
  seed = 1234
  data text {{
    path = "{data}"
  }}
}}

parallel {{
  schedule = auto
}}
"""

# stages written, their layers left open: no baseline stands in for the search's plan
WRITTEN_STAGES = f'''use "{JOB}"

parallel {{
  schedule = auto
  stage first {{
    ranks = [host[0, 0], host[0, 1]]
    layers = auto
  }}
  stage last {{
    ranks = [host[1, 0], host[1, 1]]
    layers = auto
  }}
}}
'''


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.het"
    path.write_text(text)
    return path


def _long_model(tmp_path: Path, blocks: int) -> Path:
    return _write(tmp_path, LONG_MODEL.format(catalog=SPECS / "catalog.het", blocks=blocks,
                                              data=SPECS / "demo" / "data" / "tiny.txt"))


# ------------------------------------------------------------ the time limit


def test_a_10000_layer_plan_ends_within_its_time_limit_with_a_plan(tmp_path):
    """Finding 11: `hetc plan` of a 10,000-layer model ran 1,115 s at 12.8 GB without an end. With a time
    limit it prints a plan (the best found by then, with a note where the limit was reached)."""
    spec = _long_model(tmp_path, 10_000)
    out = tmp_path / "planned.het"
    run = subprocess.run([sys.executable, "-m", "hetc", "plan", str(spec), "-o", str(out), "--time-limit", "30"],
                         check=False, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"planned {spec}" in run.stdout
    assert "planned by hetc plan:" in out.read_text()
    assert main(["check", str(out)]) == 0


def test_nothing_found_within_the_limit_is_a_located_error(tmp_path, capsys):
    spec = _write(tmp_path, WRITTEN_STAGES)
    assert main(["plan", str(spec), "--time-limit", "0.001"]) == 2
    err = capsys.readouterr().err
    assert f"{spec}:3:1: error: no plan found within the planner's time limit: the time limit of 0.001 s" in err
    assert "allow it more time (--time-limit S)" in err
    assert "Traceback" not in err


def test_compile_takes_the_time_limit_for_a_spec_with_auto(tmp_path, capsys):
    spec = _write(tmp_path, WRITTEN_STAGES)
    assert main(["compile", str(spec), "-o", str(tmp_path / "out"), "--time-limit", "0.001"]) == 2
    assert f"{spec}:3:1: error: no plan found within the planner's time limit" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "soon"])
def test_a_time_limit_that_is_not_a_positive_number_is_a_usage_error(tmp_path, capsys, value):
    spec = _write(tmp_path, WRITTEN_STAGES)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(spec), "--time-limit", value])
    assert exit_.value.code == 2
    assert f"argument --time-limit: wants a positive number of seconds, not '{value}'" in capsys.readouterr().err


class _Ticks:
    """A clock that moves one second each time it is read: the deadline passes after a fixed number of looks,
    so a search cut short is the same search on every machine."""

    def __init__(self) -> None:
        self.now = itertools.count()

    def __call__(self) -> float:
        return float(next(self.now))


def test_a_search_cut_short_returns_the_best_plan_found_so_far_with_a_note(tmp_path, monkeypatch):
    spec = load_checked(_write(tmp_path, WRITTEN_STAGES), require_complete=True)[0]
    unlimited = plan_spec(spec.spec, None, spec.path.parent, time_limit_s=None)
    assert unlimited.time_limit_note is None
    ticks = _Ticks()
    monkeypatch.setattr(deadline_module, "monotonic", ticks)
    plan_spec(spec.spec, None, spec.path.parent, time_limit_s=1e9)
    looks = next(ticks.now)   # how often a whole search looks at the clock
    for limit in (looks // 4, looks // 2):
        monkeypatch.setattr(deadline_module, "monotonic", _Ticks())
        cut = plan_spec(spec.spec, None, spec.path.parent, time_limit_s=limit)
        assert cut.planned and cut.time_limit_note is not None
        assert f"the time limit of {limit:g} s" in cut.time_limit_note and "cut short" in cut.time_limit_note
        assert cut.step_time_s >= unlimited.step_time_s * (1 - 1e-9)   # never better than the whole search


def test_a_search_within_its_limit_is_the_search_without_one(tmp_path):
    spec = load_checked(_write(tmp_path, WRITTEN_STAGES), require_complete=True)[0]
    a = plan_spec(spec.spec, None, spec.path.parent, time_limit_s=None)
    b = plan_spec(spec.spec, None, spec.path.parent, time_limit_s=600)
    assert b.time_limit_note is None
    assert a.candidate == b.candidate and a.step_time_s == b.step_time_s


def test_plan_json_says_whether_the_limit_was_reached(tmp_path, capsys):
    import json

    spec = _write(tmp_path, WRITTEN_STAGES)
    assert main(["plan", str(spec), "--json", "--time-limit", "600"]) == 0
    planning = json.loads(capsys.readouterr().out)["planning"]
    assert planning["time_limit_s"] == 600 and planning["time_limit_reached"] is None


# ------------------------------------------------------------ the grid of layer counts


def test_the_grid_covers_every_sum_of_counts():
    assert layer_grain(GRID_BLOCKS) == 1 and layer_grain(GRID_BLOCKS + 1) == 2 and layer_grain(10_000) == 40
    assert steps_down(40) == [40, 20, 10, 5, 2, 1] and steps_down(1) == [1]
    units = 10_002
    assert residues([None, None, None], units, 40) == [0, 0, units % 40]
    assert residues([None, 7, None, 3], units, 40) == [0, 0, (units - 10) % 40, 0]
    counts = grid_counts(1, 200, 40, 2)
    assert list(counts) == [2, 42, 82, 122, 162]
    # two stages on the grid and the last with the remainder reach the units
    assert (units - 40 * 125) in grid_counts(1, units, 40, units % 40)


def test_the_search_weighs_a_bounded_number_of_layer_counts(tmp_path):
    """Finding 11's cause: the screen's bound took every layer count of every stage and summed fills over
    pairs of them (quadratic in the layers), and the windows of counts grew with the model. On the grid a
    stage weighs at most about GRID_BLOCKS counts, whatever the model's length."""
    _, checked = load_checked(_long_model(tmp_path, 4000), require_complete=True)
    job = checked.job()
    search = Search(job, None, space_from_spec(job), Goal.of(job.parallel.objective))
    assert search.grain == 16
    for idle, layout in itertools.islice(search.layouts(), 3):
        st = next(search.variants(idle, layout, search.space.schedules[:1], search.space.micro_batches[:1]))
        limits = search._limits(st)
        for s in range(len(st.layout)):
            assert len(search.counts(st, s, 1, limits[s])) <= GRID_BLOCKS + 1
        got = search.assign(st, full=False)
        assert got is not None
        assert sum(o.layers for o in got[0].options) == search.units
        assert all(len(t.by_layers()) <= 16 for t in got[1])   # a window of a few grid steps per stage
