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

Note [load-balancing loss]
With aux_loss_coeff = c > 0 each MoE layer adds Switch Transformer's
balancing loss, as Megatron-LM's `switch_load_balancing_loss_func` computes
it: c · E · Σ_e f_e · P_e over a microbatch, f_e the share of its T·K
assignments that chose expert e (before capacity drops them) and P_e the
mean over its T tokens of the router's softmax over all E experts; Hugging
Face's Mixtral loss is K times this (it does not divide by K). It is not
added to the loss the run reports: as Megatron-LM's MoEAuxLossAutoScaler
does, the layer's output carries it into backward (`_WithBalancing`), whose
gradient for it is the one the microbatch's loss is seeded with (1/m, times
fp16's loss scale: `MoE.aux_seed`, set by the interpreter each step), so it
trains every plan as the one-rank reference. Each microbatch's backward
tallies the layer's loss (not its forward, which activation checkpointing
runs twice); the step reports their mean over microbatches and MoE layers,
without the coefficient, as `load_balancing_loss` (Megatron-LM's log line,
about 1 when the router spreads tokens evenly), reduced with the loss (one
all-reduce: runtime/interpreter.py). Under context parallelism f_e
counts the whole microbatch's routing (the gathered one capacity reads) and
each cp rank adds its own tokens' share of Σ_t p_te, as its share of the
language-model loss is its own tokens'. Its cost (a softmax over E logits a
token) is not timed.

Note [router z-loss]
With z_loss_coeff = c > 0 each MoE layer adds ST-MoE's router z-loss, as
Megatron-LM's `z_loss_func` computes it: c times the mean over a
microbatch's tokens of logsumexp(router logits)², which keeps the logits
(and the softmax's exponent in bf16) small. It reaches backward as the
balancing loss does (`_WithAuxLoss`, with the loss's seed), so every plan
trains as the one-rank reference; under context parallelism each cp rank
adds its own tokens' share of the mean. Each step reports it as `z_loss`,
tallied and reduced as the balancing loss is, without the coefficient
(Megatron-LM's z_loss). Its cost is not timed.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetc.runtime.nn import collectives
from hetc.runtime.nn.grouped_experts import grouped_mlp
from hetc.runtime.nn.tensor_parallel import ParallelLinear, all_gather_into
from hetc.ir.spec import ModelSpec, MoESpec

__all__ = [
    "ALL_EXPERTS",
    "AuxLoss",
    "ExpertExchange",
    "ExpertShard",
    "MoE",
    "SequenceRouting",
    "aux_loss_mean",
    "capacity",
    "clear_aux_tallies",
    "is_expert_param",
    "keep_mask",
    "moe_layers",
    "reported_aux_losses",
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
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.aux_seed = 1.0      # the gradient of the balancing loss and z-loss: Note [load-balancing loss]
        self.added = reported_aux_losses(moe)    # the auxiliary losses it adds: those with a coefficient
        # each one's values this step, as each microbatch's backward ran
        self.tallied: dict[AuxLoss, list[Tensor]] = {kind: [] for kind in self.added}

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens).float()
        top_logits, chosen = logits.topk(self.top_k, dim=-1)
        gates = torch.softmax(top_logits, dim=-1).to(x.dtype).reshape(-1)
        whole = chosen.view(*x.shape[:2], self.top_k)
        whole = whole if self.routing is None else self.routing.whole(whole)
        kept = self._kept(whole).reshape(-1)
        experts = torch.where(kept, chosen.reshape(-1), self.num_experts)     # dropped ones sort last
        order = torch.argsort(experts, stable=True)
        counts = experts.new_zeros(self.num_experts + 1).scatter_add_(0, experts, torch.ones_like(experts))
        rows = order // self.top_k
        y = self.exchange(tokens[rows], counts[:-1], self._run_experts)
        served = y.shape[0]                  # all T·K rows locally, the kept ones after an exchange
        out = torch.zeros_like(tokens).index_add(0, rows[:served], y * gates[order[:served], None]).view_as(x)
        if self.training and torch.is_grad_enabled():
            for kind in self.added:
                loss = self.balancing_loss(logits, whole) if kind is AuxLoss.LOAD_BALANCING else \
                    self.z_loss(logits, whole)
                out = _WithAuxLoss.apply(out, loss, self.aux_seed, self.tallied[kind])
        return out

    def _kept(self, whole: Tensor) -> Tensor:
        """Which of this rank's assignments fit their expert's capacity, from the microbatch's routing."""
        b, s, _ = whole.shape
        mask = keep_mask(whole, self.num_experts, capacity(self.capacity_factor, b * s, self.top_k, self.num_experts))
        return mask if self.routing is None else mask[:, self.routing.positions]

    def balancing_loss(self, logits: Tensor, whole: Tensor) -> Tensor:
        """This rank's share of the layer's load-balancing loss (Note [load-balancing loss]): `logits` of its
        tokens, `whole` the microbatch's routing [b, S, K]."""
        tokens = whole.shape[0] * whole.shape[1]
        chosen = whole.reshape(-1)
        counts = chosen.new_zeros(self.num_experts).scatter_add_(0, chosen, torch.ones_like(chosen))
        probs = torch.softmax(logits, dim=-1).sum(0)
        scale = self.aux_loss_coeff * self.num_experts / (tokens * tokens * self.top_k)
        return (probs * counts.to(probs.dtype)).sum() * scale

    def z_loss(self, logits: Tensor, whole: Tensor) -> Tensor:
        """This rank's share of the layer's router z-loss (Note [router z-loss]): `logits` of its tokens, `whole`
        the microbatch's routing [b, S, K] (whose tokens the mean is over)."""
        tokens = whole.shape[0] * whole.shape[1]
        return torch.logsumexp(logits, dim=-1).square().sum() * (self.z_loss_coeff / tokens)

    def _run_experts(self, received: Tensor, counts: Tensor) -> Tensor:
        """The local experts on all their rows at once; rows come by source, then by expert."""
        experts = list(self.experts.values())
        if counts.shape[0] == 1:
            return grouped_mlp(experts, received, counts[0].cumsum(0).to(torch.int32))
        by_expert = _expert_major(counts, received.shape[0])
        y = grouped_mlp(experts, received[by_expert], counts.sum(0).cumsum(0).to(torch.int32))
        return y[torch.argsort(by_expert)]


class AuxLoss(StrEnum):
    """The MoE layers' auxiliary losses each step reports, by their metric names (Megatron-LM's)."""

    LOAD_BALANCING = "load_balancing_loss"    # Note [load-balancing loss]
    Z = "z_loss"                              # Note [router z-loss]

    def coeff(self, moe: MoESpec) -> float:
        return moe.aux_loss_coeff if self is AuxLoss.LOAD_BALANCING else moe.z_loss_coeff

    @property
    def label(self) -> str:
        """Its name in the step line (`load balancing 0.9871`)."""
        return "load balancing" if self is AuxLoss.LOAD_BALANCING else "z loss"


def reported_aux_losses(moe: MoESpec | None) -> tuple[AuxLoss, ...]:
    """The auxiliary losses the MoE layers of `moe` add, which each step reports: those with a coefficient."""
    return tuple(kind for kind in AuxLoss if moe is not None and kind.coeff(moe) > 0)


def aux_loss_mean(kind: AuxLoss, tallied: float, model: ModelSpec, microbatches: int) -> float:
    """The step's reported `kind` from the sum of its layers' tallies over its `microbatches`: their mean per
    microbatch and MoE layer (every block's), without the coefficient, as Megatron-LM logs it."""
    assert model.moe is not None    # reported_aux_losses(model.moe)
    return tallied / (microbatches * model.layers * kind.coeff(model.moe))


def clear_aux_tallies(layers: Iterable[MoE]) -> None:
    for layer in layers:
        for values in layer.tallied.values():
            values.clear()


def moe_layers(modules: Iterable[nn.Module]) -> list[MoE]:
    """The MoE layers inside `modules`, each once."""
    found = {id(sub): sub for module in modules for sub in module.modules() if isinstance(sub, MoE)}
    return list(found.values())


class _WithAuxLoss(torch.autograd.Function):
    """The layer's output unchanged, carrying an auxiliary loss (balancing, z) into backward with gradient `seed`
    (Megatron-LM's MoEAuxLossAutoScaler): Note [load-balancing loss]."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, seed: float, tally: list[Tensor]) -> Tensor:
        ctx.loss, ctx.seed, ctx.tally = loss.detach(), seed, tally
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        # tallied here, once per microbatch: activation checkpointing runs the forward again, backward never
        ctx.tally.append(ctx.loss)
        return grad, torch.full_like(ctx.loss, ctx.seed), None, None


def _expert_major(counts: Tensor, rows: int) -> Tensor:
    """The permutation that takes `rows` rows ordered (source, expert) to (expert, source); on the device."""
    sources, local = counts.shape
    block = torch.arange(sources * local, device=counts.device)
    block_of_row = torch.repeat_interleave(block, counts.flatten(), output_size=rows)   # output_size: no sync
    return torch.argsort(block_of_row % local, stable=True)
