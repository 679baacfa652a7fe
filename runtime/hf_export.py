"""A hetc checkpoint as a Hugging Face directory: config.json and sharded safetensors with an index.

The checkpoint (a `step-N` folder of `hetc run --checkpoint DIR`) is
plan-free (Note [Checkpoint layout]): full fp32 parameters by hetc name,
and model.het, the model they belong to. Export reads the parameters in
one process, gives each its full shape and Hugging Face name (names.py),
and writes shards of at most `max_shard_bytes` with
model.safetensors.index.json, the layout `save_pretrained` writes. The
config is the one the model came from (hf_config.json) when there is one,
with every architecture key rewritten from the model, so a model trained
from a Hugging Face directory goes back with its tokenizer ids and the rest.

Note [A complete export]
A Hugging Face model directory is more than weights and config.json:
`AutoTokenizer.from_pretrained` and `generate` read the tokenizer files and
generation_config.json beside them. A save copies those of the model's hf
directory into the checkpoint (`copy_hf_files`: the checkpoint stays whole
when the directory moves or is deleted, and its checksums cover them), and
export copies them out. generation_config.json comes from the source when it
had one, else it is made from config.json as transformers' `save_pretrained`
does (`GenerationConfig.from_model_config`: the token ids, and
`_from_model_config`). A model with no hf directory has no tokenizer to
copy, and export says so in one line.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetc.ir.errors import SpecError
from hetc.hf.config import CONFIG_FILE, HfError
from hetc.hf.files import GENERATION_CONFIG_FILE, TOKENIZER_FILES
from hetc.hf.names import hf_name
from hetc.hf.weights import INDEX_FILE
from hetc.ir.outdir import OutputKind, Protected, check_output_dir, write_output_dir
from hetc.ir.spec import Arch, DType, ModelSpec

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHARD_BYTES", "GENERATION_CONFIG_FILE", "TOKENIZER_FILES", "Exported", "copy_hf_files",
           "export_hf", "generation_config", "hf_config", "read_checkpoint_model"]

DEFAULT_SHARD_BYTES = 2 << 30
_TORCH_NAMES = {DType.FP32: "float32", DType.BF16: "bfloat16", DType.FP16: "float16"}

# config.json keys that GenerationConfig.from_model_config carries over (the rest are generation defaults)
_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@dataclass(frozen=True, slots=True)
class Exported:
    """What `export_hf` wrote: the shards, and the tokenizer files it copied (none: the model had no hf
    directory)."""

    shards: list[Path]
    tokenizer_files: list[str]


def hf_config(model: ModelSpec, dtype: DType = DType.FP32, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for `model` (`base`: the config it came from, whose other keys are kept)."""
    arch, model_type = _architecture(model)
    if arch == "LlamaForCausalLM" and (base or {}).get("architectures") == ["MistralForCausalLM"]:
        arch, model_type = "MistralForCausalLM", "mistral"    # the same tensors: keep what it was
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        s = model.rope_scaling
        rope = {"rope_type": s.kind.value, "rope_theta": model.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_seq}
    config = dict(base or {})
    for legacy in ("rope_scaling", "torch_dtype"):
        config.pop(legacy, None)
    config.update({
        "architectures": [arch], "model_type": model_type, "vocab_size": model.vocab,
        "hidden_size": model.hidden, "intermediate_size": model.ffn, "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads, "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_size, "hidden_act": "silu", "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tied_embeddings, "rope_parameters": rope, "rope_theta": model.rope_theta,
        "max_position_embeddings": max(int(config.get("max_position_embeddings", 0)), model.seq),
        "dtype": _TORCH_NAMES[dtype], "attention_dropout": model.attention_dropout,
        "initializer_range": model.init_std,
    })
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = model.qkv_bias
        config["mlp_bias"] = False
    if model.moe is not None:
        config.update({"num_local_experts": model.moe.experts, "num_experts_per_tok": model.moe.top_k,
                       "router_jitter_noise": 0.0})
    return config


def _architecture(model: ModelSpec) -> tuple[str, str]:
    """The Hugging Face class that holds exactly `model`'s parameters."""
    if model.arch is not Arch.LLAMA:
        raise HfError(f"a {model.arch.value}-arch model has no Hugging Face counterpart here; "
                      "hetc exports llama-arch models")
    if model.moe is not None:
        if model.qkv_bias or model.out_bias or model.qk_norm:
            raise HfError("Mixtral has no attention biases or q/k norms: this MoE model cannot be exported")
        return "MixtralForCausalLM", "mixtral"
    if model.qk_norm:
        if model.qkv_bias != model.out_bias:
            raise HfError("Qwen3 biases all four attention projections or none: cannot export this model")
        return "Qwen3ForCausalLM", "qwen3"
    if model.qkv_bias and not model.out_bias:
        return "Qwen2ForCausalLM", "qwen2"
    if model.qkv_bias != model.out_bias:
        raise HfError("out_bias without qkv_bias has no Hugging Face counterpart")
    return "LlamaForCausalLM", "llama"


def export_hf(checkpoint: Path, out: Path, *, dtype: DType = DType.FP32,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Exported:
    """Write `out`/config.json, the shards, the index, generation_config.json and the tokenizer files (a new
    directory, or one hetc exported to before)."""
    from safetensors.torch import save_file

    from hetc.runtime.checkpoint import read_params
    from hetc.runtime.nn.model import compute_dtype, full_shapes

    guards = [Protected(Path(checkpoint), "the checkpoint")]
    check_output_dir(Path(out), OutputKind.HF_EXPORT, guards)    # before the work: the write checks again
    params = read_params(Path(checkpoint))     # first: it checks every file's checksum (model.het's too)
    model, base = read_checkpoint_model(Path(checkpoint))
    config = hf_config(model, dtype, base)
    shapes = full_shapes(model)
    if set(params) != set(shapes):
        raise HfError(f"{checkpoint} does not hold the parameters of its {Path(checkpoint) / 'model.het'}: "
                      f"{sorted(set(params) ^ set(shapes))[:3]}")
    torch_dtype = compute_dtype(dtype)
    tensors = {hf_name(n): params[n].view(shapes[n]).to(torch_dtype).contiguous() for n in shapes}
    shards = _shards(tensors, max_shard_bytes)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]

    def fill(tmp: Path) -> None:   # a whole directory at once, replacing only an export (hetc/ir/outdir.py)
        weight_map: dict[str, str] = {}
        for name, shard in zip(names, shards):
            save_file({n: tensors[n] for n in shard}, str(tmp / name), metadata={"format": "pt"})
            weight_map.update((n, name) for n in shard)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        copy_hf_files(Path(checkpoint), tmp)       # Note [A complete export]
        if not (tmp / GENERATION_CONFIG_FILE).is_file():
            (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config(config), indent=2) + "\n")

    write_output_dir(Path(out), OutputKind.HF_EXPORT, fill, guards)
    tokenizer = [name for name in TOKENIZER_FILES if (Path(out) / name).is_file()]
    return Exported([Path(out) / name for name in names], tokenizer)


def copy_hf_files(source: Path, destination: Path) -> list[str]:
    """Copy the tokenizer files and generation_config.json that `source` holds into `destination`; return
    their names (Note [A complete export])."""
    copied = [name for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE) if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, destination / name)
    return copied


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json as transformers makes it from `config` (GenerationConfig.from_model_config)."""
    ids = {key: config[key] for key in _GENERATION_KEYS if config.get(key) is not None}
    return {"_from_model_config": True, **ids}


def read_checkpoint_model(checkpoint: Path) -> tuple[ModelSpec, dict[str, Any] | None]:
    """The model a checkpoint holds (its model.het) and the config it came from (hf_config.json), if any."""
    from hetc.frontend.load import load_spec
    from hetc.runtime.checkpoint import HF_CONFIG_FILE, MODEL_FILE

    if not (checkpoint / ".metadata").is_file():
        raise HfError(f"'{checkpoint}' is not a complete checkpoint (a step-N folder of `hetc run --checkpoint`)")
    card = checkpoint / MODEL_FILE
    if not card.is_file():
        raise HfError(f"'{checkpoint}' has no {MODEL_FILE} (it was saved by an older hetc)")
    try:
        model = load_spec(card).spec.model
    except SpecError as err:
        raise HfError(f"cannot read {card}: {err}") from None
    if model is None:
        raise HfError(f"{card} holds no model block")
    base_file = checkpoint / HF_CONFIG_FILE
    return model, (json.loads(base_file.read_text()) if base_file.is_file() else None)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in model order, cut into runs of at most `max_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
