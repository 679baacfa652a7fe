"""Runtime requirements a spec must meet, as messages the validator can report.

Torch-free on purpose: `hetc check` calls these without importing torch.
Each returns None when the spec is fine, else a message for a located error.
"""

from __future__ import annotations

from hetc.ir.errors import SpecError
from hetc.ir.pipeline import Pipeline
from hetc.ir.spec import DataKind, DType, ModelSpec, Spec, TrainSpec

__all__ = ["BYTE_VOCAB", "check_loss_scaling", "check_text_vocab", "check_tied_embeddings", "require_trainable_dtype",
           "ties_in_one_ministage"]

BYTE_VOCAB = 256  # byte-level text: one token per byte


def check_tied_embeddings(model: ModelSpec, pipeline: Pipeline) -> str | None:
    """Why `pipeline` cannot run `model`'s tied embeddings (report at model.span_of("tied_embeddings")).

    Tying shares one matrix between the embedding and the head: one
    parameter inside one ministage, or a copy in each of two stages whose
    gradients are summed every step (Note [tied copies] in
    runtime/nn/model.py). Two ministages of one stage would put both copies
    on every rank of it, which checkpoints and the sum do not handle.
    """
    if not ties_in_one_ministage(model, 1):
        return None
    embed, head = pipeline.ministage_of_layer(0), pipeline.ministage_of_layer(model.layers + 1)
    if embed.index == head.index or embed.stage != head.stage:
        return None
    return (f"tied_embeddings needs the embedding and the head in one ministage or on different stages, but "
            f"stage {embed.stage} holds embed in ministage {embed.index} and head in ministage {head.index}; "
            "set tied_embeddings = false, give one ministage all layers, or put the head on another stage")


def ties_in_one_ministage(model: ModelSpec, num_stages: int) -> bool:
    """Whether a plan of `num_stages` stages must give `model` a single ministage (`check_tied_embeddings`):
    its embedding and head are tied, and one stage holds both (the first and the last stage are one)."""
    return model.tied_embeddings and num_stages == 1


def check_text_vocab(model: ModelSpec, train: TrainSpec) -> str | None:
    """Why byte-level text (training or eval data) cannot feed `model` (report at model.span_of("vocab"))."""
    texts = [f for d in (train.data, train.eval) if d is not None for f in d.files() if f.kind is DataKind.TEXT]
    if texts and model.vocab < BYTE_VOCAB:
        return f"byte-level text needs vocab >= {BYTE_VOCAB}, not {model.vocab}"
    return None



def check_loss_scaling(model: ModelSpec, train: TrainSpec) -> str | None:
    """Why hetc's runtime cannot train `model`'s dtype with `train` (report at model.span_of("dtype")).

    fp16 trains with a dynamic loss scale (runtime/loss_scale.py), which finds an overflow in the global
    gradient norm; the programs compute that norm under clipping, so fp16 needs grad_clip. The cost model
    times fp16 either way, so compile, plan and explain accept it; only `hetc run` refuses it.
    """
    if model.dtype is not DType.FP16 or train.grad_clip > 0:
        return None
    return ("dtype = fp16 trains with a dynamic loss scale, which finds overflows in the global gradient norm "
            "that hetc computes under clipping: set train.grad_clip (Megatron-LM's default is 1.0) and recompile")


def require_trainable_dtype(spec: Spec) -> None:
    """Raise a located SpecError when `hetc run` cannot train the plan's dtype (`check_loss_scaling`)."""
    model = spec.model
    problem = None if model is None or spec.train is None else check_loss_scaling(model, spec.train)
    if model is not None and problem is not None:
        raise SpecError.at(model.span_of("dtype"), problem)
