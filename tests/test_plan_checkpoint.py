"""Activation checkpointing per stage, and the planner choosing it (`activation_checkpoint = auto`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetc.compiler import compile_spec, load_checked
from hetc.ir.errors import SpecError
from hetc.frontend.load import load_spec
from hetc.passes.cost import CostModel
from hetc.passes.plan.planner import PlanResult, plan_spec
from hetc.ir.program import Phase
from hetc.runtime.nn.attention import Attention
from hetc.runtime.setup import build_buffers
from hetc.ir.spec import Checkpointing
from tests.conftest import DEMO

# A 0.9B llama on one A100-40: at the written micro-batch of 16 its activations (about 36 GiB without
# recomputation) do not fit beside its 14 GiB of states; on an H200 at a micro-batch of 2 they do, with room.
JOB = """use "catalog.het"

model m {{
  arch = llama
  layers = 16
  hidden = 2048
  heads = 16
  ffn = 5504
  vocab = 32000
  seq = 2048
  activation_checkpoint = {level}
}}

cluster c {{
  node a {{
    device = {device}
    count = 1
    gpus = 1
  }}
}}

train {{
  global_batch = 32
  micro_batch = {micro_batch}
  steps = 10
}}

parallel {{}}
"""


def _plan(tmp_path: Path, level: str, device: str, micro_batch: int) -> PlanResult:
    path = tmp_path / f"{level}-{device}-{micro_batch}.het"
    path.write_text(JOB.format(level=level, device=device, micro_batch=micro_batch))
    return plan_spec(load_spec(path).spec, base_dir=tmp_path)


def _levels(result: PlanResult) -> list[Checkpointing]:
    pipeline = result.plan.pipeline
    assert pipeline is not None
    return [st.checkpoint for st in pipeline.stages]


def test_selective_wins_where_activations_press_on_memory(tmp_path):
    """Memory-bound: without recomputation the plan must offload activations; full recomputation repeats
    every block's forward; selective repeats only the attention core, and the planner chooses it."""
    chosen = _plan(tmp_path, "auto", "A100-40", 16)
    assert _levels(chosen) == [Checkpointing.SELECTIVE]
    for level in ("none", "full"):
        fixed = _plan(tmp_path, level, "A100-40", 16)
        assert fixed.step_time_s > chosen.step_time_s, level
    # the planned spec writes the level on the stage and plans to itself
    assert chosen.spec.parallel is not None and chosen.spec.parallel.stages
    assert [st.activation_checkpoint for st in chosen.spec.parallel.stages] == [Checkpointing.SELECTIVE]


def test_none_wins_with_memory_to_spare(tmp_path):
    """Plenty of memory: recomputation only costs time, so the planner recomputes nothing."""
    chosen = _plan(tmp_path, "auto", "H200", 2)
    assert _levels(chosen) == [Checkpointing.NONE]
    selective = _plan(tmp_path, "selective", "H200", 2)
    assert selective.step_time_s > chosen.step_time_s


def test_a_stage_overrides_the_models_level(tmp_path):
    """A stage's own key wins over the model's, in the resolved stage and in the cost model: the stage that
    recomputes everything keeps less and takes longer than the same stage recomputing nothing."""
    _, checked = load_checked(DEMO / "recompute.het")
    p = checked.pipeline
    assert p is not None and checked.topology is not None
    assert [st.checkpoint for st in p.stages] == [Checkpointing.SELECTIVE, Checkpointing.FULL]
    source = (DEMO / "recompute.het").read_text()
    plain = tmp_path / "plain.het"
    plain.write_text(source.replace('use "job.het"', f'use "{DEMO / "job.het"}"')
                     .replace("    activation_checkpoint = full\n", ""))
    _, none = load_checked(plain)
    assert none.pipeline is not None and none.topology is not None
    assert [st.checkpoint for st in none.pipeline.stages] == [Checkpointing.SELECTIVE, Checkpointing.NONE]
    full_cm = CostModel(checked.explicit())
    none_cm = CostModel(none.explicit())
    last = p.stages[1].ranks[0]
    ms = p.stages[1].ministages[0]
    assert full_cm.activation_bytes(ms, last) < none_cm.activation_bytes(ms, last)
    assert full_cm.compute_time(last, ms, Phase.BACKWARD) > none_cm.compute_time(last, ms, Phase.BACKWARD)


def test_a_stage_left_auto_is_planned(tmp_path):
    """`activation_checkpoint = auto` on a written stage is filled by the planner; the others stay."""
    source = (DEMO / "recompute.het").read_text().replace('use "job.het"', f'use "{DEMO / "job.het"}"')
    path = tmp_path / "auto_stage.het"
    path.write_text(source.replace("activation_checkpoint = full", "activation_checkpoint = auto"))
    result = plan_spec(load_spec(path).spec, base_dir=tmp_path)
    assert result.planned
    assert _levels(result)[0] is Checkpointing.SELECTIVE   # written, kept
    assert _levels(result)[1] is Checkpointing.NONE        # the demo's memory is ample: nothing recomputed


def test_an_unknown_level_is_a_located_error(tmp_path):
    source = (DEMO / "recompute.het").read_text().replace('use "job.het"', f'use "{DEMO / "job.het"}"')
    path = tmp_path / "bad.het"
    path.write_text(source.replace("activation_checkpoint = full", "activation_checkpoint = fullest"))
    with pytest.raises(SpecError) as err:
        load_checked(path)
    assert "fullest" in str(err.value)


def test_each_ministage_is_built_with_its_stages_level():
    """The runtime builds every ministage's module with its own stage's level: the first stage recomputes its
    attention cores (selective), the second whole blocks (full)."""
    _, checked = load_checked(DEMO / "recompute.het")
    p = checked.pipeline
    assert p is not None
    program = compile_spec(DEMO / "recompute.het").program
    for stage, (full, selective) in zip(p.stages, [(False, True), (True, False)]):
        for ms, buffers in build_buffers(program, checked.explicit(), stage.ranks[0], torch.device("cpu")).items():
            module = buffers.module
            assert module.full_checkpoint is full, (stage.name, ms)
            cores = [m.recompute_core for m in module.modules() if isinstance(m, Attention)]
            assert cores and all(core is selective for core in cores), (stage.name, ms)
