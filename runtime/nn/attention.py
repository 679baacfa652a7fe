"""Multi-head attention with GQA, RoPE and a replaceable attention core.

The projections are tensor-parallel shards (runtime/nn/tensor_parallel.py): each tp rank
holds N_q/tp query heads and N_kv/tp key/value heads, contiguous, so the
query heads of one GQA group stay on the rank that holds their K/V.

`Attention.core` is the hook where the attention core runs: it takes
q [b, n_q, s, d] and k, v [b, n_kv, s, d] (K/V *not* expanded to the query
heads, so ring attention passes the compact K/V around) and returns
[b, n_q, s, d]. The default is causal attention over the local sequence;
context parallelism replaces it (Ulysses: all-to-all to a head-sharded
layout around the local core; ring attention: K/V blocks around the ring
with an online softmax).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from hetc.runtime.nn.dropout import part_stream
from hetc.runtime.nn.norms import HeadNorm
from hetc.runtime.nn.tensor_parallel import NO_SHARD, ParallelLinear, Split, TPRegion, TPShard
from hetc.ir.spec import Arch, AttentionKind, ModelSpec, RopeScalingSpec

__all__ = ["Attention", "AttentionCore", "Rope", "Rotary", "apply_rope", "causal_attention", "scaled_frequencies",
           "unfused_causal_attention"]

Rope = tuple[Tensor, Tensor]


class AttentionCore(Protocol):
    """Causal attention of q over k, v ([b, heads, s, d]); `dropout_p`: the probabilities' dropout."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor: ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Causal softmax attention; each K/V head serves its group of query heads (GQA)."""
    # enable_gqa lets SDPA read each K/V head for its whole query group instead of our copying K/V
    # to every query head first (repeat_interleave: n_q/n_kv times the K/V memory, and its backward
    # a separate reduction). The forward is bitwise the same; K/V gradients sum the group in the
    # kernel's order, so they may differ from the copy's in the last bits.
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def unfused_causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """`causal_attention` with the scores and probabilities materialised (`attention = unfused`): QKᵀ, a masked
    softmax and AV as separate kernels, as Megatron-LM ran attention before flash attention."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s_q, s_k = scores.shape[-2:]
    future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")).float(), dim=-1).to(q.dtype)
    return F.dropout(probs, dropout_p) @ v if dropout_p > 0 else probs @ v


def scaled_frequencies(inv_freq: Tensor, scaling: RopeScalingSpec) -> Tensor:
    """Llama 3.1's `llama3` rule: wavelengths longer than original_seq / low_freq_factor are slowed by
    `factor`, shorter than original_seq / high_freq_factor kept, and those between interpolated."""
    wavelen = 2 * math.pi / inv_freq
    low, high = scaling.original_seq / scaling.low_freq_factor, scaling.original_seq / scaling.high_freq_factor
    smooth = (scaling.original_seq / wavelen - scaling.low_freq_factor) / \
        (scaling.high_freq_factor - scaling.low_freq_factor)
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low, inv_freq / scaling.factor, inv_freq)
    return torch.where((wavelen >= high) & (wavelen <= low), between, out)


class Rotary(torch.nn.Module):
    """RoPE angles for given token positions (no parameters)."""

    inv_freq: Tensor     # a buffer (register_buffer below)

    def __init__(self, head_dim: int, theta: float, device=None, scaling: RopeScalingSpec | None = None) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
        inv_freq = theta ** -exponents
        if scaling is not None:
            inv_freq = scaled_frequencies(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: Tensor) -> Rope:
        """cos and sin, each [s, head_dim], for positions [s] (any order: context parallelism
        may hold non-contiguous chunks)."""
        angles = positions.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate x [b, h, s, d] by the angles of `rope` (rotate-half convention), in fp32."""
    cos, sin = rope
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


class Attention(TPRegion):
    """Self-attention of one block; q/k/v column-parallel, output row-parallel."""

    def __init__(self, model: ModelSpec, shard: TPShard = NO_SHARD, device=None) -> None:
        super().__init__()
        h = model.hidden
        self.head_dim = model.head_size
        self.n_heads = shard.part(model.heads, "heads")
        self.n_kv_heads = shard.part(model.num_kv_heads, "kv_heads")
        gpt = model.arch is Arch.GPT
        q_out, kv_out = model.heads * self.head_dim, model.num_kv_heads * self.head_dim
        col = {"bias": gpt or model.qkv_bias, "split": Split.COLUMN, "shard": shard, "device": device}
        self.wq = ParallelLinear(h, q_out, **col)
        self.wk = ParallelLinear(h, kv_out, **col)
        self.wv = ParallelLinear(h, kv_out, **col)
        self.wo = ParallelLinear(q_out, h, bias=gpt or model.out_bias, split=Split.ROW, shard=shard,
                                 scaled_init=True, device=device)
        self.q_norm = HeadNorm(self.head_dim, model.norm_eps, device) if model.qk_norm else None
        self.k_norm = HeadNorm(self.head_dim, model.norm_eps, device) if model.qk_norm else None
        self.core: AttentionCore = unfused_causal_attention if model.attention is AttentionKind.UNFUSED \
            else causal_attention
        self.recompute_core = False  # selective activation checkpointing
        self.dropout_p = model.attention_dropout
        # the probabilities of this rank's heads are one part of the lane's (Note [dropout streams])
        self.dropout_part = shard.rank if shard.size > 1 else None

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = self.tp.enter(x)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:     # both or neither (model.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        recompute = self.recompute_core and torch.is_grad_enabled()    # selective activation checkpointing
        out = checkpoint(self._core, q, k, v, use_reentrant=False) if recompute else self._core(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        return self.wo(out, reduce=self.tp.exit)

    def _core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.dropout_p if self.training else 0.0
        if p == 0:
            return self.core(q, k, v)
        with part_stream(self.dropout_part, q.device):
            return self.core(q, k, v, p)
