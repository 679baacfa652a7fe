"""Normalisation layers: RMSNorm (llama), LayerNorm (gpt) and the per-head RMSNorm of q and k (Qwen3).

Every norm is `TPAware` (runtime/nn/tensor_parallel.py): a norm of the residual stream sees
the same tokens on every tp rank (all of them, or this rank's part under
sequence parallelism, where `replicated` sums its gradient). A `HeadNorm`
sits inside the attention region and sees only this rank's heads, so its
gradient is always a partial sum: `partial` sums it over the tp group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetc.runtime.nn.tensor_parallel import TPAware

__all__ = ["NORMS", "HeadNorm", "LayerNorm", "RMSNorm"]


class RMSNorm(TPAware, nn.Module):
    """x / rms(x) * weight, the reduction in fp32."""

    def __init__(self, dim: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return self._normed(x) * self.tp.replicated(self.weight)

    def _normed(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class HeadNorm(RMSNorm):
    """RMSNorm over the head dimension of q or k [b, h, s, d], one weight shared by every head."""

    def forward(self, x: Tensor) -> Tensor:
        return self._normed(x) * self.tp.partial(self.weight)


class LayerNorm(TPAware, nn.LayerNorm):
    """`nn.LayerNorm` whose parameters go through the TP hook (sequence parallelism)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.tp.replicated(self.weight),
                            self.tp.replicated(self.bias), self.eps)


NORMS = (RMSNorm, nn.LayerNorm)
