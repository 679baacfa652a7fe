"""Flat buffers, the shard optimizer against torch.optim, the LR schedule and grad clipping."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn

from hetc.ir.program import Shard
from hetc.runtime.buffers import GroupPos, MinistageBuffers
from hetc.runtime.flat import FlatLayout, FlatParams, bind_grads, bind_params
from hetc.runtime.nn.model import build_ministage
from hetc.runtime.optim import clip_coefficient, decayed_spans, grad_sq_sum, init_state, lr_at, optimizer_step
from hetc.ir.spec import LrDecay, LrScheduleKind, LrScheduleSpec, ModelSpec, OptimizerKind, OptimizerSpec, TrainSpec


def small_module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))


def random_grads(module: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in module.named_parameters()}


def torch_optimizer(opt: OptimizerSpec, params, lr: float):
    if opt.kind is OptimizerKind.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay,
                               foreach=False)
    cls = torch.optim.AdamW if opt.kind is OptimizerKind.ADAMW else torch.optim.Adam
    return cls(params, lr=lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay,
               foreach=False)


OPTIMIZERS = [
    OptimizerSpec(kind=OptimizerKind.ADAMW, weight_decay=0.1, beta2=0.95),
    OptimizerSpec(kind=OptimizerKind.ADAMW, weight_decay=0.0, beta1=0.8, beta2=0.99, eps=1e-6),
    OptimizerSpec(kind=OptimizerKind.ADAM, weight_decay=0.01),
    OptimizerSpec(kind=OptimizerKind.SGD, momentum=0.9, weight_decay=0.05),
    OptimizerSpec(kind=OptimizerKind.SGD),
]


def parameter_groups(module: nn.Module, opt: OptimizerSpec) -> list[dict]:
    """torch.optim's parameter groups for `opt`: one, or Megatron-LM's two where norms' weights and biases
    (one-dimensional parameters) take no weight decay."""
    params = list(module.parameters())
    if opt.decay_norms_and_biases:
        return [{"params": params}]
    return [{"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o.kind.value}-wd{o.weight_decay}-m{o.momentum}")
@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("decay_vectors", [True, False], ids=["decay-all", "matrices-only"])
def test_shard_step_is_bitwise_torch_optim(opt, num_shards, decay_vectors):
    """Each shard stepped on its own, as ZeRO ranks do, is torch.optim on the whole module; with decay on
    matrices only, torch.optim with two parameter groups (the shards' edges cut the biases' and norms' spans)."""
    opt = dataclasses.replace(opt, decay_norms_and_biases=decay_vectors)
    ref, ours = small_module(), small_module()
    lrs = [1e-2, 3e-3, 5e-3, 1e-3]
    torch_opt = torch_optimizer(opt, parameter_groups(ref, opt), lrs[0])
    layout = FlatLayout.of(ours, num_shards)
    flat = layout.flatten(dict(ours.named_parameters()))
    states = [init_state(opt, flat[layout.shard_range(i)]) for i in range(num_shards)]
    for step, lr in enumerate(lrs):
        grads = random_grads(ref, step)
        for name, p in ref.named_parameters():
            p.grad = grads[name].clone()
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        flat_grad = layout.flatten(grads)
        for i in range(num_shards):  # each shard on its own, as ZeRO ranks do
            rng = layout.shard_range(i)
            optimizer_step(opt, flat[rng], flat_grad[rng], states[i], lr=lr, step=step,
                           decayed=decayed_spans(opt, layout, rng))
    for name, view in layout.views(flat).items():
        assert torch.equal(view, ref.get_parameter(name).detach()), name
    assert torch.count_nonzero(flat[layout.numel:]) == 0, "padding stays zero"


def test_layout_pads_and_tiles_shards():
    module = small_module()
    layout = FlatLayout.of(module, 4)
    assert layout.numel == 5 * 7 + 7 + 7 + 7 + 7 * 3 == 77
    assert layout.padded_numel == 80 and layout.shard_numel == 20
    assert [e.name for e in layout.entries] == [n for n, _ in module.named_parameters()]
    covered = {}
    for shard in range(4):
        for name, start, stop, at in layout.pieces(shard):
            covered.setdefault(name, []).append((start, stop))
            assert 0 <= at < layout.shard_numel
    for e in layout.entries:
        spans = sorted(covered[e.name])
        assert spans[0][0] == 0 and spans[-1][1] == e.numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_bound_views_carry_values_and_gradients():
    module = small_module()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    layout = FlatLayout.of(module, 2)
    flat = layout.flatten(before)
    grad = torch.zeros_like(flat)
    bind_params(module, layout, flat)
    bind_grads(module, layout, grad)
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name])
    x = torch.randn(4, 5)
    module(x).square().sum().backward()
    module(x).square().sum().backward()
    manual = small_module()
    manual(x).square().sum().mul(2).backward()
    expected = layout.flatten({n: p.grad for n, p in manual.named_parameters()})
    torch.testing.assert_close(grad, expected)
    flat.mul_(0.5)  # an update of the buffer is an update of the module
    assert torch.equal(module[0].weight, before["0.weight"] * 0.5)


def test_released_compute_buffer_is_refilled_in_place():
    module = small_module()
    flat = FlatParams(module, num_shards=2, shard_index=1, keep_master_apart=True)
    saved = flat.compute.clone()
    flat.release()
    assert flat.compute.untyped_storage().size() == 0
    flat.materialize()
    flat.compute.copy_(saved)  # stands in for the all-gather
    torch.testing.assert_close(module(torch.ones(1, 5)), small_module()(torch.ones(1, 5)))
    assert torch.equal(flat.master, saved[flat.layout.shard_range(1)])


def test_master_shard_publishes_into_the_compute_buffer():
    module = small_module()
    shared = FlatParams(module, num_shards=2, shard_index=0)
    assert shared.master_is_compute
    half = FlatParams(small_module(), num_shards=2, shard_index=1, dtype=torch.bfloat16)
    assert not half.master_is_compute and half.master.dtype is torch.float32
    half.master.fill_(0.25)
    half.publish_master()
    assert torch.all(half.compute_shard == 0.25)
    assert not torch.all(half.compute[half.layout.shard_range(0)] == 0.25)


def train(kind: LrScheduleKind, warmup: int, steps: int = 12) -> TrainSpec:
    return TrainSpec(global_batch=1, steps=steps, lr=1.0,
                     lr_schedule=LrScheduleSpec(kind=kind, warmup=warmup, min_lr=0.1))


def test_warmup_reaches_the_peak():
    t = train(LrScheduleKind.COSINE, warmup=4)
    assert [lr_at(t, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("kind", [LrScheduleKind.COSINE, LrScheduleKind.LINEAR])
def test_decay_ends_at_min_lr(kind):
    t = train(kind, warmup=1)
    lrs = [lr_at(t, s) for s in range(t.steps)]
    assert lrs[0] == 1.0 and math.isclose(lrs[-1], 0.1)
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    middle = lr_at(t, 6)  # progress (6 - warmup) / (steps - 1 - warmup) = 1/2
    assert math.isclose(middle, 0.55), middle  # half way: (peak + min) / 2 for both shapes


def test_constant_schedule():
    t = train(LrScheduleKind.CONSTANT, warmup=2)
    assert [lr_at(t, s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def torch_lrs(steps: int, warmup: int, phases) -> list[float]:
    """The rates torch.optim.lr_scheduler gives a peak of 1 over `steps`: a linear warm-up as hetc's (LinearLR
    from 1/warmup), then `phases`: (first step, scheduler factory) each."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, *(make(opt) for _, make in phases)],
                                                  milestones=[first for first, _ in phases])
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def constant_phase(opt):
    return torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)


def linear_decay(steps: int, min_lr: float):
    return lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=min_lr, total_iters=steps)


def cosine_decay(steps: int, min_lr: float):
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=min_lr)


@pytest.mark.parametrize("shape, decay", [(LrDecay.LINEAR, linear_decay), (LrDecay.COSINE, cosine_decay)])
def test_wsd_is_torchs_warmup_constant_and_decay_in_sequence(shape, decay):
    """Megatron-LM's WSD: warm-up, the peak held, then the run's last decay_steps steps decay to min_lr, reached
    at the last step; the same rates as torch's schedulers chained with SequentialLR."""
    t = TrainSpec(global_batch=1, steps=20, lr=1.0, lr_schedule=LrScheduleSpec(
        kind=LrScheduleKind.WSD, warmup=4, min_lr=0.1, decay_steps=8, decay=shape))
    ours = [lr_at(t, s) for s in range(t.steps)]
    theirs = torch_lrs(t.steps, 4, [(4, constant_phase), (11, decay(8, 0.1))])
    assert ours[4:12] == [1.0] * 8 and math.isclose(ours[-1], 0.1), ours
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours, theirs)), (ours, theirs)


def test_wsd_sqrt_decay():
    """Megatron-LM's minus_sqrt (torchtitan's sqrt): 1 - sqrt(progress) of the span left."""
    t = TrainSpec(global_batch=1, steps=9, lr=1.0, lr_schedule=LrScheduleSpec(
        kind=LrScheduleKind.WSD, min_lr=0.1, decay_steps=4, decay=LrDecay.SQRT))
    assert [lr_at(t, s) for s in range(5)] == [1.0] * 5
    assert [round(lr_at(t, s), 12) for s in range(5, 9)] == [round(0.1 + 0.9 * (1 - math.sqrt(k / 4)), 12)
                                                           for k in range(1, 5)]


@pytest.mark.parametrize("warmup", [1, 4, 10])
def test_inverse_sqrt_is_transformers_schedule_one_update_on(warmup):
    """Megatron-LM's inverse-square-root, lr sqrt(warmup / n) at the n-th update, is transformers'
    get_inverse_sqrt_schedule, whose warm-up starts from 0 where hetc's starts at lr / warmup: hetc's update s
    has its rate of step s + 1. `min_lr` floors the decay."""
    from transformers.optimization import get_inverse_sqrt_schedule

    t = TrainSpec(global_batch=1, steps=60, lr=1.0, lr_schedule=LrScheduleSpec(
        kind=LrScheduleKind.INVERSE_SQRT, warmup=warmup))
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_inverse_sqrt_schedule(opt, num_warmup_steps=warmup).lr_lambdas[0]
    ours = [lr_at(t, s) for s in range(t.steps)]
    assert all(math.isclose(ours[s], theirs(s + 1), rel_tol=1e-12) for s in range(t.steps)), ours
    assert ours[warmup - 1] == 1.0 and math.isclose(ours[4 * warmup - 1], 0.5)
    floored = dataclasses.replace(t, lr_schedule=dataclasses.replace(t.lr_schedule, min_lr=0.3))
    assert [lr_at(floored, s) for s in range(warmup, t.steps)] == [max(0.3, lr) for lr in ours[warmup:]]


def test_inverse_sqrt_without_warmup_starts_at_the_peak():
    t = TrainSpec(global_batch=1, steps=5, lr=1.0, lr_schedule=LrScheduleSpec(kind=LrScheduleKind.INVERSE_SQRT))
    assert all(math.isclose(lr_at(t, n - 1), 1 / math.sqrt(n), rel_tol=1e-12) for n in range(1, 6))


@pytest.mark.parametrize("kind, decay", [(LrScheduleKind.COSINE, cosine_decay), (LrScheduleKind.LINEAR, linear_decay)])
def test_decay_steps_end_the_decay_early_and_hold_min_lr(kind, decay):
    """cosine and linear with decay_steps (Megatron-LM's lr_decay_iters less the warm-up): torch's annealing over
    that many steps after warm-up, then min_lr to the end of the run."""
    t = TrainSpec(global_batch=1, steps=30, lr=1.0, lr_schedule=LrScheduleSpec(
        kind=kind, warmup=3, min_lr=0.1, decay_steps=10))
    ours = [lr_at(t, s) for s in range(t.steps)]
    theirs = torch_lrs(14, 3, [(3, decay(10, 0.1))])
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours, theirs)), (ours, theirs)
    assert all(math.isclose(lr, 0.1) for lr in ours[13:]), ours


def test_clipping_matches_torch_and_is_shard_invariant():
    module = small_module()
    grads = random_grads(module, 0)
    layout = FlatLayout.of(module, 3)
    flat_grad = layout.flatten(grads)
    total = sum(grad_sq_sum(flat_grad[layout.shard_range(i)]) for i in range(3))
    assert math.isclose(float(total), float(grad_sq_sum(flat_grad)), rel_tol=1e-15)
    for name, p in module.named_parameters():
        p.grad = grads[name].clone()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=0.5)
    assert math.isclose(math.sqrt(float(total)), norm.item(), rel_tol=1e-6)
    flat_grad.mul_(clip_coefficient(total, 0.5))
    torch.testing.assert_close(flat_grad, layout.flatten({n: p.grad for n, p in module.named_parameters()}))
    assert clip_coefficient(total, 1e9) == 1.0


@pytest.mark.parametrize("level, kept", [(1, True), (2, False), (3, False)])
def test_sharded_gradients_release_the_full_buffer_once_reduced(level, kept):
    """ZeRO-2 and 3 hold the full gradient buffer only from a backward to its reduce-scatter (`ready_grads`,
    `reduced`), as the memory model counts them: the shard, not the buffer (docs/costmodel.md)."""
    module = build_ministage(ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=64, seq=4), range(1, 2), seed=0)
    buf = MinistageBuffers(module, Shard(ms=1, level=level, group="dp"), GroupPos(0, 2), GroupPos(),
                           OptimizerSpec(kind=OptimizerKind.ADAMW), torch.float32, torch.device("cpu"))
    full = buf.grad.numel() * buf.grad.element_size()
    buf.ready_grads()
    assert buf.grad.untyped_storage().size() == full
    buf.reduced()
    assert (buf.grad.untyped_storage().size() == full) is kept


def _buffers(level: int, dtype: torch.dtype, shard: Shard | None = None) -> MinistageBuffers:
    module = build_ministage(ModelSpec(layers=1, hidden=8, heads=2, ffn=8, vocab=64, seq=4), range(1, 2), seed=0)
    return MinistageBuffers(module, shard or Shard(ms=1, level=level, group="dp"), GroupPos(0, 2), GroupPos(),
                            OptimizerSpec(kind=OptimizerKind.ADAMW), dtype, torch.device("cpu"))


@pytest.mark.parametrize("level", [1, 2, 3])
def test_the_reduced_shard_is_held_from_the_first_reduction_to_the_step(level):
    """Note [reduced shard]: no shard before the step's first reduction; that reduction's output is the
    shard, in the compute dtype, and later ones add to it; the optimizer reads it in fp32; the step drops it."""
    buf = _buffers(level, torch.bfloat16)
    assert buf.acc is None
    first = torch.full((buf.inner_numel,), 0.5, dtype=torch.bfloat16)
    buf.accumulate(first)
    assert buf.acc is first
    buf.accumulate(torch.full((buf.inner_numel,), 0.25, dtype=torch.bfloat16))
    assert buf.inner_grad is first and first.dtype == torch.bfloat16
    grad = buf.step_grad()
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, torch.full((buf.inner_numel,), 0.75))
    buf.drop_reduced()
    assert buf.acc is None


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_an_fp32_models_master_weights_are_its_parameters(level):
    """The memory model counts no master copy when the compute dtype is fp32 (docs/costmodel.md): the
    runtime steps the parameters in place; a bf16 model's master is a copy, published after the step."""
    buf = _buffers(level, torch.float32)
    assert buf.master_is_params
    buf.master.add_(1.0)
    mine = buf.own_params[buf.opt_range_in_inner()] if level == 3 else buf.compute[buf.opt_range]
    torch.testing.assert_close(mine, buf.master)
    half = _buffers(level, torch.bfloat16)
    assert not half.master_is_params
    half.master.fill_(2.0)
    half.publish()
    mine = half.own_params[half.opt_range_in_inner()] if level == 3 else half.compute[half.opt_range]
    assert bool((mine == 2.0).all())
    # offloaded fp32 parameters are their own master too; between steps the host copy holds it
    offloaded = _buffers(level, torch.float32, Shard(ms=1, level=level, group="dp", param_offload=True))
    assert offloaded.master_is_params
    on_host = offloaded.host_params[offloaded.opt_range_in_inner() if level == 3 else offloaded.opt_range]
    assert offloaded.master_values().data_ptr() == on_host.data_ptr()
    # an optimizer stepped on the host keeps its own fp32 master there (Note [optimizer offload])
    stepped_on_host = _buffers(level, torch.float32, Shard(ms=1, level=level, group="dp", opt_offload=True))
    assert not stepped_on_host.master_is_params and stepped_on_host.master.device.type == "cpu"
