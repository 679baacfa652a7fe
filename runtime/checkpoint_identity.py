"""What a checkpoint is of (model, optimizer, data), written at save and compared on resume.

Note [What a checkpoint is of]
Resuming continues a run: the same model, the same optimizer state and the
same data stream (the data source is a function of (step, microbatch) and
the seed, Note [Checkpoint layout]). A checkpoint holds model.het (the model
block, whose `optimizer` block says which optimizer the saved state belongs
to) and data.json (the training data's kind, file, dtype, seq, seed and
shuffle); `check_resumable` compares them with the run's spec, and any
difference is a CheckpointError that names the field and both values:

- the architecture: every model field that is not a training field
  (hetc/hf/config.py TRAINING_FIELDS: name, dtype, seq, activation_checkpoint,
  ...), nested blocks (moe, rope_scaling) field by field. Tensor sizes alone
  cannot tell 4 layers from 3 of another grouping, or 4 heads of which 2 kv
  from 2 of which 1: the same bytes, another model;
- the optimizer kind (AdamW's moments mean nothing to SGD, which dropped
  them), and for SGD whether it has a momentum buffer;
- the data: another file (by name and size, not by directory: a plan
  directory copied to another machine reads its own copy), dtype, seq,
  seed or shuffle gives other batches from the resumed step on.

`--load-weights-only` (fine-tuning) takes only the weights: the architecture
must still match, the optimizer and the data may differ.
A checkpoint saved before a file existed skips that comparison.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hetc.hf.config import TRAINING_FIELDS
from hetc.runtime.checkpoint_files import CheckpointError
from hetc.ir.spec import DataFileSpec, DataKind, ModelSpec, Node, OptimizerKind, TrainSpec

__all__ = ["DATA_FILE", "check_resumable", "data_identity", "model_differences", "write_data_identity"]

DATA_FILE = "data.json"
# model fields that are derived when left out: compare what they mean, not whether they were written
_DERIVED = {"kv_heads": "num_kv_heads", "head_dim": "head_size"}


def data_identity(model: ModelSpec, train: TrainSpec) -> dict[str, Any]:
    """What decides the token stream: data kind, file (path and size), dtype, seq, seed, shuffle; a blend's
    sources each with its weight."""
    data = train.data
    identity = {**_file_identity(data), "seq": model.seq, "seed": train.seed}
    if data.kind is DataKind.BLEND:
        identity["sources"] = [{**_file_identity(s), "weight": s.weight} for s in data.sources]
    return identity


def _file_identity(data: DataFileSpec) -> dict[str, Any]:
    path = data.resolve() if data.kind in (DataKind.TEXT, DataKind.TOKENS) else None
    size = path.stat().st_size if path is not None and path.is_file() else None
    return {"kind": data.kind.value, "path": str(path.resolve()) if path is not None else "", "bytes": size,
            "dtype": data.dtype.value if data.dtype is not None else None, "shuffle": data.shuffle}


def write_data_identity(model: ModelSpec, train: TrainSpec, directory: Path) -> None:
    (directory / DATA_FILE).write_text(json.dumps(data_identity(model, train), indent=1) + "\n")


def check_resumable(checkpoint: Path, model: ModelSpec, train: TrainSpec, weights_only: bool = False) -> None:
    """Raise CheckpointError when `checkpoint` is not of `spec`'s model (and, unless `weights_only`, its
    optimizer and data); see Note [What a checkpoint is of]."""
    from hetc.runtime.checkpoint import MODEL_FILE

    card = checkpoint / MODEL_FILE
    if card.is_file():
        saved = _saved_model(card)
        _refuse(card, "another model", model_differences(saved, model),
                "resume a checkpoint of this model, or save this run into another --checkpoint directory")
        if not weights_only:
            _refuse(card, "another optimizer", _optimizer_differences(saved, model),
                    f"to keep only its weights, start with --load-weights-only {checkpoint}")
    data_file = checkpoint / DATA_FILE
    if data_file.is_file() and not weights_only:
        _refuse(data_file, "other data", _data_differences(_saved_data(data_file), data_identity(model, train)),
                f"to train its weights on this data, start with --load-weights-only {checkpoint}")


def model_differences(saved: ModelSpec | Node, now: ModelSpec | Node, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(field, saved value, this value) for every architecture field that differs; nested blocks field by
    field (`moe.experts`)."""
    diffs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(saved):
        if f.name in ("span", "spans") or f.name in TRAINING_FIELDS:
            continue
        a, b = (getattr(m, _DERIVED.get(f.name, f.name)) for m in (saved, now))
        if isinstance(a, Node) and isinstance(b, Node) and type(a) is type(b):
            diffs += model_differences(a, b, f"{prefix}{f.name}.")
        elif a != b:
            diffs.append((prefix + f.name, a, b))
    return diffs


def _optimizer_differences(saved: ModelSpec, now: ModelSpec) -> list[tuple[str, Any, Any]]:
    a, b = saved.optimizer, now.optimizer
    if a.kind != b.kind:
        return [("optimizer", a.kind, b.kind)]
    if a.kind is OptimizerKind.SGD and bool(a.momentum) != bool(b.momentum):
        return [("optimizer.momentum", a.momentum, b.momentum)]     # a momentum buffer, or none
    return []


def _data_differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    diffs: list[tuple[str, Any, Any]] = [(prefix + key, saved.get(key), now[key]) for key in
                                         ("kind", "dtype", "seq", "seed", "shuffle", "weight")
                                         if key in saved and key in now and saved[key] != now[key]]
    if not _same_file(saved, now):
        diffs.append((prefix + "path", _file(saved), _file(now)))
    theirs, ours = saved.get("sources") or [], now.get("sources") or []
    if len(theirs) != len(ours):
        return diffs + [(prefix + "sources", f"{len(theirs)} sources", f"{len(ours)} sources")]
    for i, (a, b) in enumerate(zip(theirs, ours)):
        diffs += _data_differences(a, b, f"{prefix}sources[{i}].")
    return diffs


def _same_file(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """The same file name and size: see Note [What a checkpoint is of] for why not the same directory."""
    if Path(saved.get("path") or "").name != Path(now["path"]).name:
        return False
    return None in (saved.get("bytes"), now["bytes"]) or saved.get("bytes") == now["bytes"]


def _file(identity: dict[str, Any]) -> str:
    return f"{identity.get('path')} ({identity.get('bytes')} bytes)"


def _refuse(where: Path, what: str, diffs: list[tuple[str, Any, Any]], hint: str) -> None:
    if not diffs:
        return
    listed = "; ".join(f"{name} is {_shown(a)} there, {_shown(b)} in this run" for name, a, b in diffs)
    raise CheckpointError(f"{where.parent} is a checkpoint of {what}: {listed}; {hint}", where)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, Node):
        return f"a {type(value).__name__.removesuffix('Spec').lower()} block"
    return str(getattr(value, "value", value))


def _saved_model(card: Path) -> ModelSpec:
    from hetc.hf.config import HfError
    from hetc.runtime.hf_export import read_checkpoint_model

    try:
        return read_checkpoint_model(card.parent)[0]
    except HfError as err:
        raise CheckpointError(str(err), card) from None


def _saved_data(path: Path) -> dict[str, Any]:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"unreadable ({err})", path) from None
    if not isinstance(saved, dict):
        raise CheckpointError("unreadable (not a JSON object)", path)
    return saved
