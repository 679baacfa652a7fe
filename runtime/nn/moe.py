"""Mixture of experts: top-k routing with a capacity, and expert parallelism (EP).

Note [expert capacity]
Each token picks its top-k experts by router logit (gates: a softmax over
the k chosen logits). Expert e serves at most C = ⌈capacity_factor · T · K /
E⌉ assignments of one microbatch, T = b·S its tokens (the whole sequence,
however context parallelism splits it). Assignments queue in GShard's
order: every token's first choice before any second choice, tokens in
(sequence, position) order; an assignment beyond C is dropped (the token
keeps its residual path and its other experts). The queue depends only on
the microbatch's routing, so every plan drops exactly the assignments the
1-rank reference drops: capacity is per (microbatch, expert) whether or not
EP is on. Under context parallelism each cp rank holds part of the
sequence, so the cp group all-gathers the microbatch's routing (small ints)
and every cp rank computes the same mask for its own tokens.

Note [expert parallelism]
An EP group of n ranks (the same lane position in n lanes, which serve
different microbatches) splits the experts: rank r holds experts
r·E/n .. (r+1)·E/n − 1, under their global names (`experts.5`), so
initialisation and checkpoints do not depend on the plan. In each MoE
forward a rank routes its own microbatch, drops over capacity, and sorts
the kept assignments by expert (hence by owner); an all-to-all of the
per-expert counts fixes the split sizes, an all-to-all of the tokens
dispatches them, every expert runs once on all it received, and an
all-to-all brings the outputs back (combine) for the gate-weighted sum.
Backward mirrors the two token all-to-alls (autograd), so an expert's
gradient holds every token routed to it from the whole group, and its
replicas are only the ranks with the same EP rank in other EP groups.
Every member runs these collectives in the same order, which the compute
ops of an EP group guarantee (Note [compute collectives], hetc/program.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetc.runtime.nn import collectives
from hetc.runtime.nn.tensor_parallel import ParallelLinear, all_gather_into
from hetc.spec import ModelSpec

__all__ = [
    "ALL_EXPERTS",
    "ExpertExchange",
    "ExpertShard",
    "MoE",
    "SequenceRouting",
    "capacity",
    "is_expert_param",
    "keep_mask",
]

_EXPERTS = ".feed_forward.experts."


def is_expert_param(name: str) -> bool:
    """Whether parameter `name` (relative to a ministage, a block or an MoE) belongs to one expert."""
    return _EXPERTS in f".{name}" or name.startswith("experts.")


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """Which experts a rank holds: EP rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def local(self, experts: int) -> range:
        if experts % self.size:
            raise ValueError(f"{experts} experts do not split over {self.size} expert-parallel ranks")
        n = experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


ALL_EXPERTS = ExpertShard()


def capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int:
    """Assignments one expert serves per microbatch of `tokens` tokens (Note [expert capacity])."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def keep_mask(chosen: Tensor, experts: int, cap: int) -> Tensor:
    """chosen [b, S, K]: every token's experts in a microbatch -> bool [b, S, K], the assignments kept."""
    b, s, k = chosen.shape
    queue = chosen.permute(2, 0, 1).reshape(-1)                    # slot-major, then sequence, then position
    arrival = F.one_hot(queue, experts).cumsum(0).gather(1, queue[:, None]).squeeze(1)   # 1-based, per expert
    return (arrival <= cap).view(k, b, s).permute(1, 2, 0)


class SequenceRouting:
    """The cp group a rank's tokens share a microbatch with, and their positions (Note [expert capacity])."""

    def __init__(self, group, positions: Tensor, seq: int) -> None:
        self.group, self.positions, self.seq = group, positions, seq

    def whole(self, chosen: Tensor) -> Tensor:
        """This rank's routing [b, s, K] -> the microbatch's [b, S, K], gathered over the cp group."""
        b, s, k = chosen.shape
        mine = torch.cat([self.positions[:, None].to(chosen.dtype), chosen.permute(1, 0, 2).reshape(s, b * k)], 1)
        got = mine.new_empty((self.seq, b * k + 1))
        all_gather_into(got, mine.contiguous(), self.group)
        full = torch.empty_like(got[:, 1:])
        full[got[:, 0]] = got[:, 1:]
        return full.view(self.seq, b, k).permute(1, 0, 2)


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by `send` counts, rows from ranks by `recv` counts; backward the reverse."""

    @staticmethod
    def forward(ctx, x: Tensor, group, recv: list[int], send: list[int]) -> Tensor:
        ctx.group, ctx.recv, ctx.send = group, recv, send
        return _all_to_all(x, group, recv, send)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group, ctx.send, ctx.recv), None, None, None


def _all_to_all(x: Tensor, group, recv: list[int], send: list[int]) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    collectives.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class ExpertExchange:
    """Dispatch to and combine from the owners of the experts (Note [expert parallelism]); local for size 1."""

    def __init__(self, group=None, size: int = 1) -> None:
        self.group, self.size = group, size

    def __call__(self, sent: Tensor, counts: Tensor, run: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """sent: kept assignments' tokens sorted by expert; counts [E] per expert -> outputs, same order.

        `run(received, counts)` runs the local experts; `counts` [sources, local experts].
        """
        if self.group is None:
            if self.size > 1:
                raise RuntimeError(f"expert parallelism over {self.size} ranks needs its process group")
            return run(sent, counts.view(1, -1))
        mine = counts.view(self.size, -1)                 # what goes to each owner, per expert
        theirs = torch.empty_like(mine)
        collectives.all_to_all_single(theirs, mine.contiguous(), group=self.group)
        send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
        received = _AllToAll.apply(sent, self.group, recv, send)
        return _AllToAll.apply(run(received, theirs), self.group, send, recv)

    def __repr__(self) -> str:
        return f"ExpertExchange(ep={self.size})"


class MoE(nn.Module):
    """Top-k routed experts with a capacity; each token's output is the gate-weighted sum of its kept experts."""

    def __init__(self, model: ModelSpec, make_expert: Callable[[], nn.Module], shard: ExpertShard = ALL_EXPERTS,
                 device=None) -> None:
        super().__init__()
        assert model.moe is not None
        self.num_experts, self.top_k = model.moe.experts, model.moe.top_k
        self.capacity_factor = model.moe.capacity_factor
        self.router = ParallelLinear(model.hidden, model.moe.experts, bias=False, device=device)
        self.experts = nn.ModuleDict({str(e): make_expert() for e in shard.local(model.moe.experts)})
        self.exchange = ExpertExchange()
        self.routing: SequenceRouting | None = None

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        top_logits, chosen = self.router(tokens).float().topk(self.top_k, dim=-1)
        gates = torch.softmax(top_logits, dim=-1).to(x.dtype)
        rows, slots = self._kept(chosen.view(*x.shape[:2], self.top_k)).reshape(-1, self.top_k).nonzero(
            as_tuple=True)
        experts = chosen[rows, slots]
        order = torch.argsort(experts, stable=True)
        rows, slots, experts = rows[order], slots[order], experts[order]
        counts = torch.bincount(experts, minlength=self.num_experts)
        y = self.exchange(tokens[rows], counts, self._run_experts)
        return torch.zeros_like(tokens).index_add(0, rows, y * gates[rows, slots, None]).view_as(x)

    def _kept(self, chosen: Tensor) -> Tensor:
        b, s, _ = chosen.shape
        if self.routing is None:
            return keep_mask(chosen, self.num_experts, capacity(self.capacity_factor, b * s, self.top_k,
                                                                 self.num_experts))
        whole = self.routing.whole(chosen)
        cap = capacity(self.capacity_factor, b * self.routing.seq, self.top_k, self.num_experts)
        return keep_mask(whole, self.num_experts, cap)[:, self.routing.positions]

    def _run_experts(self, received: Tensor, counts: Tensor) -> Tensor:
        """Each local expert once on all its rows; rows come by source, then by expert."""
        sources, local = counts.shape
        sizes = counts.flatten().tolist()
        pieces = list(received.split(sizes))
        for j, expert in enumerate(self.experts.values()):
            mine = [i * local + j for i in range(sources)]
            out = expert(torch.cat([pieces[k] for k in mine]))
            for k, part in zip(mine, out.split([sizes[k] for k in mine])):
                pieces[k] = part
        return torch.cat(pieces) if pieces else received
