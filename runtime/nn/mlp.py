"""Feed-forward networks: SwiGLU (llama), GELU MLP (gpt), and a top-k MoE of either.

The dense MLPs are tensor-parallel regions: the up projections are
column-parallel, the down projection row-parallel (runtime/nn/tensor_parallel.py).
MoE blocks (runtime/nn/moe.py) route each token to its top-k experts, each a
dense MLP of the architecture, with a capacity and expert parallelism.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from hetc.runtime.nn.moe import ALL_EXPERTS, ExpertShard, MoE
from hetc.runtime.nn.tensor_parallel import NO_SHARD, ParallelLinear, Split, TPRegion, TPShard
from hetc.ir.spec import Arch, ModelSpec

__all__ = ["GeluMLP", "SwiGLU", "make_mlp"]


class SwiGLU(TPRegion):
    """w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, hidden: int, ffn: int, shard: TPShard = NO_SHARD, device=None) -> None:
        super().__init__()
        col = {"bias": False, "split": Split.COLUMN, "shard": shard, "device": device}
        self.w1 = ParallelLinear(hidden, ffn, **col)
        self.w3 = ParallelLinear(hidden, ffn, **col)
        self.w2 = ParallelLinear(ffn, hidden, bias=False, split=Split.ROW, shard=shard, scaled_init=True,
                                 device=device)

    def forward(self, x: Tensor) -> Tensor:
        x = self.tp.enter(x)
        return self.w2(F.silu(self.w1(x)) * self.w3(x), reduce=self.tp.exit)


class GeluMLP(TPRegion):
    """fc2(gelu(fc1 x)) with biases (GPT-2's tanh GELU)."""

    def __init__(self, hidden: int, ffn: int, shard: TPShard = NO_SHARD, device=None) -> None:
        super().__init__()
        self.fc1 = ParallelLinear(hidden, ffn, bias=True, split=Split.COLUMN, shard=shard, device=device)
        self.fc2 = ParallelLinear(ffn, hidden, bias=True, split=Split.ROW, shard=shard, scaled_init=True,
                                  device=device)

    def forward(self, x: Tensor) -> Tensor:
        x = self.tp.enter(x)
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"), reduce=self.tp.exit)


def _dense(model: ModelSpec, shard: TPShard, device) -> nn.Module:
    return (SwiGLU if model.arch is Arch.LLAMA else GeluMLP)(model.hidden, model.ffn, shard, device)


def make_mlp(model: ModelSpec, shard: TPShard = NO_SHARD, device=None,
             experts: ExpertShard = ALL_EXPERTS) -> nn.Module:
    """The feed-forward network of one block for `model`'s architecture (with `experts` of an MoE's)."""
    if model.moe is None:
        return _dense(model, shard, device)
    if shard.size > 1:
        raise ValueError("tensor parallelism of MoE blocks is not supported (use expert parallelism)")
    return MoE(model.hidden, model.moe, lambda: _dense(model, NO_SHARD, device), experts, device)
