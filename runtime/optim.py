"""The optimizer on flat fp32 shards, the learning-rate schedule and grad clipping.

The optimizer is functional: `optimizer_step(opt, param, grad, state, lr=,
step=)` updates one contiguous fp32 shard (a ZeRO shard of one ministage's
flat buffer, runtime/flat.py) in place, element for element as
`torch.optim.AdamW` / `Adam` / `SGD` (one parameter group) would. AdamW and
Adam run torch's own kernels (see Note [torch's Adam kernels]). Because the
update is elementwise, how the model is cut into ministages and shards cannot
change the numbers.

Weight decay applies to every element, as in torchtitan (one parameter
group), unless the optimizer's `decay_norms_and_biases = false`: then only
the elements of matrices decay (`FlatLayout.matrix_spans`), as torch.optim
with Megatron-LM's (and Hugging Face Trainer's) second parameter group of
weight_decay 0 for norms' weights and biases would. Steps are 0-based
indices of the optimizer step everywhere in hetc; bias corrections use the
1-based count `step + 1`.

Global gradient clipping is split in two: every rank sums the squares of its
gradient shards (`grad_sq_sum`), the interpreter all-reduces the sums over
the shard owners (each element counted once), and `clip_coefficient` turns
the total into the factor every shard is multiplied by.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam

from hetc.ir.errors import InternalError
from hetc.ir.spec import LrDecay, LrScheduleKind, LrScheduleSpec, OptimizerKind, OptimizerSpec, TrainSpec
from hetc.runtime.flat import FlatLayout

__all__ = ["OptimizerState", "clip_coefficient", "decayed_spans", "grad_sq_sum", "init_state", "lr_at",
           "optimizer_step"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard against a zero norm


@dataclass(frozen=True, slots=True)
class OptimizerState:
    """Per-element state of one shard (tensors mutated in place; None when unused).

    AdamW/Adam: exp_avg, exp_avg_sq. SGD with momentum: momentum_buffer.
    """

    exp_avg: Tensor | None = None
    exp_avg_sq: Tensor | None = None
    momentum_buffer: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        """The state tensors by name (for checkpoints and offload)."""
        names = ("exp_avg", "exp_avg_sq", "momentum_buffer")
        return {n: t for n in names if (t := getattr(self, n)) is not None}


def init_state(opt: OptimizerSpec, shard: Tensor) -> OptimizerState:
    """Zero state for a shard shaped and placed like `shard` (fp32, δ_opt)."""
    def zeros() -> Tensor:
        return torch.zeros_like(shard, dtype=torch.float32)
    if opt.kind is OptimizerKind.SGD:
        return OptimizerState(momentum_buffer=zeros() if opt.momentum else None)
    return OptimizerState(exp_avg=zeros(), exp_avg_sq=zeros())


def optimizer_step(opt: OptimizerSpec, param: Tensor, grad: Tensor, state: OptimizerState, *,
                   lr: float, step: int, decayed: Sequence[slice] | None = None) -> None:
    """Update the fp32 shard `param` in place from `grad` (any float dtype, same size).

    `step` is the 0-based optimizer step; `decayed`: the shard's spans that take weight decay
    (`decayed_spans`; None: every element). Matches torch.optim.AdamW (Adam, SGD) on the same elements: bitwise on CPU (foreach or
    not), to the fused kernel's rounding on CUDA.
    """
    if param.dtype != torch.float32:
        raise InternalError("master shards are fp32")
    if param.shape != grad.shape:
        raise InternalError(f"param shard {tuple(param.shape)} vs grad {tuple(grad.shape)}")
    grad = grad.to(torch.float32)
    if opt.weight_decay and decayed is not None:
        grad = _decay_spans(opt, param, grad, decayed, lr)
        opt = dataclasses.replace(opt, weight_decay=0.0)
    (_sgd if opt.kind is OptimizerKind.SGD else _adam)(opt, param, grad, state, lr, step)


def decayed_spans(opt: OptimizerSpec, layout: FlatLayout, rng: slice) -> tuple[slice, ...] | None:
    """The spans of the shard `rng` of `layout` that `optimizer_step` decays; None: all of it (torch's one
    parameter group, decayed inside its kernels)."""
    return None if opt.decay_norms_and_biases or not opt.weight_decay else layout.matrix_spans(rng)


def _decay_spans(opt: OptimizerSpec, param: Tensor, grad: Tensor, decayed: Sequence[slice], lr: float) -> Tensor:
    """Weight decay of the `decayed` spans only, as torch applies it before the update: AdamW's decoupled
    `param *= 1 - lr * wd` (the same multiply torch's kernels run first), Adam's and SGD's L2 `grad += wd *
    param` (on a copy: the reduced gradient is the interpreter's). The update then runs without decay."""
    if opt.kind is OptimizerKind.ADAMW:
        for span in decayed:
            param[span].mul_(1 - lr * opt.weight_decay)
        return grad
    grad = grad.clone()
    for span in decayed:
        grad[span].add_(param[span], alpha=opt.weight_decay)
    return grad


# Note [torch's Adam kernels]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The update goes through torch.optim's functional Adam, the code torch.optim.AdamW.step runs: on
# CUDA its fused kernel (torch._fused_adamw_: one launch reads param, grad and both moments once),
# elsewhere its foreach implementation (_multi_tensor_adam). Hand-written, the same update is ~10
# elementwise ops, each a kernel launch and a pass over the shard's memory. Decoupled weight decay
# (AdamW) or L2 (Adam) is torch's decoupled_weight_decay flag; the bias corrections use torch's
# step count, a tensor that the call increments first, so it starts at hetc's 0-based `step` and
# the kernel sees the 1-based count step + 1. On CPU the foreach path performs the single-tensor
# path's operations in the same order, so the result is bitwise torch.optim.AdamW(foreach=False).


def _adam(opt: OptimizerSpec, param: Tensor, grad: Tensor, state: OptimizerState, lr: float, step: int) -> None:
    exp_avg, exp_avg_sq = state.exp_avg, state.exp_avg_sq
    assert exp_avg is not None and exp_avg_sq is not None   # an Adam shard's state holds both
    fused = param.is_cuda
    # The fused kernel reads the step count on the device (as torch.optim.Adam keeps it, fused=True).
    count = torch.full((), float(step), dtype=torch.float32, device=param.device if fused else "cpu")
    torch_adam([param], [grad], [exp_avg], [exp_avg_sq], [], [count],
               foreach=not fused, fused=fused, decoupled_weight_decay=opt.kind is OptimizerKind.ADAMW,
               amsgrad=False, beta1=opt.beta1, beta2=opt.beta2, lr=lr,
               weight_decay=opt.weight_decay, eps=opt.eps, maximize=False)


def _sgd(opt: OptimizerSpec, param: Tensor, grad: Tensor, state: OptimizerState, lr: float, step: int) -> None:
    if opt.weight_decay:
        grad = grad.add(param, alpha=opt.weight_decay)
    if opt.momentum:
        buf = state.momentum_buffer
        assert buf is not None   # an SGD shard with momentum holds its buffer
        if step == 0:
            buf.copy_(grad)
        else:
            buf.mul_(opt.momentum).add_(grad)
        grad = buf
    param.add_(grad, alpha=-lr)


# Note [skipped updates]
# ~~~~~~~~~~~~~~~~~~~~~~
# A step whose update is skipped (fp16's overflow, Note [dynamic loss scale]; `--on-nonfinite skip`, Note
# [non-finite steps]) leaves the weights and the optimizer state as they were, and is not an update: the
# learning-rate schedule and Adam's step count (its bias corrections) both follow the updates applied, not
# the steps run. That is Megatron-LM's rule (the scheduler steps only when `update_successful`), DeepSpeed's
# (no lr_scheduler.step() on an overflow) and torch's (GradScaler.step skips optimizer.step, whose `step`
# state counts the updates). So a run that skips k steps ends its schedule k updates short of `min_lr`, as
# theirs do. The count is the interpreter's `updates`, saved in checkpoints as `train.updates`
# (runtime/checkpoint.py); a checkpoint without it (written before it was kept) resumes at its step.
def lr_at(train: TrainSpec, step: int) -> float:
    """The learning rate of 0-based optimizer update `step` (Note [skipped updates]).

    Linear warm-up over the first `warmup` steps (reaching `lr` at step
    warmup - 1), then constant, or a decay to `min_lr`: cosine and linear
    over `decay_steps` from the end of warm-up (by default to the last step,
    train.steps - 1), then `min_lr`; wsd holds `lr` until its last
    `decay_steps` steps, which decay to `min_lr` at the last step in the
    schedule's `decay` shape (Megatron-LM's `--lr-decay-style WSD`);
    inverse_sqrt falls as lr sqrt(warmup / n) at the n-th update, never
    below `min_lr` (Megatron-LM's `inverse-square-root`).
    """
    sched, peak = train.lr_schedule, train.lr
    if step < sched.warmup:
        return peak * (step + 1) / sched.warmup
    if sched.kind is LrScheduleKind.CONSTANT:
        return peak
    if sched.kind is LrScheduleKind.INVERSE_SQRT:
        return max(sched.min_lr, peak * math.sqrt(max(sched.warmup, 1) / (step + 1)))
    shape = sched.decay if sched.kind is LrScheduleKind.WSD else LrDecay(sched.kind.value)
    return sched.min_lr + (peak - sched.min_lr) * _remaining(shape, _decay_progress(sched, train.steps - 1, step))


def _decay_progress(sched: LrScheduleSpec, last: int, step: int) -> float:
    """How far into its decay step `step` is, from 0 (still `lr`) to 1 (`min_lr`)."""
    if sched.kind is LrScheduleKind.WSD:
        start, span = last - sched.decay_steps, sched.decay_steps
    else:
        start, span = sched.warmup, sched.decay_steps or last - sched.warmup
    return min(1.0, max(0.0, (step - start) / span)) if span > 0 else 1.0


def _remaining(shape: LrDecay, progress: float) -> float:
    """The share of `lr - min_lr` left at `progress` through a decay."""
    if shape is LrDecay.COSINE:
        return 0.5 * (1 + math.cos(math.pi * progress))
    if shape is LrDecay.SQRT:
        return 1 - math.sqrt(progress)
    return 1 - progress


# Elements of a gradient shard squared in float64 at once: a bounded transient (32 MiB), inside the memory
# model's reserve however large the shard (an fp64 copy of a whole shard is 8 bytes a parameter, uncounted).
SQ_SUM_CHUNK = 1 << 22


def grad_sq_sum(grad_shard: Tensor) -> Tensor:
    """Sum of squares of one gradient shard, as a float64 scalar on the shard's device (all-reduce it with SUM).

    float64 so that summing per-shard partials in any order (any plan) gives
    the same total to far below fp32 resolution. The shard is squared a
    chunk of SQ_SUM_CHUNK elements at a time, each chunk in float64, and the
    chunks' sums are added in float64: no fp64 copy of the shard, and no
    host read (the caller reads the all-reduced total once).
    """
    g = grad_shard.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=g.device)
    for chunk in g.split(SQ_SUM_CHUNK):
        c = chunk.to(torch.float64)
        total += torch.dot(c, c)
    return total


def clip_coefficient(total_sq: float | Tensor, max_norm: float) -> float:
    """Factor to multiply every gradient by for global-norm clipping (1.0 when within max_norm).

    `total_sq` is the sum of `grad_sq_sum` over all shards of the model;
    the factor is torch.nn.utils.clip_grad_norm_'s max_norm / (norm + 1e-6), capped at 1.
    """
    norm = math.sqrt(float(total_sq))
    return min(1.0, max_norm / (norm + CLIP_EPS))
