"""Build the layers a rank owns from a ModelSpec, with plan-independent weights.

Layers are indexed over [embed, block0, ..., block{L-1}, head] (index 0,
1..L, L+1), as in hetc.ir.pipeline. A `Ministage` is a contiguous run of them
as one module: forward takes the boundary activation [b, s, H] (token ids
[b, s] when it starts with the embedding) and returns the next boundary
activation (the loss when it ends with the head).

Note [Deterministic initialisation]
Each parameter is drawn from its own generator seeded by (seed, layer
index, parameter name) — never from the global RNG — as the *full* tensor,
and a tensor-parallel shard keeps its slice. So every plan, whichever rank
builds a layer and whatever it built before, starts from identical weights.
Modules are constructed on the meta device, which also skips torch's default
initialisation (and its use of the global RNG).

Note [Precision]
Layers are built and initialised in fp32. The runtime keeps fp32 master
weights in the flat buffers (runtime/flat.py) and binds the module's
parameters to a buffer of `compute_dtype(model.dtype)` (bf16/fp16 on GPU;
the demo's fp32 on CPU, where master and compute buffer are one tensor).
On CUDA a tf32 model's fp32 matmuls run on TF32 tensor cores, the rate it is
costed at (`float32_matmul_precision`; Note [Precision that runs] in hetc/ir/spec.py).

Note [tied copies]
With `tied_embeddings` the embedding matrix is also the head's output
matrix. A ministage holding both uses the one parameter twice. A head in a
ministage of its own (the last pipeline stage, as Megatron places it) holds
a *copy*: `head.output.weight`, initialised from the embedding's seed, so
both start equal. Each step the two gradients are summed between the ranks
holding them (`all_reduce tied`, runtime/tied.py) before either steps, so
both take the same update and stay equal. The copy is not a parameter of
the model: checkpoints and Hugging Face exports hold the embedding's alone,
and a loader fills the copy from it (`stored_name`); the gradient norm
counts the embedding's only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from hetc.ir.errors import InternalError
from hetc.runtime.nn.attention import Attention, Rotary
from hetc.runtime.nn.layers import NORMS, Block, Embedding, Head
from hetc.runtime.nn.moe import ALL_EXPERTS, ExpertShard
from hetc.runtime.nn.seeding import generator
from hetc.runtime.nn.tensor_parallel import NO_SHARD, ParallelLinear, TPShard, shard_infos
from hetc.ir.spec import Arch, Auto, Checkpointing, DType, ModelSpec, executed_dtype

__all__ = [
    "TIED_COPY",
    "TIED_WEIGHT",
    "Ministage",
    "TokenLayout",
    "build_layer",
    "build_ministage",
    "compute_dtype",
    "float32_matmul_precision",
    "full_shapes",
    "grad_dtype",
    "init_layer",
    "stored_name",
    "use_matmul_precision",
]

log = logging.getLogger(__name__)


_TORCH_DTYPES = {DType.FP32: torch.float32, DType.TF32: torch.float32, DType.BF16: torch.bfloat16,
                 DType.FP16: torch.float16}
MatmulPrecision = Literal["highest", "high"]


def compute_dtype(dtype: DType) -> torch.dtype:
    """The dtype of a ministage's compute parameters and activations for ModelSpec.dtype.

    tf32 stores fp32 (TF32 is a matmul mode, not a storage format:
    `float32_matmul_precision`). fp8 has no native training path here and
    computes in bf16 (`executed_dtype`, which the cost model shares). fp16
    trains with a dynamic loss scale (runtime/loss_scale.py).
    """
    executed = executed_dtype(dtype)
    if executed is not dtype:
        log.warning("%s training is not implemented; computing in %s", dtype.value, executed.value)
    return _TORCH_DTYPES[executed]


def grad_dtype(model: ModelSpec) -> torch.dtype:
    """The dtype of a ministage's gradient buffers: fp32 for a bf16 model (Note [gradient dtype] in
    hetc/ir/spec.py)."""
    return _TORCH_DTYPES[model.gradient_dtype]


def float32_matmul_precision(dtype: DType) -> MatmulPrecision:
    """torch's float32 matmul precision (`torch.set_float32_matmul_precision`) for a model of `dtype`.

    "high" lets fp32 matmuls use TF32 tensor cores: a tf32 model is costed at
    the tf32 peak. Every other model keeps torch's default "highest", so an
    fp32 model computes the precision it asked for and is costed at, and the
    fp32 parts of a 16-bit model stay exact.
    """
    return "high" if dtype is DType.TF32 else "highest"


def use_matmul_precision(dtype: DType, device: torch.device) -> None:
    """Set this process's float32 matmul precision for a model of `dtype`, on a CUDA device only.

    Process-wide, like torchtitan's TF32 switch: a rank trains one model. CPU
    ranks are left alone (TF32 is a tensor-core mode), and hetc has no
    convolutions, so cuDNN's TF32 flag does not matter.
    """
    if device.type == "cuda":
        torch.set_float32_matmul_precision(float32_matmul_precision(dtype))


TIED_WEIGHT = "embed.tok_embeddings.weight"   # the tied matrix, as checkpoints and exports name it
TIED_COPY = "head.output.weight"              # the head's copy of it (Note [tied copies])


def stored_name(model: ModelSpec, name: str) -> str:
    """The name parameter `name` is saved and loaded under: the tied copy's is the embedding's."""
    return TIED_WEIGHT if model.tied_embeddings and name == TIED_COPY else name


def _construct(model: ModelSpec, idx: int, shard: TPShard, experts: ExpertShard,
               tied_copy: bool = False) -> nn.Module:
    if idx == 0:
        return Embedding(model)
    if idx == model.layers + 1:
        return Head(model, tied_copy=tied_copy)
    if not 0 < idx <= model.layers:
        raise InternalError(f"layer {idx} outside [0, {model.layers + 1}]")
    return Block(model, shard, experts=experts)


def build_layer(model: ModelSpec, idx: int, *, seed: int, shard: TPShard = NO_SHARD,
                device: torch.device | str = "cpu", experts: ExpertShard = ALL_EXPERTS,
                initialise: bool = True, tied_copy: bool = False) -> nn.Module:
    """Layer `idx` (0 embed, 1..L blocks, L+1 head) in fp32 on `device`, initialised.

    `experts`: which experts of an MoE block this rank holds (expert parallelism).
    `tied_copy`: a head apart from the embedding of a tied model holds its copy (Note [tied copies]).
    `initialise=False` leaves the parameters on the meta device, without
    values: a rank whose weights come from a file (Note [Ranks that load their weights]).
    """
    with torch.device("meta"):
        layer = _construct(model, idx, shard, experts, tied_copy)
    if list(layer.buffers()):
        raise InternalError("layers hold no buffers: they would be left on the meta device")
    if initialise:
        _materialise(layer, device)
        init_layer(layer, model, idx, seed)
    return layer


def _materialise(layer: nn.Module, device: torch.device | str) -> None:
    """Give each meta parameter of `layer` uninitialised storage on `device`: `layer.to_empty(device)`
    without its torch.empty_like of a meta tensor, whose Python reference imports sympy (0.3-0.5 s of
    every rank's start-up)."""
    for module in layer.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                               requires_grad=param.requires_grad))


def full_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model (global names) with its full shape; built on the meta device."""
    ends = (0, model.layers + 1)
    with torch.device("meta"):      # blocks are alike: build one
        built = {idx: shard_infos(_construct(model, idx, NO_SHARD, ALL_EXPERTS)) for idx in (*ends, 1)}
    return {f"{model.layer_name(idx)}.{name}": info.full_shape
            for idx in range(model.num_model_layers)
            for name, info in built[idx if idx in ends else 1].items()}


def _initial_value(owner: nn.Module, name: str, shape: tuple[int, ...], model: ModelSpec,
                   gen: torch.Generator) -> Tensor:
    """The full initial tensor of parameter `name` of module `owner`."""
    if isinstance(owner, NORMS):
        return torch.ones(shape) if name == "weight" else torch.zeros(shape)
    if name == "bias":
        return torch.zeros(shape)
    if not isinstance(owner, (ParallelLinear, nn.Embedding)):
        raise InternalError(f"no init rule for {type(owner).__name__}")
    scaled = isinstance(owner, ParallelLinear) and owner.scaled_init
    std = model.init_std / math.sqrt(2 * model.layers) if scaled else model.init_std
    return torch.randn(shape, generator=gen) * std


def init_layer(layer: nn.Module, model: ModelSpec, idx: int, seed: int) -> None:
    """(Re)initialise every parameter of layer `idx`; see Note [Deterministic initialisation]."""
    infos = shard_infos(layer)
    owners = {f"{prefix}.{n}" if prefix else n: (mod, n)
              for prefix, mod in layer.named_modules() for n, _ in mod.named_parameters(recurse=False)}
    with torch.no_grad():
        for name, param in layer.named_parameters():
            owner, local = owners[name]
            full = _initial_value(owner, local, infos[name].full_shape, model,
                                  generator(seed, *_drawn_as(model, idx, name)))
            param.copy_(infos[name].slice_of(full))


def _drawn_as(model: ModelSpec, idx: int, name: str) -> tuple[int, str]:
    """(layer index, name) that seed parameter `name` of layer `idx`: the tied copy draws the embedding's
    values (Note [tied copies]; both are N(0, init_std) matrices of shape [V, H])."""
    if stored_name(model, f"{model.layer_name(idx)}.{name}") == TIED_WEIGHT:
        return 0, TIED_WEIGHT.removeprefix("embed.")
    return idx, name


@dataclass(frozen=True)
class TokenLayout:
    """Which tokens of the sequence a rank holds, when not all of them (hetc/ir/layout.py).

    positions: the rank's tokens at the ministage borders (its inputs,
    outputs and labels); attention_positions: the tokens its attention core
    sees (its cp rank's, gathered over tp under sequence parallelism), which
    set the RoPE angles; seq: the full sequence length, so the head's loss is
    this rank's share of the microbatch mean. None: the whole sequence.
    """

    positions: Tensor | None = None
    attention_positions: Tensor | None = None
    seq: int | None = None


class Ministage(nn.Module):
    """Layers [first_layer, stop_layer) of the model as one module.

    Each layer is a direct submodule named after it ("embed", "block0",
    "head"), so parameter names are global: `block0.attention.wq.weight`.
    """

    def __init__(self, model: ModelSpec, layers: range, *, seed: int, shard: TPShard = NO_SHARD,
                 device: torch.device | str = "cpu", experts: ExpertShard = ALL_EXPERTS,
                 initialise: bool = True, checkpoint: Checkpointing | None = None) -> None:
        super().__init__()
        if not (layers.step == 1 and len(layers) > 0):
            raise InternalError(f"a ministage is a non-empty run of layers: {layers}")
        self.first_layer, self.stop_layer = layers.start, layers.stop
        self.layer_names = tuple(model.layer_name(i) for i in layers)
        self.tied_copy = model.holds_tied_copy(layers)
        for i, name in zip(layers, self.layer_names):
            self.add_module(name, build_layer(model, i, seed=seed, shard=shard, device=device, experts=experts,
                                              initialise=initialise, tied_copy=self.tied_copy))
        has_block = any(isinstance(layer, Block) for layer in self.layers.values())
        self.rotary = Rotary(model.head_size, model.rope_theta, device, model.rope_scaling) \
            if model.arch is Arch.LLAMA and has_block else None
        level = _model_checkpoint(model) if checkpoint is None else checkpoint
        self.full_checkpoint = level is Checkpointing.FULL
        for attention in self.modules():
            if isinstance(attention, Attention):
                attention.recompute_core = level is Checkpointing.SELECTIVE
        self.token_layout = TokenLayout()

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The layers by name, in model order."""
        return {name: self.get_submodule(name) for name in self.layer_names}

    @property
    def takes_tokens(self) -> bool:
        """True when the first layer is the embedding: the input is token ids [b, s]."""
        return "embed" in self.layer_names

    @property
    def computes_loss(self) -> bool:
        """True when the last layer is the head: the output is the loss."""
        return "head" in self.layer_names

    def forward(self, inputs: Tensor, labels: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Run the layers on one microbatch.

        inputs: token ids [b, s] (int64) if `takes_tokens`, else the boundary
        activation [b, s, H]. labels [b, s]: needed by the head for the loss
        (mean token cross-entropy, fp32 scalar); without, the head returns
        logits. positions [s]: token positions of the sequence this rank
        holds; default `token_layout`'s (context parallelism), else 0..s-1.
        """
        layout = self.token_layout
        if positions is None:
            positions = layout.positions if layout.positions is not None else \
                torch.arange(inputs.shape[1], device=inputs.device)
        attending = layout.attention_positions if layout.attention_positions is not None else positions
        rope = self.rotary(attending) if self.rotary is not None else None
        x = inputs
        for layer in self.layers.values():
            if isinstance(layer, Embedding):
                x = layer(x, positions)
            elif isinstance(layer, Block):
                x = self._run_block(layer, x, rope)
            else:
                tied = self.get_submodule("embed").tok_embeddings.weight if layer.output is None else None
                tokens = None if layout.seq is None or labels is None else labels.shape[0] * layout.seq
                x = layer(x, labels, tied, tokens)
        return x

    def _run_block(self, block: Block, x: Tensor, rope) -> Tensor:
        if self.full_checkpoint and torch.is_grad_enabled():
            return checkpoint(block, x, rope, use_reentrant=False)
        return block(x, rope)


def build_ministage(model: ModelSpec, layers: range, *, seed: int, shard: TPShard = NO_SHARD,
                    device: torch.device | str = "cpu", experts: ExpertShard = ALL_EXPERTS,
                    initialise: bool = True, checkpoint: Checkpointing | None = None) -> Ministage:
    """The module of one ministage: what the interpreter builds for each ministage its rank owns.

    Parameters are fp32 and initialised identically under every plan (Note
    [Deterministic initialisation]); wrap them with `hetc.runtime.flat.FlatParams`
    to get the flat master/compute/grad buffers ZeRO works on. With
    `initialise=False` they stay on the meta device (the rotary tables are
    real): MinistageBuffers then allocates only the rank's share, which a
    loader fills (Note [Ranks that load their weights] in runtime/buffers.py).
    Every rank, profile and reference builds its compute here, so this is
    where the model's matmul precision is set (`use_matmul_precision`).
    `checkpoint`: the activation checkpointing of the ministage's stage
    (None: the model's, `_model_checkpoint`).
    """
    use_matmul_precision(model.dtype, torch.device(device))
    return Ministage(model, layers, seed=seed, shard=shard, device=device, experts=experts, initialise=initialise,
                     checkpoint=checkpoint)


def _model_checkpoint(model: ModelSpec) -> Checkpointing:
    """The model's own activation checkpointing; none where it leaves the level to the planner (`auto`): a
    module built outside a plan (the 1-rank reference, a profile) computes the same either way."""
    level = model.activation_checkpoint
    return Checkpointing.NONE if isinstance(level, Auto) else level
