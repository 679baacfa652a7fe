"""config.json of a Hugging Face causal LM -> the fields of a ModelSpec.

Note [hf presets]
`model NAME { hf = "DIR" }` takes the architecture and sizes from
DIR/config.json as a `Preset`: values the converter (hetc/frontend/convert.py) puts
in every field the block does not write, located at the `hf` value. Fields
that describe the architecture are *locked*: a key written beside `hf` that
sets one to another value contradicts the weights and is a located error;
writing the same value is allowed (that is how `hetc fmt` and plan.het print
such a block, every field explicit). Training fields (TRAINING_FIELDS) take
the config's value only as a default: seq = max_position_embeddings, dtype
= the config's dtype, and for Mixtral moe.capacity_factor = experts / top_k,
the capacity at which hetc's MoE drops no assignment (Note [expert capacity]
in runtime/nn/moe.py: C = ⌈cf·T·K/E⌉ = T, and an expert serves each token at
most once) — Mixtral itself is dropless, so that is the faithful default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetc.ir.errors import Span
from hetc.ir.spec import Arch, DType, RopeScalingKind, RopeScalingSpec

__all__ = ["CONFIG_FILE", "SUPPORTED", "TRAINING_FIELDS", "HfError", "Preset", "model_preset",
           "read_config"]

CONFIG_FILE = "config.json"

# architectures (config.json "architectures"[0]) -> what differs from plain Llama
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "MixtralForCausalLM")

# fields a key beside `hf` may set (Note [hf presets]); MoE: only capacity_factor
TRAINING_FIELDS = frozenset({"name", "hf", "init", "init_std", "seq", "dtype", "grad_dtype",
                             "activation_checkpoint", "attention", "hidden_dropout", "attention_dropout",
                             "optimizer", "capacity_factor", "aux_loss_coeff", "z_loss_coeff"})

_DTYPES = {"float32": DType.FP32, "bfloat16": DType.BF16, "float16": DType.FP16}


class HfError(ValueError):
    """A Hugging Face directory hetc cannot take; the caller locates it."""


@dataclass(frozen=True)
class Preset:
    """Field values from a config (nested Presets for blocks); see Note [hf presets]."""

    values: dict[str, Any]
    locked: frozenset[str]
    span: Span
    source: str                                # "DIR/config.json", for messages
    # field -> (largest value the weights allow, what sets it: "the sliding window (32) of DIR/config.json")
    limits: dict[str, tuple[int, str]] = field(default_factory=dict)


def read_config(directory: Path) -> dict[str, Any]:
    """DIR/config.json as a dict; HfError when it is missing or not a JSON object."""
    path = Path(directory) / CONFIG_FILE
    if not Path(directory).is_dir():
        raise HfError(f"'{directory}' is not a directory (hf names a Hugging Face model directory)")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise HfError(f"'{directory}' has no {CONFIG_FILE} (hf names a Hugging Face model directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HfError(f"cannot read {path}: {err}") from None
    if not isinstance(config, dict):
        raise HfError(f"{path} is not a JSON object")
    return config


def model_preset(config: dict[str, Any], source: str, span: Span) -> Preset:
    """The ModelSpec fields `config` describes; HfError for an architecture hetc does not implement."""
    arch = _architecture(config)
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    head_dim = config.get("head_dim")
    values: dict[str, Any] = {
        "arch": Arch.LLAMA,
        "layers": _int(config, "num_hidden_layers"),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": heads if config.get("num_key_value_heads") is None else _int(config, "num_key_value_heads"),
        "ffn": _int(config, "intermediate_size"),
        "vocab": _int(config, "vocab_size"),
        "tied_embeddings": _flag(config, "tie_word_embeddings"),
        "norm_eps": _number(config, "rms_norm_eps", 1e-6),
        "rope_theta": _number(_rope(config), "rope_theta", 10000.0),
        "head_dim": None if head_dim in (None, hidden // heads) else _int(config, "head_dim"),
        "qkv_bias": arch == "Qwen2ForCausalLM" or _flag(config, "attention_bias"),
        "out_bias": arch != "Qwen2ForCausalLM" and _flag(config, "attention_bias"),
        "qk_norm": arch == "Qwen3ForCausalLM",
        "rope_scaling": _rope_scaling(config),
        "moe": _moe(config, span, source) if arch == "MixtralForCausalLM" else None,
        "seq": _int(config, "max_position_embeddings"),
        "attention_dropout": _number(config, "attention_dropout", 0.0),
        "init_std": _number(config, "initializer_range", 0.02),
    }
    dtype = config.get("dtype", config.get("torch_dtype"))
    if isinstance(dtype, str) and dtype in _DTYPES:
        values["dtype"] = _DTYPES[dtype]
    _check_unsupported(config)
    locked = frozenset(values) - TRAINING_FIELDS
    return Preset(values, locked, span, source, {"seq": _seq_limit(values, config, source)})


def _seq_limit(values: dict[str, Any], config: dict[str, Any], source: str) -> tuple[int, str]:
    """The longest sequence the weights allow, and why: the sliding window (hetc attends to the whole
    sequence), else max_position_embeddings (RoPE positions beyond it were never trained); `values["seq"]`,
    the default, becomes it."""
    longest = values["seq"]
    window = _sliding_window(config)
    if window and window < longest:
        values["seq"] = window
        return window, f"the sliding window ({window}) of {source}; hetc attends to the whole sequence"
    return longest, (f"max_position_embeddings ({longest}) of {source}, the longest sequence the model was "
                     "trained for; set seq to at most that")


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    name = names[0] if isinstance(names, list) and names else None
    if not isinstance(name, str) or name not in SUPPORTED:
        what = f"architecture '{name}'" if name else "a config without \"architectures\""
        raise HfError(f"{what} is not supported; hetc reads {', '.join(SUPPORTED)}")
    return name


def _int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HfError(f"\"{key}\" must be a positive integer, not {value!r}")
    return value


def _number(config: dict[str, Any], key: str, default: float | None = None) -> float:
    """An optional number of the config (`default` where it is absent or null; None: it must be there)."""
    value = config.get(key)
    value = default if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise HfError(f"\"{key}\" must be a number, not {value!r}")
    return float(value)


def _flag(config: dict[str, Any], key: str) -> bool:
    """An optional true/false of the config (false where it is absent or null)."""
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise HfError(f"\"{key}\" must be true or false, not {value!r}")
    return bool(value)


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings: transformers 5 nests them in rope_parameters, 4 writes rope_theta and rope_scaling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        return params
    scaling = config.get("rope_scaling")
    scaling = scaling if isinstance(scaling, dict) else {}
    return {"rope_theta": config.get("rope_theta", 10000.0), **scaling}


def _rope_scaling(config: dict[str, Any]) -> RopeScalingSpec | None:
    rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != RopeScalingKind.LLAMA3.value:
        raise HfError(f"RoPE scaling '{kind}' is not supported; hetc implements llama3 (Llama 3.1)")
    return RopeScalingSpec(kind=RopeScalingKind.LLAMA3, factor=_number(rope, "factor"),
                           low_freq_factor=_number(rope, "low_freq_factor"),
                           high_freq_factor=_number(rope, "high_freq_factor"),
                           original_seq=_int(rope, "original_max_position_embeddings"))


def _moe(config: dict[str, Any], span: Span, source: str) -> Preset:
    experts, top_k = _int(config, "num_local_experts"), _int(config, "num_experts_per_tok")
    if _number(config, "router_jitter_noise", 0.0):
        raise HfError("router_jitter_noise is not supported (hetc's router is deterministic)")
    values = {"experts": experts, "top_k": top_k, "capacity_factor": experts / top_k}
    return Preset(values, frozenset({"experts", "top_k"}), span, source)


def _check_unsupported(config: dict[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise HfError(f"hidden_act '{config['hidden_act']}' is not supported; these architectures use silu")
    if config.get("mlp_bias", False):
        raise HfError("mlp_bias = true is not supported (hetc's SwiGLU has no biases)")


def _sliding_window(config: dict[str, Any]) -> int | None:
    """The attention window, when the config limits attention to one (hetc attends to the whole sequence)."""
    window = config.get("sliding_window")
    uses = config.get("use_sliding_window", True)
    return window if isinstance(window, int) and not isinstance(window, bool) and uses else None
