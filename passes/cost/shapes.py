"""The model's arithmetic per layer: parameters per rank, FLOPs and stashed activations.

Layers are indexed over [embed, block0, ..., block{L-1}, head] (see
hetc.ir.pipeline). Tensor parallelism follows Megatron: a block's projections
are sharded (column-parallel q/k/v and FFN-in, row-parallel out and FFN-out)
while its norms and row-parallel biases are replicated; the word embedding
and the output matrix are vocabulary-parallel (sharded by tp, with a
vocab-parallel cross-entropy), position embeddings and the final norm
replicated. Context parallelism (cp) splits the sequence, replicates weights.

FLOPs are of the full layer for one microbatch of `b` sequences (divide by
tp × cp for one rank). Activations use the Korthikanti et al. accounting
("Reducing Activation Recomputation in Large Transformer Models", 2022)
for the tensors hetc's runtime keeps: flash attention stores no S×S scores
(its dropout regenerates the mask in backward), the unfused core its softmax
output, the probabilities its AV multiply reads and, with attention dropout,
their mask; hidden dropout keeps a bool mask of the embedding's output and of
each block's attention and MLP outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from hetc.passes.cost.params import block_params, expert_params, layer_params
from hetc.ir.spec import DTYPE_BYTES, Arch, AttentionKind, Checkpointing, ModelSpec

__all__ = [
    "LayerFlops",
    "LayerKind",
    "activation_elements",
    "layer_flops",
    "layer_kind",
    "model_flops_per_token",
    "params_per_rank",
]

# Bytes of the logits kept for the loss: cross-entropy runs in fp32.
LOGIT_BYTES = 4
# Bytes per value of what runs in fp32 inside the attention core: flash attention's log-sum-exp, the unfused
# core's softmax (runtime/nn/attention.py `unfused_causal_attention`).
SOFTMAX_BYTES = 4
# Bytes per element of a dropout's mask: torch's native_dropout keeps a bool per element for its backward.
MASK_BYTES = 1


class LayerKind(StrEnum):
    """The kinds of layer a model is made of (the profiles' slots)."""

    EMBED = "embed"
    BLOCK = "block"
    HEAD = "head"


def layer_kind(m: ModelSpec, idx: int) -> LayerKind:
    if idx == 0:
        return LayerKind.EMBED
    if idx == m.layers + 1:
        return LayerKind.HEAD
    return LayerKind.BLOCK


def _block_replicated(m: ModelSpec) -> int:
    """Block parameters every TP rank holds whole: norms and row-parallel biases."""
    if m.arch is Arch.LLAMA:
        return 2 * m.hidden
    return 4 * m.hidden + 2 * m.hidden  # two LayerNorms (weight + bias), out-proj and FFN-out biases


def params_per_rank(m: ModelSpec, idx: int, tp: int = 1, ep: int = 1) -> float:
    """Parameters of layer `idx` held by one rank of a TP group of `tp` (and an EP group of `ep`,
    which holds 1/ep of every MoE block's experts)."""
    if ep > 1 and layer_kind(m, idx) == LayerKind.BLOCK:
        experts = expert_params(m)
        return params_per_rank(m, idx, tp) - experts + experts / ep
    if tp == 1:
        return float(layer_params(m, idx))
    kind = layer_kind(m, idx)
    vocab = m.vocab * m.hidden
    if kind == LayerKind.EMBED:
        return vocab / tp + (layer_params(m, idx) - vocab)
    if kind == LayerKind.HEAD:
        matrix = 0 if m.tied_embeddings else vocab
        return matrix / tp + (layer_params(m, idx) - matrix)
    replicated = _block_replicated(m)
    return (block_params(m) - replicated) / tp + replicated


@dataclass(frozen=True, slots=True)
class LayerFlops:
    """Forward FLOPs of one layer for one microbatch, split by how backward treats them."""

    linear: float      # matmuls with weights: backward = input-grad (×1) + weight-grad (×1)
    attention: float   # attention core (QKᵀ, AV): backward = input-grad only (×2)

    @property
    def forward(self) -> float:
        return self.linear + self.attention

    @property
    def input_grad(self) -> float:
        return self.linear + 2 * self.attention

    @property
    def weight_grad(self) -> float:
        return self.linear

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


def _matmul_params(m: ModelSpec) -> float:
    """Weights a token multiplies through in one block (MoE: the top-k experts it visits)."""
    h, f = m.hidden, m.ffn
    head_dim = m.head_size
    attn = 2 * h * m.heads * head_dim + 2 * h * m.num_kv_heads * head_dim
    mlp = (3 if m.arch is Arch.LLAMA else 2) * h * f
    if m.moe is not None:
        mlp = mlp * m.moe.top_k + h * m.moe.experts  # visited experts + router
    return attn + mlp


def layer_flops(m: ModelSpec, idx: int, micro_batch: int, seq: int | None = None) -> LayerFlops:
    """Forward FLOPs of layer `idx` (full layer, not per rank) for `micro_batch` sequences."""
    s = m.seq if seq is None else seq
    tokens = micro_batch * s
    kind = layer_kind(m, idx)
    if kind == LayerKind.EMBED:
        return LayerFlops(0.0, 0.0)  # a lookup: memory-bound, no matmul
    if kind == LayerKind.HEAD:
        return LayerFlops(2.0 * tokens * m.hidden * m.vocab, 0.0)
    # QKᵀ and AV: 2 × 2·S·(heads·head_dim) FLOPs per token; counted unmasked (PaLM's convention).
    attention = 4.0 * tokens * s * m.hidden
    return LayerFlops(2.0 * tokens * _matmul_params(m), attention)


def model_flops_per_token(m: ModelSpec) -> float:
    """Training FLOPs per token without recomputation (forward + backward = 3 × forward)."""
    total = sum(layer_flops(m, i, 1).forward for i in range(m.num_model_layers))
    return 3.0 * total / m.seq


def activation_elements(m: ModelSpec, idx: int, micro_batch: int, *, checkpoint: Checkpointing, tp: int = 1,
                        cp: int = 1, sequence_parallel: bool = False) -> tuple[float, float]:
    """(elements kept in the training dtype, extra bytes) stashed by layer `idx` for one microbatch.

    Per rank of a lane with `tp` × `cp` ranks, under its stage's activation
    checkpointing `checkpoint`. A block under `full` checkpointing keeps only its
    input; `selective` keeps the inputs of its matmuls and its hidden dropout's
    masks, and recomputes norms, activations and the attention core. The embed
    layer is never checkpointed: it keeps its dropout's mask under every level.
    """
    tokens = micro_batch * m.seq / cp
    h, f = m.hidden, m.ffn
    kind = layer_kind(m, idx)
    replicated_div = tp if sequence_parallel else 1
    # one hidden dropout's mask over the hidden state as this rank holds it (a 1/tp part under SP)
    mask = tokens * h / replicated_div * MASK_BYTES if m.hidden_dropout > 0 else 0.0
    if kind == LayerKind.EMBED:
        return 0.0, mask  # token ids, and the mask of the output's dropout
    if kind == LayerKind.HEAD:
        # norm input, this rank's vocabulary slice of the logits for the loss
        return tokens * h / replicated_div, tokens * m.vocab / tp * LOGIT_BYTES
    if checkpoint is Checkpointing.FULL:
        return tokens * h / replicated_div, 0.0
    kv = 2 * h * m.num_kv_heads // m.heads
    ffn_inner = 3 * f if m.arch is Arch.LLAMA else 2 * f  # (gate, up, product) or (fc1 out, act out)
    if checkpoint is Checkpointing.SELECTIVE:
        # block input, q/k/v input, out-proj input, FFN input, FFN-out input
        replicated = 3 * h
        sharded = h + f
    else:
        # norm inputs, normed q/k/v and FFN inputs (replicated); q, k, v, attention output, FFN inner
        replicated = 4 * h
        sharded = h + kv + h + ffn_inner
    if m.moe is not None and checkpoint is not Checkpointing.SELECTIVE:
        sharded += (m.moe.top_k - 1) * ffn_inner  # each token's inner activations in every visited expert
    core, core_bytes = _attention_core_kept(m, tokens, tp, checkpoint)
    # the masks of the dropouts on the attention and MLP outputs, before their residual adds
    return tokens * (replicated / replicated_div + sharded / tp) + core, core_bytes + 2 * mask


def _attention_core_kept(m: ModelSpec, tokens: float, tp: int, checkpoint: Checkpointing) -> tuple[float, float]:
    """(elements, extra bytes) the attention core keeps for its backward on one rank beyond its q, k, v and
    output, for `tokens` of this rank (those of its cp part) under `checkpoint` (`none` or `selective`)."""
    if m.attention is AttentionKind.FLASH:
        # its log-sum-exp per head; SDPA's dropout keeps no mask (the kernel redraws it from the RNG seed)
        return 0.0, tokens * (m.heads / tp) * SOFTMAX_BYTES
    if checkpoint is Checkpointing.SELECTIVE:
        return 0.0, 0.0   # the core is recomputed
    # heads/tp of s×s scores per sequence; under Ulysses (cp) heads/(tp·cp) of the whole sequence: the same count
    # (ring attention, whose rank sees 1/cp of the keys, runs neither unfused nor with dropout: validation)
    scores = tokens * m.seq * m.heads / tp
    dropped = m.attention_dropout > 0
    # the softmax keeps its fp32 output; AV keeps its input, the probabilities cast to the training dtype (the
    # softmax's output itself where that is fp32) or, with dropout, their dropped copy and the mask (dropout
    # keeps no input)
    shared = DTYPE_BYTES[m.dtype] == SOFTMAX_BYTES and not dropped
    return (0.0 if shared else scores), scores * (SOFTMAX_BYTES + (MASK_BYTES if dropped else 0))
