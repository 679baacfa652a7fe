"""Safetensors weights of a Hugging Face directory: which file holds what, checks, lazy slices.

A directory holds one `model.safetensors`, or shards named by
`model.safetensors.index.json` ("weight_map": tensor -> file), or other
`*.safetensors` files. Checks read only the headers (the format: an 8-byte
little-endian length, then a JSON table of name -> dtype, shape, offsets),
which costs a few kilobytes per file and no torch. Reads go through
safetensors' `safe_open(...).get_slice`, which maps the file and copies out
only the requested index ranges: a rank materialises its own slices, never
a whole tensor it does not own (see runtime/hf_load.py).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetc.hf.config import HfError
from hetc.ir.spec import InitKind, ModelSpec

if TYPE_CHECKING:
    import torch

    from hetc.ir.spec import ModelSpec

__all__ = ["INDEX_FILE", "WeightReader", "expected_shapes", "has_weights", "header_shapes", "hf_has_weights",
           "model_weight_problems", "pretrained_dir", "wants_pretrained", "weight_map", "weight_problems"]

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20      # safetensors' own bound on the JSON header
_NOT_PARAMETERS = (".rotary_emb.inv_freq",)    # buffers some older checkpoints saved beside the weights
# safetensors' dtypes and their bytes per element (the format's specification)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def has_weights(directory: Path) -> bool:
    directory = Path(directory)
    return (directory / INDEX_FILE).is_file() or any(directory.glob("*.safetensors"))


def hf_has_weights(model: ModelSpec) -> bool:
    """Whether the model's `hf` directory holds safetensors."""
    directory = model.hf_dir()
    return directory is not None and has_weights(directory)


def wants_pretrained(model: ModelSpec) -> bool:
    """Whether initial weights come from the hf directory (`init`, or its default)."""
    return model.init is InitKind.PRETRAINED or (model.init is None and hf_has_weights(model))


def pretrained_dir(model: ModelSpec) -> Path | None:
    """The hf directory initial weights come from (`wants_pretrained`); None where they are random."""
    return model.hf_dir() if wants_pretrained(model) else None


def weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it; HfError for a broken index or a missing shard."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise HfError(f"cannot read {index}: {type(err).__name__}: {err}") from None
        if not isinstance(mapping, dict) or not all(isinstance(f, str) and f and Path(f).name == f and f != ".."
                                                    for f in mapping.values()):
            raise HfError(f"{index}: weight_map must map each tensor to the name of a file beside it")
        files = {name: directory / file for name, file in mapping.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise HfError(f"{index.name} names {path.name}, which is not in {directory}")
        return files
    return {name: path for path in sorted(directory.glob("*.safetensors")) for name in _header(path)}


def header_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the headers alone."""
    files = weight_map(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        for name, entry in _header(path).items():
            if files.get(name) == path:
                shapes[name] = tuple(entry["shape"])
    missing = sorted(set(files) - set(shapes))
    if missing:
        raise HfError(f"the index puts {missing[0]} in {files[missing[0]].name}, which does not hold it")
    return shapes


def expected_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors `model` needs, with their shapes (from the runtime's modules)."""
    from hetc.hf.names import hf_name
    from hetc.runtime.nn.model import full_shapes

    return {hf_name(name): shape for name, shape in full_shapes(model).items()}


def model_weight_problems(model: ModelSpec, directory: Path) -> list[str]:
    """What keeps `directory`'s safetensors from being `model`'s weights (empty: nothing), from headers."""
    try:
        return weight_problems(header_shapes(directory), expected_shapes(model))
    except HfError as err:
        return [str(err)]


def weight_problems(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Missing, extra and misshapen tensors (Hugging Face names), as short messages."""
    names = {n for n in found if not n.endswith(_NOT_PARAMETERS)}
    problems = []
    if missing := sorted(set(expected) - names):
        problems.append(f"missing {_some(missing)}")
    if extra := sorted(names - set(expected)):
        problems.append(f"unexpected {_some(extra)}")
    for name in sorted(set(expected) & names):
        if found[name] != expected[name]:
            problems.append(f"{name} has shape {list(found[name])}, the model needs {list(expected[name])}")
    return problems


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{'tensor' if len(names) == 1 else 'tensors'} {shown}{more}"


def _header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (size,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < size <= _MAX_HEADER:
                raise HfError(f"{path} is not a safetensors file")
            table = json.loads(f.read(size))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HfError(f"cannot read the safetensors header of {path}: {err}") from None
    if not isinstance(table, dict):
        raise HfError(f"{path} is not a safetensors file")
    table.pop("__metadata__", None)
    _check_complete(path, table, 8 + size)
    return table


def _check_complete(path: Path, table: dict[str, Any], data_start: int) -> None:
    """Every entry a dtype, a shape and the offsets of exactly its bytes, the tensors back to back, as the
    format specifies and safetensors checks only when a rank reads; and a file cut short (a copy or download
    that stopped) found here, by its size, not by the first read past its end."""
    end = 0
    for name, entry in sorted(table.items(), key=lambda item: _offsets(item[1])):
        if not _well_formed(entry) or entry["data_offsets"][0] != end:
            raise HfError(f"{path} is not a safetensors file: the header's entry for {name!r} is not a dtype, a "
                          "shape and the byte offsets of that tensor, following the one before it")
        end = entry["data_offsets"][1]
    have = path.stat().st_size
    if have < data_start + end:
        raise HfError(f"{path} is cut short: its header places tensor data up to byte {data_start + end}, but it "
                      f"has {have} bytes (copy or download it again)")


def _offsets(entry: Any) -> tuple[int, int]:
    """An entry's data offsets to sort by; a malformed entry sorts first, to be named."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    return (offsets[0], offsets[1]) if ok else (-1, -1)   # type: ignore[index]


def _well_formed(entry: Any) -> bool:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_BYTES:
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets):
        return False
    return bool(offsets[1] - offsets[0] == math.prod(shape) * _DTYPE_BYTES[entry["dtype"]])


class WeightReader:
    """Slices of the tensors of a directory, read lazily, in fp32.

    Each read maps its file and unmaps it once the slice is copied out: the
    file's pages a read touches count in the process's resident memory for
    as long as the file stays mapped, so a reader keeping its files open
    would hold every page it had read (a rank's whole share, a second time)
    until the end of the load.
    """

    def __init__(self, directory: Path) -> None:
        self.files = weight_map(directory)

    def read(self, name: str, index: Iterable[slice]) -> torch.Tensor:
        """Tensor `name`[index] (one slice per leading dimension) as a new fp32 torch tensor."""
        import torch
        from safetensors import safe_open

        path = self.files[name]
        try:
            with safe_open(str(path), framework="pt") as handle:
                piece: torch.Tensor = handle.get_slice(name)[tuple(index)]   # safetensors' slice is untyped
        except Exception as err:  # noqa: BLE001 - SafetensorError has no importable base across versions
            raise HfError(f"cannot read {name} from {path}: {err}") from None
        return piece.to(torch.float32)
