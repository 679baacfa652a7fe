"""The files of a Hugging Face model directory: what hetc reads there and what an export writes."""

from __future__ import annotations

from pathlib import Path

from hetc.hf.config import CONFIG_FILE
from hetc.hf.weights import INDEX_FILE

__all__ = ["GENERATION_CONFIG_FILE", "TOKENIZER_FILES", "model_files"]

GENERATION_CONFIG_FILE = "generation_config.json"
# What transformers' tokenizers save (save_pretrained of a fast or slow tokenizer, sentencepiece or BPE)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")


def model_files(directory: Path) -> list[Path]:
    """The files of `directory` a model or tokenizer is read from (config, weights, tokenizer), as they are
    now: what an output must not replace (Note [output files] in hetc/ir/outdir.py)."""
    named = [directory / name for name in (CONFIG_FILE, INDEX_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES)]
    return [p for p in named if p.is_file()] + sorted(directory.glob("*.safetensors"))
