"""The Spec: what the user means, as frozen dataclasses.

Every node carries the `span` of the block it came from and `spans`, the
span of each attribute's value, so that a later pass can point at the exact
text it objects to. Spans never take part in equality: a Spec printed by
`hetc fmt` and parsed back compares equal to the original.

Each field's metadata (see `param`) is the language's schema: the key and
its aliases, its unit, its bounds and a one-line doc. `hetc.frontend.convert` reads
it to build Specs from syntax trees, `hetc.frontend.printer` to print them back, and
docs/language.md lists it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Final

from hetc.ir.errors import NO_SPAN, InternalError, Span
from hetc.ir.units import Dim

__all__ = [
    "AUTO",
    "DTYPE_BYTES",
    "SCHEMA_KEY",
    "Arch",
    "AttentionKind",
    "Auto",
    "BlendSourceSpec",
    "CPKind",
    "Checkpointing",
    "ClusterSpec",
    "DType",
    "DataFileSpec",
    "DataKind",
    "DataSpec",
    "DeviceSpec",
    "FieldMeta",
    "InitKind",
    "IntraLinkSpec",
    "LayerRange",
    "LinkSpec",
    "LossScaleSpec",
    "LrDecay",
    "LrScheduleKind",
    "LrScheduleSpec",
    "MoESpec",
    "ModelSpec",
    "Node",
    "NodeSpec",
    "Objective",
    "ObjectiveSpec",
    "OffloadSpec",
    "OffloadTarget",
    "OptimizerKind",
    "OptimizerSpec",
    "ParallelSpec",
    "PeakSpec",
    "RankSlice",
    "RopeScalingKind",
    "RopeScalingSpec",
    "Routing",
    "RoutingKind",
    "ScheduleKind",
    "Spec",
    "StageSpec",
    "TokenDType",
    "TrainSpec",
    "ZeroShard",
    "ZeroSpec",
    "declared_path",
    "executed_dtype",
    "param",
]


class Auto(Enum):
    """The value `auto`: the planner chooses.

    A one-member enum, so that `x is AUTO` / `x is not AUTO` narrows `int | Auto`
    to `int` for the type checker; a singleton that pickles and copies as itself.
    """

    AUTO = "auto"

    def __repr__(self) -> str:
        return "AUTO"

    __str__ = __repr__


AUTO: Final = Auto.AUTO


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """Base of every Spec node: where it was written."""

    span: Span = field(default=NO_SPAN, compare=False, repr=False)
    spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def span_of(self, name: str) -> Span:
        """The span of attribute `name`'s value, or of the whole block."""
        return next((span for key, span in self.spans if key == name), self.span)

    def written(self, name: str) -> bool:
        """Whether the spec wrote attribute `name` (else it holds its default)."""
        return any(key == name for key, _ in self.spans)


@dataclass(frozen=True, slots=True)
class FieldMeta:
    """A Spec field's schema, as `param` records it (the key under SCHEMA_KEY of the field's metadata)."""

    doc: str = ""
    aliases: tuple[str, ...] = ()     # other keys that set the field
    unit: Dim | None = None           # the dimension of a quantity (values take units)
    lo: float | None = None           # inclusive bounds of a number
    hi: float | None = None
    block: str | None = None          # written as nested block(s) of this kind
    label: bool = False               # takes the block's label (`model NAME { }`)
    shorthand: bool = False           # `key = value` on the parent sets it (`zero = 2`)


SCHEMA_KEY: Final = "hetc"   # dataclasses' field metadata is a mapping shared with other libraries


def param(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    aliases: tuple[str, ...] = (),
    unit: Dim | None = None,
    lo: float | None = None,
    hi: float | None = None,
    block: str | None = None,
    label: bool = False,
    shorthand: bool = False,
    factory: Any = dataclasses.MISSING,
) -> Any:
    """A Spec field with its schema.

    `block`: the field is written as nested block(s) of this kind;
    `label`: the field takes the block's label (`model NAME { }`);
    `shorthand`: `key = value` on the parent sets this field of the nested
    block (`zero = 2` for `zero { level = 2 }`).
    """
    meta = {SCHEMA_KEY: FieldMeta(doc, aliases, unit, lo, hi, block, label, shorthand)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------- enums


class Arch(StrEnum):
    LLAMA = "llama"
    GPT = "gpt"


class InitKind(StrEnum):
    """Where a model's initial weights come from."""

    RANDOM = "random"           # hetc's seeded initialisation (Note [Deterministic initialisation])
    PRETRAINED = "pretrained"   # the safetensors of the model's `hf` directory


class RopeScalingKind(StrEnum):
    LLAMA3 = "llama3"


class DType(StrEnum):
    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


def executed_dtype(dtype: DType) -> DType:
    """The dtype hetc's runtime computes and stores a model of `dtype` in: Note [Precision that runs].

    fp8 computes in bf16 (runtime/nn/model.py `compute_dtype`) until fp8
    execution exists, so it is costed as bf16: the bf16 peak and bf16's bytes.
    """
    return DType.BF16 if dtype is DType.FP8 else dtype


def storage_dtype(dtype: DType) -> DType:
    """The format a model of `dtype` keeps its tensors in: fp32 for tf32 (a matmul mode), else its executed dtype."""
    executed = executed_dtype(dtype)
    return DType.FP32 if executed is DType.TF32 else executed


# Note [gradient dtype]
# Gradients are accumulated over a step's microbatches and reduced across replicas in `gradient_dtype`:
# fp32 for a bf16 model, as Megatron-LM does (its --bf16 forces --accumulate-allreduce-grads-in-fp32: each
# parameter's `main_grad` is an fp32 buffer that backward's bf16 gradient is added to) and torchtitan's FSDP2
# (MixedPrecisionPolicy reduce_dtype=float32): bf16's 8-bit mantissa would round away a microbatch's
# contribution to a large sum. fp16 keeps fp16 gradients under its loss scale (Megatron-LM's default).
# The cost model counts the gradient buffers, reduced shards and ZeRO reductions in this dtype
# (`StateBytes.grads`); the runtime binds fp32 gradient buffers behind the parameters
# (runtime/flat.py `bind_grads`, Note [main gradients]).

_STORAGE_BYTES = {DType.FP32: 4, DType.TF32: 4, DType.BF16: 2, DType.FP16: 2, DType.FP8: 1}

# Bytes per value of each model dtype in hetc's buffers (δ): those of the dtype it executes as.
DTYPE_BYTES = {dtype: _STORAGE_BYTES[executed_dtype(dtype)] for dtype in DType}


class Checkpointing(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class AttentionKind(StrEnum):
    """How the attention core runs (Note [GEMM curve] in passes/cost/gemm.py times each)."""

    FLASH = "flash"        # fused and tiled: the S×S scores never reach memory (SDPA's flash kernel)
    UNFUSED = "unfused"    # scores and probabilities materialised: QKᵀ, softmax, AV as separate kernels


class OptimizerKind(StrEnum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


class ScheduleKind(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB = "zb"
    ZORSE = "zorse"


class CPKind(StrEnum):
    ULYSSES = "ulysses"
    RING = "ring"


class RoutingKind(StrEnum):
    EVEN = "even"
    PROPORTIONAL = "proportional"
    COUNTS = "counts"


class DataKind(StrEnum):
    SYNTHETIC = "synthetic"
    TEXT = "text"
    TOKENS = "tokens"
    BLEND = "blend"      # sources mixed by weight (Megatron-LM's --data-path W1 P1 W2 P2)


class TokenDType(StrEnum):
    """How wide a token id is in a token file (`data tokens`)."""

    UINT16 = "uint16"
    UINT32 = "uint32"


class LrScheduleKind(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"
    WSD = "wsd"          # warm-up, stable, decay (Megatron-LM's WSD, torchtitan's warmup_stable_decay)
    INVERSE_SQRT = "inverse_sqrt"   # lr sqrt(warmup / n) after warm-up (Megatron-LM's inverse-square-root)


class LrDecay(StrEnum):
    """The shape of a WSD schedule's decay from `lr` to `min_lr` over progress p in [0, 1]."""
    LINEAR = "linear"    # 1 - p
    COSINE = "cosine"    # (1 + cos(pi p)) / 2
    SQRT = "sqrt"        # 1 - sqrt(p): Megatron-LM's minus_sqrt


class Objective(StrEnum):
    THROUGHPUT = "throughput"
    COST = "cost"


class OffloadTarget(StrEnum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class ZeroShard(StrEnum):
    """Which lanes shard a stage's state together (hierarchical ZeRO)."""

    ALL = "all"    # every lane of the stage: plain ZeRO
    NODE = "node"  # lanes on the same node shard; nodes replicate (HSDP)


# Aliases users bring from DeepSpeed, Megatron and torchtitan, per enum.
ENUM_ALIASES: dict[type, dict[str, str]] = {
    ScheduleKind: {
        "gpipe": "gpipe", "schedulegpipe": "gpipe", "1f1b": "1f1b", "schedule1f1b": "1f1b",
        "interleaved1f1b": "interleaved", "interleaved_1f1b": "interleaved", "scheduleinterleaved1f1b":
        "interleaved", "zb": "zb", "zbh1": "zb", "zero_bubble": "zb", "interleavedzerobubble": "zb",
        "zorse": "zorse",
    },
    DType: {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"},
    Checkpointing: {"off": "none", "false": "none", "true": "full", "on": "full"},
    CPKind: {"a2a": "ulysses", "alltoall": "ulysses", "ring_attention": "ring", "p2p": "ring"},
    OffloadTarget: {"false": "none", "off": "none", "true": "cpu", "host": "cpu"},
    ZeroShard: {"global": "all", "world": "all", "hsdp": "node"},
}


# ---------------------------------------------------------------- model


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec(Node):
    kind: OptimizerKind = param(OptimizerKind.ADAMW, label=True, doc="optimizer: adamw, adam or sgd")
    beta1: float = param(0.9, lo=0, hi=1, doc="first-moment decay (Adam family)")
    beta2: float = param(0.95, lo=0, hi=1, doc="second-moment decay (Adam family)")
    eps: float = param(1e-8, lo=0, hi=1, doc="denominator epsilon")
    weight_decay: float = param(0.0, lo=0, hi=1e3, doc="decoupled weight decay")
    decay_norms_and_biases: bool = param(True, doc="weight decay on parameters of one dimension too (norms' "
                                                   "weights, biases), as torchtitan; false: on matrices only, "
                                                   "as Megatron-LM and Hugging Face's Trainer")
    momentum: float = param(0.0, lo=0, hi=1, doc="SGD momentum")
    master_dtype: DType = param(DType.FP32, aliases=("master_weights_dtype",),
                                doc="dtype of master weights and optimizer state (δ_opt)")

    @property
    def num_states(self) -> int:
        """n_opt: optimizer tensors per parameter."""
        if self.kind is OptimizerKind.SGD:
            return 1 if self.momentum else 0
        return 2


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec(Node):
    experts: int = param(doc="number of experts E", lo=1, hi=4096, aliases=("num_experts",))
    top_k: int = param(2, doc="experts per token K", lo=1, hi=64, aliases=("moe_router_topk", "topk"))
    capacity_factor: float = param(1.25, lo=0.01, hi=1e3, doc="expert capacity over the mean load")
    aux_loss_coeff: float = param(0.0, lo=0, hi=1e3, aliases=("moe_aux_loss_coeff",),
                                  doc="weight of each MoE layer's load-balancing loss (Switch's, as Megatron-LM "
                                      "computes it; 0: none); each step reports it as load_balancing_loss")
    z_loss_coeff: float = param(0.0, lo=0, hi=1e3, aliases=("moe_z_loss_coeff", "router_z_loss_coef"),
                                doc="weight of each MoE layer's router z-loss, the mean over tokens of the "
                                    "squared log-sum-exp of the router's logits (ST-MoE's, as Megatron-LM's "
                                    "--moe-z-loss-coeff; 0: none): it keeps the logits small; each step "
                                    "reports it as z_loss")


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScalingSpec(Node):
    """RoPE frequency scaling for contexts beyond the pretraining length (Llama 3.1's `llama3` rule)."""

    kind: RopeScalingKind = param(RopeScalingKind.LLAMA3, label=True, aliases=("rope_type",),
                                  doc="the scaling rule: llama3")
    factor: float = param(8.0, lo=1, hi=1e6, doc="how much longer the context is than original_seq")
    low_freq_factor: float = param(1.0, lo=0, hi=1e6, doc="wavelengths above original_seq / this are scaled")
    high_freq_factor: float = param(4.0, lo=0, hi=1e6,
                                    doc="wavelengths below original_seq / this are kept; between: smoothed")
    original_seq: int = param(8192, lo=1, hi=1 << 24, aliases=("original_max_position_embeddings",),
                              doc="the context length the model was pretrained at")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec(Node):
    name: str = param("model", label=True, doc="the model's name")
    hf: str = param("", aliases=("hf_dir", "pretrained"),
                    doc="a Hugging Face model directory, relative to the file that declares it: its "
                        "config.json sets the architecture and sizes (keys written beside it may only "
                        "set training fields: name, seq, dtype, activation_checkpoint, optimizer, init, "
                        "moe.capacity_factor), its safetensors the initial weights")
    init: InitKind | None = param(None, aliases=("init_weights",),
                                  doc="random (seeded) or pretrained (the hf directory's safetensors); "
                                      "default: pretrained when the hf directory holds safetensors")
    init_std: float = param(0.02, lo=1e-6, hi=10, aliases=("init_method_std", "initializer_range"),
                            doc="standard deviation of a random start's matrices (Megatron-LM's "
                                "--init-method-std, Hugging Face's initializer_range); residual output "
                                "projections get init_std / sqrt(2L), as GPT-2 and Megatron-LM")
    arch: Arch = param(Arch.LLAMA, doc="llama (RMSNorm, RoPE, GQA, SwiGLU) or gpt (LayerNorm, GELU)")
    layers: int = param(doc="transformer blocks L", lo=1, hi=100_000,
                        aliases=("num_layers", "n_layers", "num_hidden_layers"))
    hidden: int = param(doc="hidden size H", lo=1, hi=1 << 20, aliases=("hidden_size", "d_model", "dim"))
    heads: int = param(doc="query heads N_q", lo=1, hi=1 << 14,
                       aliases=("num_attention_heads", "n_heads", "num_heads"))
    kv_heads: int | None = param(None, lo=1, hi=1 << 14,
                                 aliases=("num_query_groups", "num_key_value_heads", "n_kv_heads"),
                                 doc="key/value heads N_kv (GQA); defaults to heads")
    ffn: int = param(doc="feed-forward size H_FFN", lo=1, hi=1 << 22,
                     aliases=("ffn_hidden_size", "intermediate_size"))
    vocab: int = param(doc="vocabulary size V", lo=1, hi=1 << 24, aliases=("vocab_size", "padded_vocab_size"))
    seq: int = param(doc="sequence length S", lo=1, hi=1 << 24,
                     aliases=("seq_length", "seq_len", "max_seq_len", "sequence_length"))
    dtype: DType = param(DType.BF16, aliases=("params_dtype", "precision"),
                         doc="training dtype δ of parameters and activations")
    grad_dtype: DType | None = param(None, aliases=("main_grads_dtype", "grad_reduce_dtype"),
                                     doc="dtype gradients are accumulated and reduced in: fp32 or the training "
                                         "dtype; default fp32 for bf16 and fp8 (Megatron-LM's fp32 main_grad, "
                                         "torchtitan's reduce_dtype), the training dtype otherwise")
    activation_checkpoint: Checkpointing | Auto = param(
        Checkpointing.NONE, aliases=("recompute", "activation_checkpointing", "recompute_granularity"),
        doc="activation checkpointing: none, selective or full; auto: the planner chooses per stage "
            "(a stage's own key overrides it)")
    attention: AttentionKind = param(AttentionKind.FLASH, aliases=("attention_kernel",),
                                     doc="the attention core: flash (fused, no S×S scores in memory) or "
                                         "unfused (scores and softmax materialised, as Megatron-LM ran before "
                                         "flash attention); the same result, another speed")
    hidden_dropout: float = param(0.0, lo=0, hi=0.9, aliases=("resid_pdrop", "hidden_dropout_prob"),
                                  doc="dropout on the embedding's output and on each attention and MLP output "
                                      "before its residual add (Megatron-LM's --hidden-dropout; GPT-3 used 0.1)")
    attention_dropout: float = param(0.0, lo=0, hi=0.9, aliases=("attn_pdrop", "attention_probs_dropout_prob"),
                                     doc="dropout on the attention probabilities (Megatron-LM's "
                                         "--attention-dropout); not with ring attention")
    tied_embeddings: bool = param(False, aliases=("tie_word_embeddings", "tie_embeddings"),
                                  doc="share the embedding and output matrices (on different stages: a copy "
                                      "on the head's, its gradient summed with the embedding's each step)")
    norm_eps: float = param(1e-5, lo=0, hi=1, doc="RMSNorm/LayerNorm epsilon")
    rope_theta: float = param(10000.0, lo=1, hi=1e12, doc="RoPE base (llama)")
    head_dim: int | None = param(None, lo=1, hi=1 << 14, aliases=("head_size", "kv_channels"),
                                 doc="size of one attention head (default hidden / heads)")
    qkv_bias: bool = param(False, aliases=("add_qkv_bias",), doc="biases on the q, k and v projections (llama)")
    out_bias: bool = param(False, doc="a bias on the attention output projection (llama)")
    qk_norm: bool = param(False, doc="an RMSNorm over each head of q and of k, before RoPE (Qwen3)")
    rope_scaling: RopeScalingSpec | None = param(None, block="rope_scaling",
                                                 doc="RoPE frequency scaling (Llama 3.1: llama3)")
    optimizer: OptimizerSpec = param(factory=OptimizerSpec, block="optimizer", doc="the optimizer")
    moe: MoESpec | None = param(None, block="moe", doc="mixture of experts in every block")

    @property
    def gradient_dtype(self) -> DType:
        """The dtype gradients are accumulated and reduced in (Note [gradient dtype])."""
        if self.grad_dtype is not None:
            return self.grad_dtype
        return DType.FP32 if executed_dtype(self.dtype) is DType.BF16 else storage_dtype(self.dtype)

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_size(self) -> int:
        """d: the size of one attention head."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    def hf_dir(self, fallback_dir: Path | str = ".") -> Path | None:
        """The `hf` directory (relative paths are relative to the spec file that wrote them), or None."""
        if not self.hf:
            return None
        return declared_path(self.hf, self.span_of("hf"), fallback_dir)


    @property
    def num_model_layers(self) -> int:
        """embed + blocks + head: the units stages own."""
        return self.layers + 2

    def holds_tied_copy(self, layers: range) -> bool:
        """Whether a module of `layers` (a ministage's, or a ZeRO-3 unit's) holds the head's copy of a tied
        embedding: the head without the embedding (Note [tied copies] in runtime/nn/model.py)."""
        return self.tied_embeddings and self.layers + 1 in layers and 0 not in layers

    def layer_name(self, idx: int) -> str:
        if idx == 0:
            return "embed"
        if idx == self.layers + 1:
            return "head"
        return f"block{idx - 1}"

    def span_name(self, first: int, stop: int) -> str:
        """Layers first..stop-1 as a spec writes them: 'head' or 'embed..block7'."""
        a, b = self.layer_name(first), self.layer_name(stop - 1)
        return a if a == b else f"{a}..{b}"

    def layer_index(self, name: str) -> int | None:
        """Index in [embed, block0, ..., head], or None for an unknown name."""
        if name == "embed":
            return 0
        if name == "head":
            return self.layers + 1
        digits = name[5:]
        if name.startswith("block") and digits.isdigit() and int(digits) < self.layers and \
                (digits == "0" or not digits.startswith("0")):
            return int(digits) + 1
        return None


# ---------------------------------------------------------------- cluster


@dataclass(frozen=True, slots=True, kw_only=True)
class PeakSpec(Node):
    fp32: float = param(0.0, unit=Dim.COMPUTE, lo=0, doc="dense fp32 peak")
    tf32: float = param(0.0, unit=Dim.COMPUTE, lo=0, doc="dense tf32 tensor-core peak")
    bf16: float = param(0.0, unit=Dim.COMPUTE, lo=0, doc="dense bf16 peak")
    fp16: float = param(0.0, unit=Dim.COMPUTE, lo=0, doc="dense fp16 peak")
    fp8: float = param(0.0, unit=Dim.COMPUTE, lo=0, doc="dense fp8 peak")

    def lists(self, dtype: DType) -> bool:
        """Whether this peak block gives `dtype` a rate: the kind runs `dtype` natively (Note [Precision that runs])."""
        return self._rates()[dtype] > 0

    def listed(self) -> tuple[DType, ...]:
        """The dtypes this kind runs natively, fp32 first."""
        return tuple(dtype for dtype in DType if self.lists(dtype))

    def for_dtype(self, dtype: DType) -> float:
        """FLOP/s this kind computes a model of `dtype` at: Note [Precision that runs].

        The peak of the dtype the runtime executes it as (fp8 runs as bf16) where
        the kind lists it; else the fp32 peak, the rate torch reaches without
        tensor cores for that format (bf16 on a V100, tf32 on a T4).
        """
        executed = executed_dtype(dtype)
        return self._rates()[executed] if self.lists(executed) else self.fp32

    def _rates(self) -> dict[DType, float]:
        return {DType.FP32: self.fp32, DType.TF32: self.tf32, DType.BF16: self.bf16, DType.FP16: self.fp16,
                DType.FP8: self.fp8}


# Note [Precision that runs]
# A kind runs natively the dtypes its `peak` block lists (one fact: specs/catalog.het gives each kind the
# rates of its datasheet, and no rate where it has no such unit). The cost model charges a model dtype at
# the rate the runtime really reaches, never at another format's peak:
# - A dtype the kind does not list runs at its fp32 peak. torch computes a bf16 matmul on a GPU without
#   bf16 tensor cores (V100, T4, P100: compute capability < 8.0) with fp32 arithmetic, and TF32 is a mode of
#   Ampere's tensor cores, so on older kinds a tf32 model computes plain fp32. Costing at that rate, rather
#   than refusing the spec, lets the planner still mix such kinds with newer ones: it gives them less work.
#   (Before, a bf16 model on a V100 was charged at its fp16 tensor-core peak, 8x too fast.)
# - fp8 runs as bf16 (runtime/nn/model.py `compute_dtype`) until fp8 execution (torchao's float8
#   training) exists: `executed_dtype` maps it, so its peak and its bytes (`DTYPE_BYTES`) are bf16's. A spec
#   asking fp8 of a kind that lists no fp8 (A100) is refused (passes/validate_precision.py): no fp8 path
#   would ever run there.
# - tf32 is charged the tf32 peak, and the runtime turns TF32 matmuls on for tf32 models only
#   (runtime/nn/model.py `float32_matmul_precision`); fp32 models keep full-precision matmuls.


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec(Node):
    name: str = param(label=True, doc="the device kind's name, referenced by nodes")
    memory: float = param(unit=Dim.MEMORY, lo=1, doc="device memory")
    peak: PeakSpec = param(factory=PeakSpec, block="peak", doc="peak dense FLOP/s per dtype")
    host_link: float = param(16e9, unit=Dim.BANDWIDTH, lo=1, aliases=("pcie",),
                             doc="host<->device copy bandwidth")
    price: float = param(0.0, unit=Dim.PRICE_HOUR, lo=0, doc="price per device-hour")
    memory_bandwidth: float = param(0.0, unit=Dim.BANDWIDTH, lo=0, aliases=("hbm_bandwidth",),
                                    doc="the datasheet's device memory bandwidth (0: unknown); memory-bound "
                                        "work such as the optimizer step streams at 0.9 of it")
    efficiency: float = param(0.5, lo=0.01, hi=1, aliases=("mfu",),
                              doc="fraction of peak reached without a profile: by the largest matrix "
                                  "multiplies where `sms` is given (smaller ones by their shape), else by "
                                  "matmul-heavy layers")
    sms: int = param(0, lo=0, hi=100_000, aliases=("sm_count", "multiprocessors"),
                     doc="streaming multiprocessors (0: unknown); with them, compute time without a profile "
                         "follows each matrix multiply's shape (tiles, waves, memory-bound small ones)")

    def runs(self, dtype: DType) -> bool:
        """Whether this kind runs `dtype` natively: its peak block lists it (Note [Precision that runs])."""
        return self.peak.lists(dtype)

    @property
    def is_cpu(self) -> bool:
        """A `cpu...` kind stands for a CPU process of a local run, not a GPU."""
        return self.name.lower().startswith("cpu")


@dataclass(frozen=True, slots=True, kw_only=True)
class IntraLinkSpec(Node):
    bandwidth: float = param(unit=Dim.BANDWIDTH, lo=1, doc="per-GPU bandwidth inside a node")
    latency: float = param(5e-6, unit=Dim.TIME, lo=0, doc="latency inside a node")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec(Node):
    name: str = param(label=True, doc="the node group's name, used in rank sets")
    device: str = param(doc="device kind of every GPU", aliases=("gpu", "kind"))
    count: int = param(1, lo=1, hi=100_000, aliases=("nodes",), doc="number of nodes in the group")
    gpus: int = param(1, lo=1, hi=1024, aliases=("gpus_per_node", "nproc_per_node"),
                      doc="GPUs per node")
    region: str = param("default", doc="region (links between regions may cost egress)")
    zone: str = param("", doc="zone inside the region (defaults to the region)")
    host_memory: float = param(0.0, unit=Dim.MEMORY, lo=0, doc="host memory per node (offload)")
    cores: int = param(0, lo=0, hi=1_000_000, aliases=("cpu_cores",),
                       doc="CPU cores the node's ranks share (0: each rank has its own); with fewer cores "
                           "than ranks running, every rank's compute slows by ranks / cores")
    nics: int = param(1, lo=1, hi=64, aliases=("nics_per_node",),
                      doc="network interfaces each node reaches the others through: one GPU's stream to "
                          "another node moves at most 1/nics of the node pair's link, as on rail-optimized "
                          "boards where each GPU sends through its own NIC (DGX A100 and H100: 8)")
    intra: IntraLinkSpec | None = param(None, block="intra", shorthand=False,
                                        doc="the link between GPUs of one node")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec(Node):
    """`link A <-> B { }`: A and B name node groups, or are quoted regions/zones."""

    a: str = param(label=True, doc="one end: a node group, or a \"region\" / \"zone\"")
    b: str = param(label=True, doc="the other end")
    bandwidth: float = param(unit=Dim.BANDWIDTH, lo=1, doc="bandwidth per node pair")
    latency: float = param(10e-6, unit=Dim.TIME, lo=0, doc="one-way latency")
    egress: float = param(0.0, unit=Dim.PRICE_GB, lo=0, doc="price per GB sent across")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec(Node):
    name: str = param("cluster", label=True, doc="the cluster's name")
    nodes: tuple[NodeSpec, ...] = param((), block="node", doc="node groups, in rank order")
    links: tuple[LinkSpec, ...] = param((), block="link", doc="links between node groups or regions")
    inter_bandwidth: float = param(12.5e9, unit=Dim.BANDWIDTH, lo=1, aliases=("network",),
                                   doc="default bandwidth between two nodes")
    inter_latency: float = param(20e-6, unit=Dim.TIME, lo=0, doc="default latency between nodes")
    cores: int = param(0, lo=0, hi=1_000_000, aliases=("cpu_cores",),
                       doc="CPU cores every rank of the cluster shares, as in a local run whose nodes are one "
                           "machine (0: not shared); like a node's `cores`, for all the plan's ranks together")


# ---------------------------------------------------------------- train


@dataclass(frozen=True, slots=True, kw_only=True)
class DataFileSpec(Node):
    """Where sequences come from: generated, or windows of a file (runtime/data.py)."""

    kind: DataKind = param(DataKind.SYNTHETIC, label=True,
                           doc="synthetic tokens, a byte-level text file, a token file (`tokens`), or a `blend` "
                               "of `source` blocks")
    path: str = param("", doc="the text or token file, relative to the file that declares it; for `tokens` a "
                              "flat token file (nanoGPT's raw ids, or `hetc data prepare`'s with a header) or "
                              "a Megatron indexed dataset (PREFIX, PREFIX.bin or PREFIX.idx)")
    dtype: TokenDType | None = param(None, aliases=("token_dtype",),
                                     doc="`tokens`: uint16 or uint32 ids; needed for a raw file, checked "
                                         "against a header or a Megatron .idx (whose int32 is uint32 here)")
    tokenizer: str = param("", doc="`tokens`: the Hugging Face tokenizer directory the ids are for; a file "
                                   "`hetc data prepare` wrote with another tokenizer is an error")
    shuffle: bool = param(True, doc="`text`/`tokens`: visit windows in an order shuffled by (seed, epoch); "
                                    "false: global sequence g is tokens [g·seq, (g+1)·seq]")

    def resolve(self, fallback_dir: Path | str = ".", path: str | None = None) -> Path:
        """The data file (or `path`): relative paths are relative to the spec file that wrote them."""
        return declared_path(self.path if path is None else path, self.span, fallback_dir)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlendSourceSpec(DataFileSpec):
    """One file of a blend and its share of the sequences (Note [Blends] in runtime/data.py)."""

    weight: float = param(1.0, lo=0, hi=1e12, doc="its share of the sequences, relative to the other sources' "
                                                  "weights (Megatron-LM's --data-path weights)")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec(DataFileSpec):
    """The training (or evaluation) data: one source, or a blend of several."""

    sources: tuple[BlendSourceSpec, ...] = param((), block="source",
                                                 doc="`blend`: the text or token files mixed, each with its weight")

    def files(self) -> tuple[DataFileSpec, ...]:
        """The files it reads: a blend's sources, itself, or none (synthetic)."""
        if self.kind is DataKind.BLEND:
            return self.sources
        return () if self.kind is DataKind.SYNTHETIC else (self,)


def declared_path(text: str, span: Span, fallback_dir: Path | str = ".") -> Path:
    """Path `text` as written at `span`: relative to the spec file that wrote it (else `fallback_dir`)."""
    path = Path(text)
    if path.is_absolute():
        return path
    declared = span.file
    base = Path(declared).parent if declared and not declared.startswith("<") else Path(fallback_dir)
    return base / path


@dataclass(frozen=True, slots=True, kw_only=True)
class LrScheduleSpec(Node):
    kind: LrScheduleKind = param(LrScheduleKind.CONSTANT, label=True,
                                 doc="constant, cosine or linear decay, wsd (warm-up, stable, decay), or "
                                     "inverse_sqrt (lr sqrt(warmup / n) at update n)")
    warmup: int = param(0, lo=0, hi=10**9, aliases=("warmup_steps", "lr_warmup_iters"),
                        doc="linear warm-up steps")
    min_lr: float = param(0.0, lo=0, hi=1e3, doc="learning rate at the end of decay")
    decay_steps: int = param(0, lo=0, hi=10**9, aliases=("lr_wsd_decay_iters",),
                             doc="steps the decay takes: cosine and linear from the end of warm-up, then "
                                 "min_lr (0: to the last step); wsd the run's last steps (needed)")
    decay: LrDecay = param(LrDecay.LINEAR, aliases=("decay_type", "lr_wsd_decay_style"),
                           doc="wsd: the decay's shape, linear, cosine or sqrt (1 - sqrt of its progress)")


@dataclass(frozen=True, slots=True, kw_only=True)
class LossScaleSpec(Node):
    """fp16's dynamic loss scale (Megatron-LM's DynamicGradScaler, DeepSpeed's fp16 block): runtime/loss_scale.py."""

    initial: float = param(65536.0, lo=1, hi=2.0**64, aliases=("initial_loss_scale",),
                           doc="the scale of the first step (DeepSpeed's 2^initial_scale_power, 2^16)")
    window: int = param(1000, lo=1, hi=10**9, aliases=("loss_scale_window", "growth_interval"),
                        doc="steps without overflow after which the scale doubles")
    hysteresis: int = param(2, lo=1, hi=10**6,
                            doc="overflows since the scale last grew before it halves (each skips its update)")
    min: float = param(1.0, lo=1e-4, hi=2.0**64, aliases=("min_loss_scale",),
                       doc="the scale never falls below this")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSpec(Node):
    global_batch: int = param(lo=1, hi=1 << 30, aliases=("global_batch_size", "train_batch_size"),
                              doc="sequences per optimizer step B")
    micro_batch: int = param(1, lo=1, hi=1 << 20,
                             aliases=("micro_batch_size", "train_micro_batch_size_per_gpu", "mbs"),
                             doc="sequences per microbatch b")
    grad_accum: int | None = param(None, lo=1, hi=1 << 20, aliases=("gradient_accumulation_steps",),
                                   doc="microbatches per lane (checked against global_batch)")
    steps: int = param(10, lo=1, hi=10**9, aliases=("train_iters", "max_steps"), doc="optimizer steps")
    lr: float = param(1e-3, lo=0, hi=1e3, aliases=("learning_rate",), doc="peak learning rate")
    grad_clip: float = param(0.0, lo=0, hi=1e9, aliases=("gradient_clipping", "clip_grad", "max_norm"),
                             doc="global gradient-norm clipping (0: off)")
    seed: int = param(0, lo=0, hi=2**63 - 1, doc="seed of initialisation and data")
    data: DataSpec = param(factory=DataSpec, block="data", doc="training data")
    eval_every: int = param(0, lo=0, hi=10**9, aliases=("eval_interval",),
                            doc="compute the validation loss every this many steps (0: never)")
    eval_batches: int = param(1, lo=1, hi=10**6, aliases=("eval_iters",),
                              doc="global batches the validation loss averages over")
    eval_share: float = param(0.0, lo=0, hi=0.5, aliases=("validation_split",),
                              doc="hold out this share of the training data's windows (its end) for "
                                  "validation, instead of an eval block")
    eval: DataSpec | None = param(None, block="eval", aliases=("eval_data",),
                                  doc="validation data, written like data (`eval tokens { path = ... }`)")
    lr_schedule: LrScheduleSpec = param(factory=LrScheduleSpec, block="lr_schedule",
                                        doc="learning-rate schedule")
    loss_scale: LossScaleSpec = param(factory=LossScaleSpec, block="loss_scale",
                                      doc="dtype = fp16: the dynamic loss scale")


# ---------------------------------------------------------------- parallel


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroSpec(Node):
    level: int | Auto = param(0, lo=0, hi=3, shorthand=True, aliases=("stage",),
                              doc="ZeRO level inside a shard group: 0 all-reduce, 1 shard optimizer, "
                                  "2 also gradients, 3 also parameters")
    shard: ZeroShard = param(ZeroShard.ALL, doc="shard over all lanes, or only lanes on one node (HSDP)")
    across: int = param(0, lo=0, hi=1, aliases=("replicate_level",),
                        doc="level across shard groups: 0 all-reduce the shards, 1 also shard optimizer")

    @property
    def resolved_level(self) -> int:
        """The level of a resolved plan, where the planner has replaced `auto`."""
        if isinstance(self.level, Auto):
            raise InternalError("a ZeRO level of auto after planning")
        return self.level


@dataclass(frozen=True, slots=True, kw_only=True)
class OffloadSpec(Node):
    params: OffloadTarget = param(OffloadTarget.NONE, aliases=("offload_param", "param"),
                                  doc="keep parameters of inactive ministages on the host")
    optimizer: OffloadTarget = param(OffloadTarget.NONE, aliases=("offload_optimizer",),
                                     doc="keep optimizer state on the host")
    activations: OffloadTarget = param(OffloadTarget.NONE, aliases=("offload_activations",),
                                       doc="keep boundary activations on the host")
    pin_memory: bool = param(True, doc="page-locked host buffers (GPU)")

    @property
    def any(self) -> bool:
        return any(t is not OffloadTarget.NONE for t in (self.params, self.optimizer, self.activations))


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerRange(Node):
    """`embed..block3`: layers first through last, inclusive."""

    first: str
    last: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSlice(Node):
    """`group[n, g0:g1]`: GPUs g0..g1-1 of node n of a node group (None: all)."""

    group: str
    node_start: int | None = None
    node_stop: int | None = None
    gpu_start: int | None = None
    gpu_stop: int | None = None
    node_is_slice: bool = True
    gpu_is_slice: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing(Node):
    """How a stage's microbatches are spread over its lanes."""

    kind: RoutingKind = RoutingKind.EVEN
    counts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSpec(Node):
    name: str = param(label=True, doc="the stage's name")
    layers: tuple[LayerRange, ...] | Auto = param(
        AUTO, doc="layer range, or a list of ranges (one per ministage / virtual stage)")
    ranks: tuple[RankSlice, ...] | Auto = param(AUTO, aliases=("gpus",), doc="the GPUs of this stage")
    lanes: int | Auto = param(AUTO, lo=1, hi=1 << 20, aliases=("dp", "replicas"),
                              doc="lanes (replicas); each serves whole microbatches")
    tp: int | Auto = param(1, lo=1, hi=1024, aliases=("tensor_model_parallel_size", "tensor_parallel"),
                           doc="tensor parallelism inside a lane (N_rep)")
    cp: int | Auto = param(1, lo=1, hi=1024,
                           aliases=("context_parallel_size", "context_parallel_degree", "sp"),
                           doc="sequence/context parallelism inside a lane (N_part)")
    cp_kind: CPKind = param(CPKind.RING, doc="ulysses (all-to-all) or ring attention")
    sequence_parallel: bool = param(False, doc="Megatron sequence parallelism with tp")
    ep: int = param(1, lo=1, hi=4096, aliases=("expert_model_parallel_size", "expert_parallel_size", "ep_size"),
                    doc="expert parallelism: lanes i·ep..(i+1)·ep−1 split the experts of MoE blocks "
                        "between them (all-to-all dispatch and combine)")
    ministages: int | Auto = param(1, lo=1, hi=1 << 16, aliases=("interleave", "virtual_stages"),
                                   doc="split the layers into this many ministages")
    microbatches: Routing | Auto = param(
        Routing(), doc="even, proportional (to lane speed) or explicit counts per lane")
    zero: ZeroSpec | None = param(None, block="zero", doc="this stage's ZeRO (overrides parallel's)")
    offload: OffloadSpec | None = param(None, block="offload", doc="this stage's offload policy")
    activation_checkpoint: Checkpointing | Auto | None = param(
        None, aliases=("recompute", "activation_checkpointing", "recompute_granularity"),
        doc="this stage's activation checkpointing: none, selective, full or auto (the planner chooses); "
            "default: the model's")

    def checkpoint_under(self, model: ModelSpec) -> Checkpointing | Auto:
        """The stage's activation checkpointing: its own key, else the model's."""
        return model.activation_checkpoint if self.activation_checkpoint is None else self.activation_checkpoint

    @property
    def resolved_ranks(self) -> tuple[RankSlice, ...]:
        """The GPUs of a resolved plan's stage, where the planner has replaced `auto`."""
        if isinstance(self.ranks, Auto):
            raise InternalError("stage ranks of auto after planning")
        return self.ranks


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectiveSpec(Node):
    goal: Objective = param(Objective.THROUGHPUT, label=True, doc="throughput or cost")
    budget: float = param(0.0, unit=Dim.PRICE_HOUR, lo=0, doc="most $/h to spend (0: no limit)")
    min_throughput: float = param(0.0, unit=Dim.THROUGHPUT, lo=0, doc="least tokens/s (cost goal)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec(Node):
    schedule: ScheduleKind | Auto = param(ScheduleKind.ONE_F_ONE_B,
                                          aliases=("pipeline_parallel_schedule",),
                                          doc="gpipe, 1f1b, interleaved, zb or zorse")
    zero: ZeroSpec = param(factory=ZeroSpec, block="zero", aliases=("zero_optimization",),
                           doc="ZeRO level and hierarchy for every stage")
    offload: OffloadSpec = param(factory=OffloadSpec, block="offload", doc="offload policy")
    prefetch: int | Auto = param(1, lo=0, hi=64, aliases=("prefetch_depth",),
                                 doc="ministages prefetched ahead of use")
    stages: tuple[StageSpec, ...] | Auto = param(AUTO, block="stage",
                                                 doc="pipeline stages in order; none written: auto")
    idle: tuple[RankSlice, ...] = param((), doc="GPUs deliberately left out of the plan")
    objective: ObjectiveSpec = param(factory=ObjectiveSpec, block="objective",
                                     doc="what the planner optimises")

    @property
    def resolved_stages(self) -> tuple[StageSpec, ...]:
        """The stages of a resolved plan, where the planner has replaced `auto`."""
        if isinstance(self.stages, Auto):
            raise InternalError("stages of auto after planning")
        return self.stages


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec(Node):
    """A whole spec: everything the files (and their imports) define."""

    model: ModelSpec | None = param(None, block="model", doc="the model")
    devices: tuple[DeviceSpec, ...] = param((), block="device", doc="device kinds")
    cluster: ClusterSpec | None = param(None, block="cluster", doc="the cluster")
    train: TrainSpec | None = param(None, block="train", doc="the training job")
    parallel: ParallelSpec | None = param(None, block="parallel", doc="the parallel plan")

    def device(self, name: str) -> DeviceSpec | None:
        return next((d for d in self.devices if d.name == name), None)

    @property
    def is_complete(self) -> bool:
        return None not in (self.model, self.cluster, self.train, self.parallel)
