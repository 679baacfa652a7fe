"""DeepSpeed-Ulysses sequence parallelism: an attention core around two all-to-alls.

Each cp rank holds a contiguous slice of the sequence with all of its (tp
shard's) heads (hetc/ir/layout.py). Around attention, an all-to-all trades
that for all of the sequence with 1/cp of the heads, the local causal core
runs head-wise, and a second all-to-all trades back (survey I.IV, III.III).
The cp ranks' slices are in sequence order, so the gathered sequence is the
full one and the ordinary causal mask applies.

GQA: the query heads of one K/V head must land on the rank that gets that
K/V head. When the K/V heads do not split over cp, each is repeated (the
fewest times that makes them split) before the exchange, so every rank
receives the K/V heads its query heads use; autograd sums the repeats'
gradients back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from hetc.runtime.nn import collectives
from hetc.runtime.nn.attention import AttentionCore, causal_attention
from hetc.runtime.nn.tensor_parallel import conjugate

__all__ = ["UlyssesAttention", "heads_to_seq", "kv_repeats", "seq_to_heads"]


def _all_to_all(x: Tensor, group) -> Tensor:
    out = torch.empty_like(x)
    collectives.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, group) -> Tensor:
    """[b, h, s, d] (this rank's tokens, all heads) -> [b, h/n, n·s, d] (all tokens, its heads)."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()    # part j goes to rank j
    got = _all_to_all(parts, group)                                        # part i came from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: Tensor, group) -> Tensor:
    """The inverse of `_seq_to_heads`: [b, h/n, n·s, d] -> [b, h, s, d]."""
    n = dist.get_world_size(group)
    b, hn, ns, d = x.shape
    parts = x.reshape(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(parts, group)
    return got.transpose(0, 1).reshape(b, n * hn, ns // n, d)


_seq_to_heads_fn = conjugate("SeqToHeads", _seq_to_heads, _heads_to_seq)
heads_to_seq = conjugate("HeadsToSeq", _heads_to_seq, _seq_to_heads)


def seq_to_heads(x: Tensor, group) -> Tensor:
    if x.shape[1] % dist.get_world_size(group):
        raise ValueError(f"{x.shape[1]} heads do not split over {dist.get_world_size(group)} Ulysses ranks")
    return _seq_to_heads_fn(x, group)


def kv_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """How many times to repeat each K/V head so that they split over `cp` ranks with their query heads."""
    group = q_heads // kv_heads
    found = next((r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % cp == 0), None)
    if found is None:
        raise ValueError(f"{q_heads} query heads do not split over {cp} Ulysses ranks")
    return found


class UlyssesAttention:
    """An `AttentionCore` for one cp group: all-to-all, `inner` on 1/cp of the heads, all-to-all back."""

    def __init__(self, group, inner: AttentionCore = causal_attention) -> None:
        self.group = group
        self.inner = inner

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
        repeats = kv_repeats(q.shape[1], k.shape[1], dist.get_world_size(self.group))
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))
        return heads_to_seq(self.inner(q, k, v, dropout_p), self.group)

    def __repr__(self) -> str:
        return f"UlyssesAttention(cp={dist.get_world_size(self.group)})"
