"""One block of attention through torch's SDPA kernels, returning the log-sum-exp that merges blocks.

Note [ring blocks through SDPA]
Ring attention (runtime/nn/ring_attention.py) attends a rank's queries to
one visiting K/V block at a time and merges the blocks by their
log-sum-exp, as flash attention merges its tiles and torch's own
context-parallel attention (torch.distributed.tensor.experimental) merges
its ring steps. A block is square (the query and key chunks have one size)
and either full or causal with the top-left diagonal, which is SDPA's
`is_causal` for a square block. Each block runs in the compute dtype
through the SDPA kernel that returns the LSE:

- CPU: `aten._scaled_dot_product_flash_attention_for_cpu`, any float dtype;
- CUDA, fp16/bf16, head_dim a multiple of 8 up to 256:
  `aten._scaled_dot_product_flash_attention`;
- otherwise (fp32 on CUDA, odd head sizes): `GroupedMath`, the same
  computation written out in the compute dtype. (The memory-efficient
  kernel would serve fp32 on CUDA, but its LSE is padded to 32 rows and its
  GQA needs repeated K/V; left for a run on a GPU to prove.)

Both kernels take K/V with fewer heads than Q (GQA) as they are. Backward
calls the kernel's own backward per block with the *merged* output and LSE
(not the block's): the kernel recomputes P = exp(S − LSE) and
D = rowsum(dO ∘ O), which with the merged ones is exactly this block's share
of dQ, dK, dV (flash attention's backward, tile by tile). The merge and the
accumulators stay in fp32.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["BlockKernel", "CpuFlash", "CudaFlash", "GroupedMath", "block_kernel"]

aten = torch.ops.aten


class BlockKernel(Protocol):
    """Attention of q [b, h, s, d] to one K/V block [b, h_kv, s, d] and its backward (Note [ring blocks through SDPA])."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """-> (output in q's dtype, LSE [b, h, s] in fp32)."""
        ...

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """This block's (dq, dk, dv), given the merged `out` and `lse` of all blocks."""
        ...


class CpuFlash:
    """torch's flash attention for CPU: (out, lse) forward, its matching backward."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)


class CudaFlash:
    """torch's flash attention for CUDA (fp16/bf16).

    Its backward also takes the forward's sequence bookkeeping (cumulative lengths, maxima, RNG state); every
    block of a ring has the same shape and no dropout, so the last forward's serve every backward call.
    """

    def __init__(self) -> None:
        self._rest: tuple | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        self._rest = tuple(rest[:6])          # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, offset
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        assert self._rest is not None, "backward before forward"
        cum_q, cum_k, max_q, max_k, seed, offset = self._rest
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


class GroupedMath:
    """The block written out in the compute dtype; a GQA group's query heads share their K/V head by reshaping
    q [b, h, s, d] to [b, h_kv, g·s, d], so K/V are never repeated. Softmax statistics in fp32."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        s = _scores(q, k, causal, scale)
        lse = torch.logsumexp(s.float(), dim=-1)
        out = torch.matmul(torch.exp(s.float() - lse[..., None]).to(v.dtype), v)
        return out.view(q.shape), lse.view(q.shape[:-1])

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        grouped = _grouped(q, k.shape[1])
        dout_g, lse_g = _grouped(dout, k.shape[1]), lse.reshape(*k.shape[:2], -1)
        p = torch.exp(_scores(q, k, causal, scale).float() - lse_g[..., None])
        delta = (dout.float() * out.float()).sum(-1).reshape(lse_g.shape)     # D = rowsum(dO ∘ O)
        dp = torch.matmul(dout_g, v.transpose(-1, -2)).float()
        ds = (p * (dp - delta[..., None]) * scale).to(q.dtype)
        dq = torch.matmul(ds, k).view(q.shape)
        dk = torch.matmul(ds.transpose(-1, -2), grouped)           # the matmul sums each group's query heads
        dv = torch.matmul(p.to(dout.dtype).transpose(-1, -2), dout_g)
        return dq, dk, dv


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """[b, h, s, d] -> [b, h_kv, g·s, d]: query head h_kv·g + i sits in group h_kv (repeat_interleave's order)."""
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads * s, d)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    """Scaled scores [b, h_kv, g·s, s] in q's dtype, -inf above the diagonal when causal."""
    s = torch.matmul(_grouped(q, k.shape[1]), k.transpose(-1, -2)) * scale
    if causal:
        seq = q.shape[2]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask.repeat(q.shape[1] // k.shape[1], 1), float("-inf"))
    return s


def block_kernel(q: Tensor) -> BlockKernel:
    """The SDPA kernel for blocks like `q` (Note [ring blocks through SDPA])."""
    if q.device.type == "cpu":
        return CpuFlash()
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.device.type == "cuda" and half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return CudaFlash()
    return GroupedMath()
