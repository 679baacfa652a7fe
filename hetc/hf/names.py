"""hetc parameter names -> Hugging Face tensor names (Llama, Mistral, Qwen2, Qwen3, Mixtral).

hetc names a parameter by its layer (runtime/nn/layers.py: `block3.attention.wq.weight`);
every supported architecture saves the same layout under Llama's names
(`model.layers.3.self_attn.q_proj.weight`), Mixtral's experts under
`block_sparse_moe` with the experts' own w1/w2/w3. The shapes agree
(nn.Linear's [out, in] on both sides, the same rotate-half RoPE convention),
so weights move without a transpose or a permutation.
"""

from __future__ import annotations

import re

__all__ = ["hf_name"]

_ENDS = {
    "embed.tok_embeddings.weight": "model.embed_tokens.weight",
    "head.norm.weight": "model.norm.weight",
    "head.output.weight": "lm_head.weight",
}

# inside block i: hetc suffix -> suffix under model.layers.{i}.
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attention.w{p}.{t}": f"self_attn.{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias")},
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
}
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w[123])\.weight")
_BLOCK_NAME = re.compile(r"block(\d+)\.(.+)")


def hf_name(name: str) -> str:
    """The Hugging Face name of hetc parameter `name`; ValueError for one no supported architecture has."""
    if name in _ENDS:
        return _ENDS[name]
    block = _BLOCK_NAME.fullmatch(name)
    if block is not None:
        i, rest = block.groups()
        if rest in _BLOCK:
            return f"model.layers.{i}.{_BLOCK[rest]}"
        expert = _EXPERT.fullmatch(rest)
        if expert is not None:
            return f"model.layers.{i}.block_sparse_moe.experts.{expert[1]}.{expert[2]}.weight"
    raise ValueError(f"no Hugging Face name for hetc parameter '{name}' (a gpt-arch model has none)")
