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
ops of an EP group guarantee (Note [compute collectives], hetc/ir/program.py).

Note [static routing shapes]
Routing keeps every shape a function of the microbatch's size, never of
the routing, so a layer reads nothing back to the host: all T·K
assignments are sorted by expert with the dropped ones given expert E (so
they sort last, the kept ones in the same stable order as before), the
per-expert counts are a scatter-add (bincount reads its maximum back on
CUDA), and the local experts run as grouped matmuls that take the counts
on the device (Note [grouped experts], runtime/nn/grouped_experts.py) and
give the dropped rows zero. One synchronisation stays, under expert
parallelism only: `all_to_all_single` takes its split sizes as host
integers, so the exchanged counts are read back once per MoE layer and
microbatch (`send, recv = ....tolist()`), as in Megatron's and
torchtitan's token-choice dispatch. Dropping it needs a static capacity
per (source, expert) pair, i.e. padded all-to-alls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetc.runtime.nn import collectives
from hetc.runtime.nn.grouped_experts import grouped_mlp
from hetc.runtime.nn.tensor_parallel import ParallelLinear, all_gather_into
from hetc.ir.spec import MoESpec

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
        """sent: assignments' tokens sorted by expert, the kept ones (`counts` [E] per expert) first -> outputs in
        the same order, for the kept ones at least (Note [static routing shapes]).

        `run(received, counts)` runs the local experts; `counts` [sources, local experts].
        """
        if self.group is None:
            if self.size > 1:
                raise RuntimeError(f"expert parallelism over {self.size} ranks needs its process group")
            return run(sent, counts.view(1, -1))
        mine = counts.view(self.size, -1)                 # what goes to each owner, per expert
        theirs = torch.empty_like(mine)
        collectives.all_to_all_single(theirs, mine.contiguous(), group=self.group)
        send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()    # the one host sync (Note [static routing shapes])
        received = _AllToAll.apply(sent[:sum(send)], self.group, recv, send)
        return _AllToAll.apply(run(received, theirs), self.group, send, recv)

    def __repr__(self) -> str:
        return f"ExpertExchange(ep={self.size})"


class MoE(nn.Module):
    """Top-k routed experts with a capacity; each token's output is the gate-weighted sum of its kept experts."""

    def __init__(self, hidden: int, moe: MoESpec, make_expert: Callable[[], nn.Module],
                 shard: ExpertShard = ALL_EXPERTS, device=None) -> None:
        super().__init__()
        self.num_experts, self.top_k = moe.experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.router = ParallelLinear(hidden, moe.experts, bias=False, device=device)
        self.experts = nn.ModuleDict({str(e): make_expert() for e in shard.local(moe.experts)})
        self.exchange = ExpertExchange()
        self.routing: SequenceRouting | None = None

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        top_logits, chosen = self.router(tokens).float().topk(self.top_k, dim=-1)
        gates = torch.softmax(top_logits, dim=-1).to(x.dtype).reshape(-1)
        kept = self._kept(chosen.view(*x.shape[:2], self.top_k)).reshape(-1)
        experts = torch.where(kept, chosen.reshape(-1), self.num_experts)     # dropped ones sort last
        order = torch.argsort(experts, stable=True)
        counts = experts.new_zeros(self.num_experts + 1).scatter_add_(0, experts, torch.ones_like(experts))
        rows = order // self.top_k
        y = self.exchange(tokens[rows], counts[:-1], self._run_experts)
        served = y.shape[0]                  # all T·K rows locally, the kept ones after an exchange
        return torch.zeros_like(tokens).index_add(0, rows[:served], y * gates[order[:served], None]).view_as(x)

    def _kept(self, chosen: Tensor) -> Tensor:
        b, s, _ = chosen.shape
        if self.routing is None:
            return keep_mask(chosen, self.num_experts, capacity(self.capacity_factor, b * s, self.top_k,
                                                                 self.num_experts))
        whole = self.routing.whole(chosen)
        cap = capacity(self.capacity_factor, b * self.routing.seq, self.top_k, self.num_experts)
        return keep_mask(whole, self.num_experts, cap)[:, self.routing.positions]

    def _run_experts(self, received: Tensor, counts: Tensor) -> Tensor:
        """The local experts on all their rows at once; rows come by source, then by expert."""
        experts = list(self.experts.values())
        if counts.shape[0] == 1:
            return grouped_mlp(experts, received, counts[0].cumsum(0).to(torch.int32))
        by_expert = _expert_major(counts, received.shape[0])
        y = grouped_mlp(experts, received[by_expert], counts.sum(0).cumsum(0).to(torch.int32))
        return y[torch.argsort(by_expert)]


def _expert_major(counts: Tensor, rows: int) -> Tensor:
    """The permutation that takes `rows` rows ordered (source, expert) to (expert, source); on the device."""
    sources, local = counts.shape
    block = torch.arange(sources * local, device=counts.device)
    block_of_row = torch.repeat_interleave(block, counts.flatten(), output_size=rows)   # output_size: no sync
    return torch.argsort(block_of_row % local, stable=True)
