"""The three kinds of model layer: embedding, transformer block, head.

Parameter names (relative to the layer) are fixed here and are part of the
contract: initial values are seeded by (seed, layer index, name) and
checkpoints and plan-invariance tests compare parameters by
`<layer name>.<name>` (e.g. `block3.attention.wq.weight`).

| layer | llama | gpt |
|---|---|---|
| embed | tok_embeddings | tok_embeddings, pos_embeddings |
| block | attention_norm, attention.{wq,wk,wv,wo} (biases with qkv_bias / out_bias; attention.{q_norm,k_norm} with qk_norm), ffn_norm, feed_forward.{w1,w2,w3} | ... LayerNorm, feed_forward.{fc1,fc2}, biases |
| head | norm, output (absent when tied, but for a tied copy) | norm (LayerNorm), output |

An MoE block's feed_forward is `router` and `experts.{e}.{w1,w2,w3 | fc1,fc2}`
with e the expert's global index, whichever rank holds it (runtime/nn/moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetc.runtime.nn.attention import Attention, Rope
from hetc.runtime.nn.dropout import dropout
from hetc.runtime.nn.mlp import make_mlp
from hetc.runtime.nn.moe import ALL_EXPERTS, ExpertShard
from hetc.runtime.nn.norms import NORMS, LayerNorm, RMSNorm
from hetc.runtime.nn.tensor_parallel import NO_SHARD, ParallelLinear, TPAware, TPShard
from hetc.ir.spec import Arch, ModelSpec

__all__ = ["NORMS", "Block", "Embedding", "Head", "LayerNorm", "RMSNorm", "make_norm"]


def make_norm(model: ModelSpec, device=None) -> nn.Module:
    if model.arch is Arch.LLAMA:
        return RMSNorm(model.hidden, model.norm_eps, device)
    return LayerNorm(model.hidden, eps=model.norm_eps, device=device)


class Embedding(TPAware, nn.Module):
    """Token embedding (plus learned positions for gpt): token ids -> [b, s, H]."""

    def __init__(self, model: ModelSpec, device=None) -> None:
        super().__init__()
        self.tok_embeddings = _embedding(model.vocab, model.hidden, device)
        self.pos_embeddings = _embedding(model.seq, model.hidden, device) if model.arch is Arch.GPT else None
        self.dropout_p = model.hidden_dropout
        self.dropout_part: int | None = None    # set where the lane holds the hidden state in parts (SP)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = F.embedding(tokens, self.tp.replicated(self.tok_embeddings.weight))
        if self.pos_embeddings is not None:
            x = x + F.embedding(positions, self.tp.replicated(self.pos_embeddings.weight))
        return dropout(x, self.dropout_p, self.training, self.dropout_part)


def _embedding(rows: int, dim: int, device) -> nn.Embedding:
    """An embedding table without nn.Embedding's own normal_ init: init_layer gives every parameter its
    values, and normal_ on the meta device (where layers are built) imports torch._dynamo, 1-2 s of every
    rank's start-up."""
    return nn.Embedding(rows, dim, _weight=nn.Parameter(torch.empty(rows, dim, device=device)))


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(norm(x))), then + drop(mlp(norm(.))), with the model's
    hidden dropout (Megatron-LM's bias-dropout-add; Note [dropout streams] in runtime/nn/dropout.py)."""

    def __init__(self, model: ModelSpec, shard: TPShard = NO_SHARD, device=None,
                 experts: ExpertShard = ALL_EXPERTS) -> None:
        super().__init__()
        self.attention_norm = make_norm(model, device)
        self.attention = Attention(model, shard, device)
        self.ffn_norm = make_norm(model, device)
        self.feed_forward = make_mlp(model, shard, device, experts)
        self.dropout_p = model.hidden_dropout
        self.dropout_part: int | None = None    # set where the lane holds the hidden state in parts (SP)

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        h = x + self._dropout(self.attention(self.attention_norm(x), rope))
        return h + self._dropout(self.feed_forward(self.ffn_norm(h)))

    def _dropout(self, x: Tensor) -> Tensor:
        return dropout(x, self.dropout_p, self.training, self.dropout_part)


class Head(TPAware, nn.Module):
    """Final norm and LM head; returns the mean token cross-entropy given labels.

    With tied embeddings there is no `output`: the caller passes the
    embedding matrix as `output_weight` — unless the head is a ministage
    apart from the embedding (`tied_copy`, Note [tied copies] in
    runtime/nn/model.py): then `output` holds its own copy of that matrix. When this rank holds only part of
    the sequence (context or sequence parallelism), `loss_tokens` is the
    microbatch's whole token count: the loss is this rank's cross-entropy sum
    over it, so the parts' losses add up to the mean.
    """

    def __init__(self, model: ModelSpec, device=None, tied_copy: bool = False) -> None:
        super().__init__()
        self.norm = make_norm(model, device)
        self.output = None if model.tied_embeddings and not tied_copy else \
            ParallelLinear(model.hidden, model.vocab, bias=False, device=device)

    def forward(self, x: Tensor, labels: Tensor | None = None, output_weight: Tensor | None = None,
                loss_tokens: int | None = None) -> Tensor:
        """The loss (a scalar, fp32) given labels [b, s]; the logits [b, s, V] without."""
        x = self.norm(x)
        if self.output is None:
            assert output_weight is not None, "a tied head is given the embedding's weight"
            logits = F.linear(x, self.tp.replicated(output_weight))
        else:
            logits = self.output(x)
        if labels is None:
            return logits
        if loss_tokens is None:
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / loss_tokens
