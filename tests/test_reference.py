"""The single-process reference trainer: it learns, and it is plain torch training in disguise."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from hetc.compiler import load_checked
from hetc.runtime.data import make_data_source
from hetc.runtime.nn.model import build_ministage
from hetc.runtime.optim import lr_at
from hetc.runtime.reference import train_reference
from hetc.ir.spec import DType, LrScheduleKind, LrScheduleSpec, ModelSpec, OptimizerSpec, TrainSpec
from tests.conftest import DEMO

MODEL = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64, seq=16, dtype=DType.FP32,
                  optimizer=OptimizerSpec(weight_decay=0.1))


def job(grad_clip: float = 0.0, steps: int = 4) -> TrainSpec:
    return TrainSpec(global_batch=6, micro_batch=2, steps=steps, lr=3e-3, seed=11, grad_clip=grad_clip,
                     lr_schedule=LrScheduleSpec(kind=LrScheduleKind.COSINE, warmup=1, min_lr=1e-4))


def plain_torch_training(model: ModelSpec, train: TrainSpec):
    """The same job written as an ordinary torch loop: torch.optim.AdamW, clip_grad_norm_; without decay on
    norms and biases, Megatron-LM's two parameter groups (one-dimensional parameters at weight_decay 0)."""
    module = build_ministage(model, range(model.num_model_layers), seed=train.seed)
    opt = model.optimizer
    params = list(module.parameters())
    groups = [{"params": params}] if opt.decay_norms_and_biases else [
        {"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=train.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                              weight_decay=opt.weight_decay, foreach=False)
    data = make_data_source(model, train)
    num_mb = train.global_batch // train.micro_batch
    losses = []
    for step in range(train.steps):
        adamw.zero_grad()
        losses.append(0.0)
        for mb in range(num_mb):
            loss = module(*data.get_microbatch(step, mb))
            (loss / num_mb).backward()
            losses[-1] += loss.item() / num_mb
        if train.grad_clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), train.grad_clip)
        for group in adamw.param_groups:
            group["lr"] = lr_at(train, step)
        adamw.step()
    return losses, dict(module.named_parameters())


def test_reference_is_bitwise_a_plain_torch_loop():
    losses, params = plain_torch_training(MODEL, job())
    ref = train_reference(MODEL, job())
    assert list(ref.losses) == pytest.approx(losses, rel=1e-12, abs=0)
    assert ref.params.keys() == params.keys()
    for name, p in params.items():
        assert torch.equal(ref.params[name], p.detach()), name


def test_norms_and_biases_without_decay_are_megatrons_parameter_groups():
    """`decay_norms_and_biases = false`: bitwise torch.optim.AdamW with the one-dimensional parameters in a group
    of weight_decay 0. After one step only those parameters differ from a run that decays them."""
    model = replace(MODEL, optimizer=replace(MODEL.optimizer, decay_norms_and_biases=False))
    losses, params = plain_torch_training(model, job())
    ref = train_reference(model, job())
    assert list(ref.losses) == pytest.approx(losses, rel=1e-12, abs=0)
    for name, p in params.items():
        assert torch.equal(ref.params[name], p.detach()), name
    once, decayed = train_reference(model, job(), steps=1), train_reference(MODEL, job(), steps=1)
    differ = {name for name, p in once.params.items() if not torch.equal(p, decayed.params[name])}
    assert differ == {name for name, p in params.items() if p.ndim < 2}, differ


def test_reference_clips_like_clip_grad_norm():
    train = job(grad_clip=0.05)
    losses, params = plain_torch_training(MODEL, train)
    ref = train_reference(MODEL, train)
    assert all(norm > 0.05 for norm in ref.grad_norms), "the test must actually clip"
    assert list(ref.losses) == pytest.approx(losses, rel=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(ref.params[name], p.detach(), rtol=1e-5, atol=1e-7)


def test_uneven_lanes_sum_to_the_one_device_gradient():
    """Note [Loss normalisation]: lanes with 2 and 1 microbatches add up to the whole batch."""
    train = job()
    data = make_data_source(MODEL, train)
    num_mb = train.global_batch // train.micro_batch

    def grads(microbatches):
        module = build_ministage(MODEL, range(MODEL.num_model_layers), seed=train.seed)
        for mb in microbatches:
            (module(*data.get_microbatch(0, mb)) / num_mb).backward()
        return {n: p.grad for n, p in module.named_parameters()}

    whole, lane_a, lane_b = grads(range(3)), grads([0, 2]), grads([1])
    for name, g in whole.items():
        torch.testing.assert_close(lane_a[name] + lane_b[name], g, rtol=1e-5, atol=1e-8)


def test_reference_is_deterministic():
    a, b = train_reference(MODEL, job(steps=2)), train_reference(MODEL, job(steps=2))
    assert a.losses == b.losses
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)


def test_the_demo_job_learns_its_text():
    loaded, _ = load_checked(DEMO / "job.het")
    spec = loaded.spec
    result = train_reference(spec.model, spec.train, base_dir=loaded.path.parent)
    losses = result.losses
    assert len(losses) == spec.train.steps == 30
    assert abs(losses[0] - math.log(spec.model.vocab)) < 0.1, "starts at chance"
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
