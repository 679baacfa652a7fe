"""Hugging Face safetensors as the initial weights of a rank: only the slices it owns.

A rank's state is its ministages' flat buffers (runtime/buffers.py); each
says which elements it keeps parameters of (`param_range`: the inner ZeRO
shard at ZeRO-3, else all) and which tensor-parallel slice and which
experts its module holds (`infos`, the expert buffer). The loader walks the
flat layout over that range and reads, for every parameter it touches, only
the rows of the rank's own slice that fall in the range, through
safetensors' lazy `get_slice` (hetc/hf/weights.py). What it materialises at
once is the range (the rank's own shard) plus one such read, at most one
tensor — never the whole model. `load_params` then fills the master, the
compute copy or ZeRO-3 shard and the host copy, as a checkpoint load does
(Note [Checkpoint layout]).

The buffers it fills were built without values (Note [Ranks that load
their weights] in runtime/buffers.py): the rank never held random weights
of the whole ministage first, so its peak host memory is its own state plus
the range and one read (tests/test_hf.py measures it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from hetc.ir.errors import InternalError
from hetc.hf.names import hf_name
from hetc.hf.weights import WeightReader
from hetc.runtime.flat import FlatLayout
from hetc.runtime.nn.tensor_parallel import ShardInfo
from hetc.runtime.unit_buffers import Buffers

__all__ = ["LoadStats", "load_hf_weights", "load_whole", "read_flat"]


@dataclass
class LoadStats:
    """What a load materialised on this rank, in bytes."""

    kept: int = 0         # the largest range filled at once (the rank's own share of one buffer)
    peak: int = 0         # the most held at once: a range being filled plus the slice being read
    read: int = 0         # every slice read, summed


def load_hf_weights(buffers: dict[int, Buffers], directory: Path) -> LoadStats:
    """Fill every buffer of this rank from the safetensors in `directory`."""
    stats, reader = LoadStats(), WeightReader(directory)
    for whole in buffers.values():
        for buf in whole.parts():
            rng = buf.param_range     # the values are freed once loaded: a rank holds one buffer's at a time
            buf.load_params(read_flat(reader, buf.layout, buf.infos, rng, stats, buf.stored_name), rng)
    return stats


def load_whole(layout: FlatLayout, infos: dict[str, ShardInfo], directory: Path) -> Tensor:
    """The whole fp32 flat buffer `layout` describes (one process holding the model: the reference)."""
    return read_flat(WeightReader(directory), layout, infos, slice(0, layout.padded_numel))


def read_flat(reader: WeightReader, layout: FlatLayout, infos: dict[str, ShardInfo], rng: slice,
              stats: LoadStats | None = None, stored_name: Callable[[str], str] = str) -> Tensor:
    """Elements `rng` of the fp32 flat buffer `layout` describes, from the Hugging Face tensors; each
    parameter read under `stored_name(name)` (a tied copy under the embedding's name)."""
    stats = stats if stats is not None else LoadStats()
    out = torch.zeros(rng.stop - rng.start, dtype=torch.float32)     # padding stays zero
    own = out.numel() * out.element_size()
    stats.kept = max(stats.kept, own)
    for e, start, stop in layout.overlaps(rng):
        a, b = start - e.offset, stop - e.offset            # within the local parameter, flattened
        row = math.prod(e.shape[1:])
        first, last = a // row, -(-b // row)
        piece = reader.read(hf_name(stored_name(e.name)), _full_index(infos[e.name], e.shape, first, last)).reshape(-1)
        nbytes = piece.numel() * piece.element_size()
        stats.peak, stats.read = max(stats.peak, own + nbytes), stats.read + nbytes
        out[start - rng.start:stop - rng.start] = piece[a - first * row:b - first * row]
    return out


def _full_index(info: ShardInfo, local: tuple[int, ...], first: int, last: int) -> list[slice]:
    """Rows first..last-1 of this rank's slice (local shape `local`), as an index into the full tensor."""
    if info.dim is None:
        return [slice(first, last)]
    offset = info.shard.rank * local[info.dim]
    if info.dim == 0:
        return [slice(offset + first, offset + last)]
    if info.dim != 1:
        raise InternalError(f"a tensor-parallel split along dim {info.dim}")
    return [slice(first, last), slice(offset, offset + local[1])]
