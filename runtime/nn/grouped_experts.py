"""A rank's local experts as grouped matmuls: one `torch._grouped_mm` per projection, for all experts at once.

Note [grouped experts]
Rows arrive sorted by expert; `offs` [E] int32 holds the cumulative row
counts (group e is rows offs[e−1]..offs[e]). `torch._grouped_mm` multiplies
each group by its expert's weight in one call, reading the counts on the
device, so running the experts needs no host synchronisation and no Python
loop over experts. Rows past offs[−1] (the assignments a capacity dropped,
which the MoE layer carries to keep its shapes static) are ignored by the
kernel and left undefined, so every product here zeroes them, in forward
and in backward: no garbage can reach a bias gradient or a token gradient.

The experts keep their own parameters (`experts.{e}.w1.weight` ...), so
checkpoints, HF export and the flat layout are as before. The kernel wants
one [E, out, in] weight: `_GroupedLinear` stacks the experts' weights in
forward and again in backward instead of saving the stack, so the copy lives
for one product (not from forward to backward), and returns each expert's
gradient as a slice of the stacked one. The kernel also wants rows and
weights aligned to 16 bytes; a dimension that is not is padded with zeros,
which leaves every sum exact. Biases (GELU experts) are added after the
product, gathered by each row's expert: in bf16 that is one more rounding
than `F.linear`'s fused bias, within bf16's tolerance; fp32 is unchanged.

torch documents the fused CUDA kernel for bf16 (SM ≥ 80); for other dtypes
torch runs its own fallback (an mm per group). Whether that fallback reads
`offs` back to the host is torch's business and was not measured here (no
GPU); a bf16 model, the case that matters, takes the fused kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["grouped_mlp"]

_ALIGN_BYTES = 16


def _pad_last(x: Tensor, size: int) -> Tensor:
    return F.pad(x, (0, size - x.shape[-1])) if x.shape[-1] != size else x


def _aligned(size: int, dtype: torch.dtype) -> int:
    multiple = max(1, _ALIGN_BYTES // dtype.itemsize)
    return -(-size // multiple) * multiple


class _GroupedLinear(torch.autograd.Function):
    """x [n, in] (rows grouped by `offs`) times each group's weight [out, in] transposed -> [n, out]."""

    @staticmethod
    def forward(ctx, x: Tensor, offs: Tensor, valid: Tensor, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, offs, valid, *weights)
        w = _stacked(weights, x.dtype)
        y = torch._grouped_mm(_pad_last(x, w.shape[2]), w.transpose(1, 2), offs=offs)
        return torch.where(valid[:, None], y[:, :weights[0].shape[0]], 0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, offs, valid, *weights = ctx.saved_tensors
        out_features, in_features = weights[0].shape
        w = _stacked(weights, x.dtype)
        g = _pad_last(grad.to(x.dtype), w.shape[1])
        dx = torch._grouped_mm(g, w, offs=offs)[:, :in_features]
        dw = torch._grouped_mm(g.t(), _pad_last(x, w.shape[2]), offs=offs)[:, :out_features, :in_features]
        return (torch.where(valid[:, None], dx, 0), None, None, *dw.unbind(0))


def _stacked(weights: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """The experts' weights as one [E, out, in] tensor, both dims padded to the kernel's alignment."""
    out_features, in_features = weights[0].shape
    w = torch.stack(weights).to(dtype)
    return F.pad(w, (0, _aligned(in_features, dtype) - in_features, 0, _aligned(out_features, dtype) - out_features))


def _linear(x: Tensor, offs: Tensor, valid: Tensor, layers: list[nn.Linear], group: Tensor) -> Tensor:
    """Each row through its group's layer; `group` [n] the row's expert (for the biases)."""
    y = _GroupedLinear.apply(x, offs, valid, *(layer.weight for layer in layers))
    if layers[0].bias is None:
        return y
    return y + torch.stack([layer.bias for layer in layers])[group]


def grouped_mlp(experts: list[nn.Module], x: Tensor, offs: Tensor) -> Tensor:
    """Rows x [n, hidden] sorted by expert, `offs` [E] int32 their cumulative counts -> each row through its
    expert (SwiGLU `w1, w3, w2` or GELU `fc1, fc2`); rows past offs[-1] come out zero."""
    rows = torch.arange(x.shape[0], device=x.device)
    valid = rows < offs[-1]
    group = torch.searchsorted(offs, rows.to(offs.dtype), right=True).clamp_(max=len(experts) - 1)

    def linear(name: str, h: Tensor) -> Tensor:
        return _linear(h, offs, valid, [getattr(e, name) for e in experts], group)

    if hasattr(experts[0], "w1"):
        y = linear("w2", F.silu(linear("w1", x)) * linear("w3", x))
    else:
        y = linear("fc2", F.gelu(linear("fc1", x), approximate="tanh"))
    return torch.where(valid[:, None], y, 0)        # past offs[-1] a bias would have made them nonzero
