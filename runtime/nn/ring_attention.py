"""Ring attention: K/V blocks travel around the cp ranks; an online softmax merges them.

Every cp rank holds the queries, keys and values of its own tokens (all of
its tp shard's heads). In forward the compact K/V (not expanded to the
query heads) go around the ring once; each rank attends its queries to each
visiting block and merges the partial results with a running log-sum-exp
(flash attention's online softmax), keeping only the output and the LSE.
Each block runs through torch's SDPA kernel in the compute dtype; the merge
and the accumulators are fp32 (Note [ring blocks through SDPA],
runtime/nn/sdpa_blocks.py).
Backward recomputes the probabilities block by block from the LSE; K/V go
around again and their gradient accumulators travel with them, arriving
home after a full turn. Per rank and layer that moves 2 (forward) + 4
(backward) tensors of b·S/cp·N_kv·d around cp−1 (K/V) or cp (gradient)
hops: the survey's 6·(N_kv/N_q)·δbSH.

Note [zigzag]: with a causal mask the cost of a query block depends on how
many keys precede it. The sequence is cut into 2·cp chunks and cp rank c
holds chunks c and 2cp−1−c (hetc/ir/layout.py), so every rank has the same
causal work. A query chunk i and a key chunk j meet fully (j < i), causally
(j = i) or not at all (j > i); whole blocks are skipped, never half-masked.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from hetc.ir.errors import InternalError
from hetc.runtime.nn import collectives
from hetc.runtime.nn.sdpa_blocks import block_kernel

__all__ = ["Ring", "RingAttention", "wait_all", "zigzag_chunks"]


def zigzag_chunks(cp_rank: int, cp: int) -> tuple[int, ...]:
    """The chunk indices (of 2·cp) a cp rank holds, in local order; a single chunk when cp = 1."""
    return (0,) if cp == 1 else (cp_rank, 2 * cp - 1 - cp_rank)


class Ring:
    """Point-to-point neighbours of one rank in its cp group (global ranks, ring order)."""

    def __init__(self, group, ranks: tuple[int, ...], cp_rank: int) -> None:
        self.group, self.ranks, self.cp_rank = group, ranks, cp_rank
        self.size = len(ranks)
        self.next = ranks[(cp_rank + 1) % self.size]
        self.prev = ranks[(cp_rank - 1) % self.size]

    def source(self, step: int) -> int:
        """The cp rank whose K/V this rank holds at `step` of a turn."""
        return (self.cp_rank - step) % self.size

    def shift(self, tensors: list[Tensor]):
        """Send `tensors` to the next rank, receive the previous rank's; (received, works to wait)."""
        got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag=i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, g, self.prev, self.group, tag=i) for i, g in enumerate(got)]
        return got, collectives.batch_isend_irecv(ops)


def wait_all(works) -> None:
    for w in works:
        w.wait()


def _visits(ring: Ring, kv: list[Tensor]):
    """One turn: yield (the K/V this rank holds, their chunk indices) per step, the next K/V moving meanwhile."""
    for step in range(ring.size):
        works = []
        if step + 1 < ring.size:
            nxt, works = ring.shift(kv)
        yield kv, zigzag_chunks(ring.source(step), ring.size)
        if works:
            wait_all(works)
            kv = nxt


def _pairs(mine: tuple[int, ...], theirs: tuple[int, ...]):
    """(query chunk slot, key chunk slot, causal) for every block that is not fully masked."""
    for qi, qc in enumerate(mine):
        for kj, kc in enumerate(theirs):
            if kc <= qc:
                yield qi, kj, kc == qc


def _chunk(x: Tensor, slot: int, n: int) -> Tensor:
    """Chunk `slot` of `n` along the sequence (dim 2 of [b, h, s, ...])."""
    size = x.shape[2] // n
    return x[:, :, slot * size:(slot + 1) * size]


def _chunks(x: Tensor, n: int) -> list[Tensor]:
    """All `n` chunks, each contiguous: a kernel's input, reused by every block of that chunk."""
    return [_chunk(x, slot, n).contiguous() for slot in range(n)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        kernel = block_kernel(q)
        mine = zigzag_chunks(ring.cp_rank, ring.size)
        n = len(mine)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        qs = _chunks(q, n)
        for kv, theirs in _visits(ring, [k, v]):
            ks, vs = _chunks(kv[0], n), _chunks(kv[1], n)
            for qi, kj, causal in _pairs(mine, theirs):
                block_out, block_lse = kernel.forward(qs[qi], ks[kj], vs[kj], causal, scale)
                _merge(_chunk(out, qi, n), _chunk(lse, qi, n), block_out, block_lse)
        out = out.to(q.dtype)
        ctx.ring, ctx.scale, ctx.kernel = ring, scale, kernel
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, kernel = ctx.ring, ctx.scale, ctx.kernel
        mine = zigzag_chunks(ring.cp_rank, ring.size)
        n = len(mine)
        dout = grad_out.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
        qs, douts, outs, lses = _chunks(q, n), _chunks(dout, n), _chunks(out, n), _chunks(lse, n)
        for kv, theirs in _visits(ring, [k, v]):
            ks, vs = _chunks(kv[0], n), _chunks(kv[1], n)
            for qi, kj, causal in _pairs(mine, theirs):
                grads = kernel.backward(douts[qi], qs[qi], ks[kj], vs[kj], outs[qi], lses[qi], causal, scale)
                for acc, grad in zip((_chunk(dq, qi, n), _chunk(dkv[0], kj, n), _chunk(dkv[1], kj, n)), grads,
                                     strict=True):
                    acc.add_(grad)
            if ring.size > 1:        # the accumulators follow their K/V; after a full turn they are home
                dkv, works = ring.shift(dkv)
                wait_all(works)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merge one block's (output, LSE) into the running fp32 (out, lse) in place (the online softmax)."""
    block_lse = block_lse.float()
    merged = torch.logaddexp(lse, block_lse)
    out.copy_(out * torch.exp(lse - merged)[..., None] + block_out.float() * torch.exp(block_lse - merged)[..., None])
    lse.copy_(merged)


class RingAttention:
    """An `AttentionCore` for one cp group (global `ranks` in cp order; this rank is `cp_rank`)."""

    def __init__(self, group, ranks: tuple[int, ...], cp_rank: int) -> None:
        self.ring = Ring(group, tuple(ranks), cp_rank)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
        if dropout_p:   # validation refuses attention_dropout beside ring attention
            raise InternalError("ring attention has no dropout")
        return _RingAttention.apply(q, k, v, self.ring)

    def __repr__(self) -> str:
        return f"RingAttention(cp={self.ring.size}, cp_rank={self.ring.cp_rank})"
