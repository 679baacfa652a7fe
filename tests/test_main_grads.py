"""A bf16 model accumulates and reduces its gradients in fp32 (Note [gradient dtype] in hetc/ir/spec.py,
Note [main gradients] in runtime/flat.py), as Megatron-LM's main_grad and torchtitan's reduce_dtype do."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from hetc.compiler import load_checked
from hetc.ir.spec import DType
from hetc.plandir import read_plan
from hetc.runtime.flat import FlatParams, fold_main_grads
from hetc.runtime.nn.split_backward import backward_input, backward_weight
from hetc.runtime.checkpoint import latest_checkpoint, read_params
from hetc.runtime.reference import ReferenceResult, train_reference
from tests.conftest import DEMO, REFERENCE_STEPS, demo_job
from tests.costspecs import write_spec
from tests.rank_pool import PlanJob, agreed_losses, assert_losses_close, assert_params_close, compile_plans

MICROBATCHES = 64
ONE_RANK = "parallel {\n  stage all {\n    layers = embed..head\n    ranks = host[0, 0]\n  }\n}\n"


def _module(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).to(dtype)


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=gen).to(torch.bfloat16) for _ in range(MICROBATCHES)]


def _each_microbatch_gradient() -> list[torch.Tensor]:
    """Each microbatch's bf16 gradient on its own, flattened as FlatParams lays them out."""
    module = _module(torch.bfloat16)
    grads = []
    for x in _inputs():
        module.zero_grad(set_to_none=True)
        module(x).square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]))
    return grads


def test_bf16_gradients_are_summed_in_fp32_main_grads():
    """Over 64 microbatches the fp32 buffer holds exactly the fp32 sum of each microbatch's bf16 gradient
    (a bf16 buffer rounds every partial sum to 8 bits of mantissa, and differs), and no bf16 `.grad` is left."""
    module = _module(torch.bfloat16)
    flat = FlatParams(module, dtype=torch.bfloat16, grad_dtype=torch.float32)
    for x in _inputs():
        module(x).square().mean().backward()
    expected = torch.zeros(flat.layout.padded_numel)
    for g in _each_microbatch_gradient():
        expected[:g.numel()] += g.float()
    assert flat.grad.dtype is torch.float32
    assert torch.equal(flat.grad, expected)
    assert all(p.grad is None for p in module.parameters())
    rounded = torch.zeros_like(expected, dtype=torch.bfloat16)
    for g in _each_microbatch_gradient():
        rounded[:g.numel()] += g
    assert not torch.equal(rounded.float(), expected)   # what the old bf16 buffer held


def test_a_zero_bubble_weight_step_adds_into_the_main_grads():
    """torch's stage_backward_weight assigns `.grad` itself, past the hooks: folded as the interpreter does
    after each W, its gradients land in the fp32 buffer, equal to a whole backward's."""
    whole, split = _module(torch.bfloat16), _module(torch.bfloat16)
    flat_whole = FlatParams(whole, dtype=torch.bfloat16, grad_dtype=torch.float32)
    flat_split = FlatParams(split, dtype=torch.bfloat16, grad_dtype=torch.float32)
    for x in _inputs()[:3]:
        whole(x.clone().requires_grad_()).square().mean().backward()
        x = x.clone().requires_grad_()
        out = split(x).square().mean()
        backward_weight(split, backward_input(out, None, x, split))
        fold_main_grads(split)
    assert torch.equal(flat_split.grad, flat_whole.grad) and flat_split.grad.abs().sum() > 0
    assert all(p.grad is None for p in split.parameters())


@pytest.mark.parametrize("dtype, grads", [("bf16", DType.FP32), ("fp32", DType.FP32),
                                          ("tf32", DType.FP32), ("fp16", DType.FP16),
                                          ("bf16\n  grad_dtype = bf16", DType.BF16),
                                          ("fp16\n  main_grads_dtype = fp32", DType.FP32)])
def test_gradients_are_fp32_for_bf16_as_megatron_and_the_training_dtype_otherwise(dtype, grads, tmp_path):
    """Megatron-LM: --bf16 forces fp32 gradient accumulation and reduction; fp16 keeps fp16 gradients under
    its loss scale unless asked (--accumulate-allreduce-grads-in-fp32)."""
    _, checked = load_checked(write_spec(tmp_path, demo_job(("dtype = fp32", f"dtype = {dtype}")) + ONE_RANK))
    assert checked.spec.model.gradient_dtype is grads


BF16_PLANS = ("zb", "zero2", "zero3", "hsdp")


@pytest.fixture(scope="module")
def bf16_plans(tmp_path_factory) -> dict[str, Path]:
    """Demo plans of the demo job in bf16: the plan files' `use` points at a bf16 copy of job.het."""
    root = tmp_path_factory.mktemp("bf16")
    (root / "job.het").write_text(demo_job(("dtype = fp32", "dtype = bf16")))
    specs = []
    for name in BF16_PLANS:
        specs.append(root / f"{name}.het")
        specs[-1].write_text((DEMO / f"{name}.het").read_text())
    return compile_plans(specs, root / "plans")


@pytest.fixture(scope="module")
def bf16_references(bf16_plans) -> tuple[ReferenceResult, ReferenceResult]:
    """The one-rank reference of the bf16 job with fp32 gradients (its default), and with bf16 ones."""
    plan_dir = bf16_plans[BF16_PLANS[0]]
    _, checked = read_plan(plan_dir)
    model, train = checked.spec.model, checked.spec.train
    return tuple(train_reference(m, train, base_dir=plan_dir, steps=REFERENCE_STEPS)    # type: ignore[return-value]
                 for m in (model, dataclasses.replace(model, grad_dtype=DType.BF16)))


@pytest.mark.parametrize("plan", BF16_PLANS)
def test_bf16_plans_train_as_the_reference_with_fp32_gradients(plan, bf16_plans, bf16_references, rank_pool,
                                                               tmp_path):
    """Pipelines (zero-bubble's split backward), ZeRO-2 and 3 (fp32 buffers released and allocated again) and
    hierarchical ZeRO (fp32 reduced shards across nodes) train a bf16 model to the one-rank reference with fp32
    gradients, losses and parameters, and not to the one with bf16 gradients."""
    fp32_grads, bf16_grads = bf16_references
    losses = agreed_losses(rank_pool.run(PlanJob(bf16_plans[plan], REFERENCE_STEPS, save_to=tmp_path)))
    assert_losses_close(losses, fp32_grads.losses)
    assert_params_close(latest_checkpoint(tmp_path), fp32_grads.params)
    assert losses != pytest.approx(bf16_grads.losses, rel=1e-6, abs=0)


def test_an_fp16_model_asked_for_fp32_gradients_trains_under_its_loss_scale_as_one_rank(rank_pool, tmp_path):
    """fp16 with `main_grads_dtype = fp32` (Megatron-LM's --fp16 --accumulate-allreduce-grads-in-fp32): scaled
    fp16 gradients summed into fp32 buffers and unscaled there, under ZeRO-2 as on one rank (the one-rank
    reference trains without the loss scale, whose fp16 gradients underflow elsewhere)."""
    job = demo_job(("dtype = fp32", "dtype = fp16\n  main_grads_dtype = fp32"), ("lr = 3e-3", "lr = 3e-3\n  grad_clip = 1.0"))
    (tmp_path / "job.het").write_text(job)
    for name in ("single", "zero2"):
        (tmp_path / f"{name}.het").write_text((DEMO / f"{name}.het").read_text())
    dirs = compile_plans([tmp_path / "single.het", tmp_path / "zero2.het"], tmp_path / "plans")
    _, checked = read_plan(dirs["zero2"])
    assert checked.spec.model.gradient_dtype is DType.FP32
    one = agreed_losses(rank_pool.run(PlanJob(dirs["single"], REFERENCE_STEPS, save_to=tmp_path / "one")))
    two = agreed_losses(rank_pool.run(PlanJob(dirs["zero2"], REFERENCE_STEPS, save_to=tmp_path / "two")))
    assert_losses_close(two, one)
    assert_params_close(latest_checkpoint(tmp_path / "two"), read_params(latest_checkpoint(tmp_path / "one")))
