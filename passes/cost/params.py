"""Parameter counts per layer, the Φ of every memory and traffic formula.

The runtime's modules must have exactly these counts (tests/test_model.py
checks it), so memory predictions and ZeRO shard sizes agree with what runs.
"""

from __future__ import annotations

from hetc.ir.spec import Arch, ModelSpec

__all__ = ["block_params", "expert_params", "layer_params", "model_params", "stage_params", "tied_copy_params"]


def _mlp_params(m: ModelSpec) -> int:
    """One dense feed-forward network (one expert of an MoE)."""
    h, f = m.hidden, m.ffn
    return 3 * h * f if m.arch is Arch.LLAMA else 2 * h * f + f + h


def expert_params(m: ModelSpec) -> int:
    """The experts of one block (all of them; 0 without MoE): what expert parallelism splits."""
    return 0 if m.moe is None else _mlp_params(m) * m.moe.experts


def block_params(m: ModelSpec) -> int:
    """One transformer block."""
    h, d = m.hidden, m.head_size
    q = h * m.heads * d
    kv = 2 * h * m.num_kv_heads * d
    out = m.heads * d * h
    gpt = m.arch is Arch.GPT
    qkv_bias = (m.heads + 2 * m.num_kv_heads) * d if gpt or m.qkv_bias else 0
    out_bias = h if gpt or m.out_bias else 0
    qk_norms = 2 * d if m.qk_norm else 0
    norms = 2 * h if m.arch is Arch.LLAMA else 4 * h    # GPT: LayerNorm with bias
    attn = q + kv + out + qkv_bias + out_bias + qk_norms
    mlp = _mlp_params(m) if m.moe is None else expert_params(m) + h * m.moe.experts  # experts + router
    return attn + mlp + norms


def layer_params(m: ModelSpec, idx: int) -> int:
    """Layer `idx` of [embed, block0, ..., head]."""
    if idx == 0:
        pos = m.seq * m.hidden if m.arch is Arch.GPT else 0
        return m.vocab * m.hidden + pos
    if idx == m.layers + 1:
        norm = m.hidden if m.arch is Arch.LLAMA else 2 * m.hidden
        return norm + (0 if m.tied_embeddings else m.vocab * m.hidden)
    return block_params(m)


def tied_copy_params(m: ModelSpec, layers: range) -> int:
    """The head's copy of a tied embedding, held by a module of `layers` apart from the embedding (Note [tied
    copies] in runtime/nn/model.py): the embedding's V×H matrix again; else 0."""
    return m.vocab * m.hidden if m.holds_tied_copy(layers) else 0


def stage_params(m: ModelSpec, layers: range) -> int:
    """A contiguous run of layers (a module the runtime builds, with a tied copy where it holds one), in O(1):
    blocks all have the same size."""
    blocks = len(range(max(layers.start, 1), min(layers.stop, m.layers + 1)))
    ends = sum(layer_params(m, i) for i in (0, m.layers + 1) if i in layers)
    return blocks * block_params(m) + ends + tied_copy_params(m, layers)


def model_params(m: ModelSpec) -> int:
    return stage_params(m, range(m.num_model_layers))
