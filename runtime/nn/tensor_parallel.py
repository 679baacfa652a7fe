"""Tensor-parallel building blocks: sharded projections and the comm hooks.

A projection is built for one (tp_rank, tp_size) shard and holds only its
slice of the full weight: column-parallel splits the output features (the
heads of q/k/v, the FFN's hidden units), row-parallel splits the input
features and needs a reduction of its partial outputs (Megatron's
`ColumnParallelLinear` / `RowParallelLinear`). Initialisation draws the
*full* tensor and keeps the slice (see runtime/nn/model.py), so a TP=2 plan
starts from exactly the weights of the 1-rank plan.

The communication is a hook, `TPComm`: `enter` before the column-parallel
projections (Megatron's copy-to-region: identity forward, all-reduce
backward; with sequence parallelism an all-gather over the sequence) and
`exit` after the row-parallel one (all-reduce forward; with sequence
parallelism a reduce-scatter), `replicated` on every parameter that each
tp rank holds whole (with sequence parallelism such a parameter sees only
this rank's tokens, so its gradient is summed over the group), and `partial`
on one that each tp rank holds whole but applies to its own heads only (the
q/k norms: its gradient is always summed over the group). `NO_TP` is
the identity, exact for tp = 1. Modules that use the hook are `TPAware`; the
interpreter installs a process-group-backed `TPComm` with `set_tp_comm`.

Over a process group (the second half of this module): the four conjugate
pairs (Megatron's `mappings.py`), as autograd functions on the lane's TP
group; activations are [b, s, H], the sequence on dim 1:

    copy_to_region       forward identity       backward all-reduce
    reduce_from_region   forward all-reduce     backward identity
    gather_sequence      forward all-gather(s)  backward reduce-scatter(s)
    scatter_sequence     forward reduce-scatter(s) backward all-gather(s)

`GroupTP` is the `TPComm` the interpreter installs: without
sequence parallelism a region enters with copy and exits with all-reduce;
with it, the residual stream between regions holds this rank's part of the
sequence (hetc/ir/layout.py), a region enters with an all-gather and exits with
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
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hetc.ir.errors import InternalError
from hetc.runtime.nn import collectives

__all__ = [
    "NO_SHARD",
    "NO_TP",
    "GroupTP",
    "ParallelLinear",
    "ShardInfo",
    "Split",
    "TPAware",
    "TPComm",
    "TPRegion",
    "TPShard",
    "all_gather_into",
    "conjugate",
    "copy_to_region",
    "gather_parts",
    "gather_sequence",
    "reduce_from_region",
    "reduce_scatter_into",
    "scatter_sequence",
    "set_tp_comm",
    "shard_infos",
    "sum_grad_over",
]


@dataclass(frozen=True, slots=True)
class TPShard:
    """Which tensor-parallel slice a rank holds: `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise InternalError(f"tp rank {self.rank} outside tp size {self.size}")

    def part(self, n: int, what: str) -> int:
        """How many of `n` units (heads, features) this shard holds."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({self.size})")
        return n // self.size


NO_SHARD = TPShard()  # tp size 1: the whole tensor


class Split(StrEnum):
    NONE = "none"      # replicated on every tp rank
    COLUMN = "column"  # output features split
    ROW = "row"        # input features split; partial outputs are reduced


class TPComm(Protocol):
    """The collectives around a tensor-parallel region (identity for tp = 1)."""

    def enter(self, x: Tensor) -> Tensor:
        """Before the column-parallel projections of one sub-block."""
        ...

    def exit(self, x: Tensor) -> Tensor:
        """After the row-parallel projection: combine the partial sums."""
        ...

    def replicated(self, p: Tensor) -> Tensor:
        """A parameter every tp rank holds whole, as forward uses it."""
        ...

    def partial(self, p: Tensor) -> Tensor:
        """A parameter every tp rank holds whole but applies to its own heads only (q/k norms):
        its gradient is summed over the group."""
        ...


class _NoTP:
    def enter(self, x: Tensor) -> Tensor:
        return x

    def exit(self, x: Tensor) -> Tensor:
        return x

    def replicated(self, p: Tensor) -> Tensor:
        return p

    def partial(self, p: Tensor) -> Tensor:
        return p

    def __repr__(self) -> str:
        return "NO_TP"


NO_TP: TPComm = _NoTP()


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """The full shape of a parameter and the dimension its shard slices (None: replicated)."""

    full_shape: tuple[int, ...]
    dim: int | None
    shard: TPShard

    def slice_of(self, full: Tensor) -> Tensor:
        """This shard's part of the full tensor."""
        if self.dim is None:
            return full
        size = full.shape[self.dim] // self.shard.size
        return full.narrow(self.dim, self.shard.rank * size, size)


class TPAware:
    """A module whose forward goes through its lane's `TPComm` (`set_tp_comm` replaces the default)."""

    tp: TPComm = NO_TP


class ParallelLinear(TPAware, nn.Linear):
    """`nn.Linear` holding one tensor-parallel slice of a full (out, in) weight.

    A row-parallel layer adds its (replicated) bias only after `reduce`, so
    the bias counts once however many ranks hold partial sums.
    `scaled_init` marks residual output projections (GPT-2's 1/sqrt(2L)).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, split: Split = Split.NONE,
                 shard: TPShard = NO_SHARD, scaled_init: bool = False, device=None) -> None:
        local_in = shard.part(in_features, "input features") if split is Split.ROW else in_features
        local_out = shard.part(out_features, "output features") if split is Split.COLUMN else out_features
        super().__init__(local_in, local_out, bias=bias, device=device)
        self.split, self.shard, self.scaled_init = split, shard, scaled_init
        self.full_in, self.full_out = in_features, out_features

    def forward(self, x: Tensor, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        weight = self.tp.replicated(self.weight) if self.split is Split.NONE else self.weight
        if self.split is Split.COLUMN:
            return F.linear(x, weight, self.bias)
        bias = None if self.bias is None else self.tp.replicated(self.bias)
        if self.split is Split.NONE:
            return F.linear(x, weight, bias)
        y = F.linear(x, weight)
        y = reduce(y) if reduce is not None else y
        return y if bias is None else y + bias

    def shard_info(self, name: str) -> ShardInfo:
        if name == "weight":
            dim = {Split.NONE: None, Split.COLUMN: 0, Split.ROW: 1}[self.split]
            return ShardInfo((self.full_out, self.full_in), dim, self.shard)
        dim = 0 if self.split is Split.COLUMN else None
        return ShardInfo((self.full_out,), dim, self.shard)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, split={self.split.value}, tp={self.shard.rank}/{self.shard.size}"


def shard_infos(module: nn.Module) -> dict[str, ShardInfo]:
    """Every parameter of `module` (by name) with its full shape and shard dimension."""
    out: dict[str, ShardInfo] = {}
    for prefix, sub in module.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if full not in out:
                out[full] = sub.shard_info(name) if isinstance(sub, ParallelLinear) else \
                    ShardInfo(tuple(p.shape), None, NO_SHARD)
    return out


class TPRegion(TPAware, nn.Module):
    """A sub-block (attention, MLP) whose projections share one `TPComm`."""


def set_tp_comm(module: nn.Module, comm: TPComm) -> None:
    """Install `comm` in every tensor-parallel region and replicated-parameter user under `module`."""
    for sub in module.modules():
        if isinstance(sub, TPAware):
            sub.tp = comm


# The collectives over a process group (what the interpreter installs as `TPComm`)
def all_gather_into(out: Tensor, mine: Tensor, group) -> None:
    """Blocking all-gather of equal parts along dim 0."""
    collectives.all_gather_into_tensor(out, mine, group=group)


def reduce_scatter_into(out: Tensor, full: Tensor, group) -> None:
    """Blocking reduce-scatter (sum) of equal parts along dim 0."""
    collectives.reduce_scatter_tensor(out, full, group=group)


def _all_reduce(x: Tensor, group) -> Tensor:  # never in place: autograd may still hold `x`
    out = x.contiguous().clone()
    collectives.all_reduce(out, group=group)
    return out


def _gather_seq(x: Tensor, group) -> Tensor:
    n = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()                      # [s, b, H]: parts concatenate on dim 0
    out = local.new_empty((n * local.shape[0], *local.shape[1:]))
    all_gather_into(out, local, group)
    return out.transpose(0, 1)


def gather_parts(x: Tensor, group) -> Tensor:
    """The tp ranks' parts of a boundary tensor (dim 1, the sequence) concatenated in rank order, outside
    autograd: a received tensor's whole (Note [scatter-gather borders] in hetc/ir/layout.py)."""
    with torch.no_grad():
        return _gather_seq(x, group).contiguous()


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
