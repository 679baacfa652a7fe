"""Dropout (`hidden_dropout`, `attention_dropout`): what runs, and which ranks draw which masks.

Note [dropout streams] in runtime/nn/dropout.py says what must hold: the
ranks holding a tensor whole draw one mask, parts draw their own,
recomputation replays, a step's masks depend on the step alone. The lane
cases (tp, sequence parallelism, Ulysses) are in tests/test_parallel_kernels.py;
here the streams themselves, the cores, evaluation, and whole plans: a
1-rank plan with dropout trains to the 1-process reference's losses under
every way of keeping activations, and a tp plan resumed from a checkpoint
draws what the uninterrupted run drew.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hetc.ir.spec import Arch, AttentionKind, Checkpointing, DType, ModelSpec
from hetc.plandir import read_plan
from hetc.runtime.nn.attention import causal_attention, unfused_causal_attention
from hetc.runtime.nn.dropout import dropout, seed_step
from hetc.runtime.nn.model import build_ministage
from hetc.runtime.reference import train_reference
from tests.conftest import DEMO, REFERENCE_STEPS, demo_job
from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, compile_plans

SAVED_AT = 2


def _model(**fields) -> ModelSpec:
    return ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, ffn=40, vocab=64, seq=16, dtype=DType.FP32,
                     hidden_dropout=0.3, attention_dropout=0.3, **fields)


def _loss(module, seed_at: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    seed_step(7, seed_at, 0)
    return module(tokens, tokens.roll(-1, dims=1))


def test_whole_tensors_draw_one_mask_and_parts_their_own():
    x = torch.ones(64, 64)
    draws = []
    for part in (0, 1):             # two ranks sharing a stream, holding parts 0 and 1
        seed_step(7, 3, 0)
        whole = dropout(x, 0.5, True)
        mine = dropout(x, 0.5, True, part=part)
        after = dropout(x, 0.5, True)
        draws.append((whole, mine, after))
    (w0, p0, a0), (w1, p1, a1) = draws
    assert torch.equal(w0, w1) and torch.equal(a0, a1), "the shared stream parted"
    assert not torch.equal(p0, p1), "two parts drew one mask"
    assert not torch.equal(w0, a0)


def test_a_steps_masks_depend_on_the_step_alone():
    x = torch.ones(64, 64)
    seed_step(7, 3, 0)
    first = dropout(x, 0.5, True)
    seed_step(7, 4, 0)
    dropout(x, 0.5, True)
    seed_step(7, 3, 0)
    assert torch.equal(dropout(x, 0.5, True), first)
    seed_step(7, 3, 1)              # another lane position's stream
    assert not torch.equal(dropout(x, 0.5, True), first)


def test_dropout_is_the_identity_at_zero_and_in_evaluation():
    x = torch.randn(8, 8)
    assert dropout(x, 0.0, True) is x and dropout(x, 0.5, False) is x


@pytest.mark.parametrize("core", [causal_attention, unfused_causal_attention])
def test_both_cores_drop_attention_probabilities(core):
    q, k, v = (torch.randn(1, heads, 16, 8, generator=torch.Generator().manual_seed(heads)) for heads in (4, 2, 2))
    plain = core(q, k, v)
    torch.manual_seed(0)
    assert not torch.allclose(core(q, k, v, 0.5), plain)


@pytest.mark.parametrize("arch", [Arch.LLAMA, Arch.GPT])
@pytest.mark.parametrize("attention", [AttentionKind.FLASH, AttentionKind.UNFUSED])
def test_recomputation_replays_the_masks(arch, attention):
    runs = {}
    for checkpoint in Checkpointing:
        model = _model(arch=arch, attention=attention, activation_checkpoint=checkpoint)
        module = build_ministage(model, range(model.num_model_layers), seed=3)
        loss = _loss(module)
        loss.backward()
        runs[checkpoint] = loss.detach(), {n: p.grad for n, p in module.named_parameters()}
    loss, grads = runs[Checkpointing.NONE]
    for checkpoint, (other, other_grads) in runs.items():
        assert torch.equal(other, loss), checkpoint
        assert all(torch.equal(other_grads[n], grads[n]) for n in grads), checkpoint


def test_evaluation_drops_nothing_and_training_does():
    model = _model()
    module = build_ministage(model, range(model.num_model_layers), seed=3)
    plain = dataclasses.replace(model, hidden_dropout=0.0, attention_dropout=0.0)
    without = build_ministage(plain, range(plain.num_model_layers), seed=3)
    with torch.no_grad():
        assert not torch.equal(_loss(module), _loss(without))
        module.eval()
        assert torch.equal(_loss(module), _loss(without))


# ---------------------------------------------------------------- whole plans

ONE_RANK = """use "job.het"

parallel {{
{extra}
  stage all {{
    layers = embed..head
    ranks = host[0, 0]
    lanes = 1
{stage_extra}
  }}
  idle = [host[0, 1], host[1]]
}}
"""
PLANS = {
    "single": ONE_RANK.format(extra="", stage_extra=""),
    "full": ONE_RANK.format(extra="", stage_extra="    activation_checkpoint = full"),
    "selective": ONE_RANK.format(extra="", stage_extra="    activation_checkpoint = selective"),
    "offload_act": ONE_RANK.format(extra="  offload {\n    activations = cpu\n  }", stage_extra=""),
    "tp2": (DEMO / "tp2.het").read_text(),
}


def _dropout_job(folder: Path) -> None:
    """The demo job with GPT-3's dropouts, beside the plans that import it."""
    (folder / "job.het").write_text(demo_job(("  seq = 32\n",
                                              "  seq = 32\n  hidden_dropout = 0.1\n  attention_dropout = 0.1\n")))


@pytest.fixture(scope="module")
def dropout_plans(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("dropout_specs")
    _dropout_job(folder)
    specs = []
    for name, text in PLANS.items():
        (folder / f"{name}.het").write_text(text)
        specs.append(folder / f"{name}.het")
    return compile_plans(specs, tmp_path_factory.mktemp("dropout_plans"))


@pytest.fixture(scope="module")
def dropout_reference(dropout_plans, demo_reference):
    _, checked = read_plan(dropout_plans["single"])
    reference = train_reference(checked.spec.model, checked.spec.train, base_dir=dropout_plans["single"],
                                steps=REFERENCE_STEPS)
    assert reference.losses != demo_reference.losses, "the dropout job trained as the plain one"
    return reference


@pytest.mark.parametrize("plan", ["single", "full", "selective", "offload_act"])
def test_a_one_rank_plan_with_dropout_trains_to_the_reference(plan, rank_pool, dropout_plans, dropout_reference):
    losses = agreed_losses(rank_pool.run(PlanJob(dropout_plans[plan], REFERENCE_STEPS)))
    assert_losses_close(losses, dropout_reference.losses)


def test_a_resumed_tp_run_draws_the_masks_of_the_uninterrupted_one(rank_pool, dropout_plans, tmp_path):
    plan = dropout_plans["tp2"]
    straight = agreed_losses(rank_pool.run(PlanJob(plan, REFERENCE_STEPS)))
    agreed_losses(rank_pool.run(PlanJob(plan, SAVED_AT, save_to=tmp_path / "first")))
    resumed = agreed_losses(rank_pool.run(PlanJob(plan, REFERENCE_STEPS, resume_from=tmp_path / "first")))
    assert resumed == straight[SAVED_AT:]
