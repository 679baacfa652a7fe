"""Runtime requirements a spec must meet, as messages the validator can report.

Torch-free on purpose: `hetc check` calls these without importing torch.
Each returns None when the spec is fine, else a message for a located error.
"""

from __future__ import annotations

from hetc.pipeline import Pipeline
from hetc.spec import DataKind, ModelSpec, TrainSpec

__all__ = ["BYTE_VOCAB", "check_text_vocab", "check_tied_embeddings"]

BYTE_VOCAB = 256  # byte-level text: one token per byte


def check_tied_embeddings(model: ModelSpec, pipeline: Pipeline) -> str | None:
    """Why `pipeline` cannot run `model`'s tied embeddings (report at model.span_of("tied_embeddings")).

    Tying shares one matrix between the embedding and the head, which the
    runtime supports only inside one ministage (a matrix used by two
    ministages would need its own gradient all-reduce between them).
    """
    if not model.tied_embeddings:
        return None
    embed, head = pipeline.ministage_of_layer(0), pipeline.ministage_of_layer(model.layers + 1)
    if embed.index == head.index:
        return None
    return (f"tied_embeddings needs the embedding and the head in one ministage, but embed is in "
            f"ministage {embed.index} (stage {embed.stage}) and head in ministage {head.index} "
            f"(stage {head.stage}); set tied_embeddings = false or give one ministage all layers")


def check_text_vocab(model: ModelSpec, train: TrainSpec) -> str | None:
    """Why byte-level text (training or eval data) cannot feed `model` (report at model.span_of("vocab"))."""
    texts = [d for d in (train.data, train.eval) if d is not None and d.kind is DataKind.TEXT]
    if texts and model.vocab < BYTE_VOCAB:
        return f"byte-level text needs vocab >= {BYTE_VOCAB}, not {model.vocab}"
    return None

