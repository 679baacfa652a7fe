"""Megatron tensor parallelism over a process group: the collectives of `TPComm`.

The four conjugate pairs (Megatron's `mappings.py`), as autograd functions
on the lane's TP group; activations are [b, s, H], the sequence on dim 1:

    copy_to_region       forward identity       backward all-reduce
    reduce_from_region   forward all-reduce     backward identity
    gather_sequence      forward all-gather(s)  backward reduce-scatter(s)
    scatter_sequence     forward reduce-scatter(s) backward all-gather(s)

`GroupTP` is the `TPComm` the interpreter installs (runtime/tp.py): without
sequence parallelism a region enters with copy and exits with all-reduce;
with it, the residual stream between regions holds this rank's part of the
sequence (hetc/layout.py), a region enters with an all-gather and exits with
a reduce-scatter, and parameters every tp rank holds whole (norms, biases
after the reduction, embedding and head) see only this rank's tokens, so
their gradients are summed over the group in backward (Megatron's
`allreduce_sequence_parallel_gradients`, done where the parameter is used).
Every collective runs inside the ministage's forward or backward, which the
verifier treats as a collective on the TP group (all members, same order).
Written for gloo and NCCL alike: only contiguous tensors go on the wire.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "GroupTP",
    "all_gather_into",
    "conjugate",
    "copy_to_region",
    "gather_sequence",
    "reduce_from_region",
    "reduce_scatter_into",
    "scatter_sequence",
    "sum_grad_over",
]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: Tensor, mine: Tensor, group) -> None:
    """Blocking all-gather of equal parts along dim 0."""
    _all_gather(out, mine, group=group)


def reduce_scatter_into(out: Tensor, full: Tensor, group) -> None:
    """Blocking reduce-scatter (sum) of equal parts along dim 0."""
    _reduce_scatter(out, full, group=group)


def _all_reduce(x: Tensor, group) -> Tensor:  # never in place: autograd may still hold `x`
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _gather_seq(x: Tensor, group) -> Tensor:
    n = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()                      # [s, b, H]: parts concatenate on dim 0
    out = local.new_empty((n * local.shape[0], *local.shape[1:]))
    all_gather_into(out, local, group)
    return out.transpose(0, 1)


def _scatter_seq(x: Tensor, group) -> Tensor:
    n = dist.get_world_size(group)
    full = x.transpose(0, 1).contiguous()
    if full.shape[0] % n:
        raise ValueError(f"sequence of {full.shape[0]} tokens does not split over {n} tensor-parallel ranks")
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    reduce_scatter_into(out, full, group)
    return out.transpose(0, 1)


def conjugate(name: str, forward: Callable[[Tensor, object], Tensor],
              backward: Callable[[Tensor, object], Tensor]) -> Callable[[Tensor, object], Tensor]:
    """`f(x, group)` that runs `forward(x, group)` and whose gradient is `backward(grad, group)`."""

    class _Conjugate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: Tensor, group) -> Tensor:
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad: Tensor):
            return backward(grad, ctx.group), None

    _Conjugate.__name__ = _Conjugate.__qualname__ = name
    return _Conjugate.apply


def _identity(x: Tensor, group) -> Tensor:
    return x.view_as(x)


copy_to_region = conjugate("CopyToRegion", _identity, _all_reduce)
reduce_from_region = conjugate("ReduceFromRegion", _all_reduce, _identity)
gather_sequence = conjugate("GatherSequence", _gather_seq, _scatter_seq)
scatter_sequence = conjugate("ScatterSequence", _scatter_seq, _gather_seq)
# `p` unchanged forward; its gradient summed over the group backward
sum_grad_over = conjugate("SumGradOver", _identity, _all_reduce)


class GroupTP:
    """The `TPComm` of one lane's TP group (see the module docstring)."""

    def __init__(self, group, sequence_parallel: bool = False) -> None:
        self.group = group
        self.sequence_parallel = sequence_parallel

    def enter(self, x: Tensor) -> Tensor:
        return gather_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)

    def exit(self, x: Tensor) -> Tensor:
        return scatter_sequence(x, self.group) if self.sequence_parallel else reduce_from_region(x, self.group)

    def replicated(self, p: Tensor) -> Tensor:
        return sum_grad_over(p, self.group) if self.sequence_parallel else p

    def partial(self, p: Tensor) -> Tensor:
        return sum_grad_over(p, self.group)

    def __repr__(self) -> str:
        return f"GroupTP(size={dist.get_world_size(self.group)}, sequence_parallel={self.sequence_parallel})"
