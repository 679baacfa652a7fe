"""Pieces of flattened parameters as DCP chunks: how a flat ZeRO shard is saved and resharded.

A flat shard (runtime/flat.py) covers, for each parameter it touches, one
contiguous range of that parameter *flattened*. `FlatPieces` presents such
ranges of one flattened tensor to torch.distributed.checkpoint as chunks at
their offsets — the `_Checkpointable` protocol DTensor implements
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`),
so DCP's own planners compute which stored chunks overlap which requested
ones. Arbitrary (uneven) offsets are what neither DTensor's even sharding
nor ShardedTensor's non-overlapping global layout can say for reads
(replicas read the same ranges).

Under tensor parallelism a rank holds a slice of each split parameter
(runtime/nn/tensor_parallel.py): the chunks are placed at the slice's offsets in the *full*
flattened parameter (one chunk for a column-parallel slice, one per row for
a row-parallel one), so a checkpoint names full parameters whatever the tp
size; parameters every tp rank holds whole are written by tp rank 0 only.

DCP looks state up as tensors; the two planners below teach it to find a
chunk inside a `FlatPieces` (and skip meta-tensor initialisation, which
does not know the type). The save planner also refuses chunks that two
ranks write: DCP would keep one silently, and DCP's own global check
(chunks neither overlap nor leave holes) then covers the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from hetc.ir.errors import InternalError
from hetc.runtime.flat import FlatLayout
from hetc.runtime.nn.tensor_parallel import ShardInfo

__all__ = ["FlatPieces", "PieceLoadPlanner", "PieceSavePlanner", "layout_pieces", "param_pieces"]


@dataclass(frozen=True)
class FlatPieces:
    """Ranges of one flattened tensor of `numel` elements on this rank: (offset, 1-D view) pairs."""

    numel: int
    chunks: tuple[tuple[int, Tensor], ...]

    def size(self) -> torch.Size:
        """The global size (DCP compares it with the stored one)."""
        return torch.Size([self.numel])

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, (offset,)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(offset, view),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.size()))
                for offset, view in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(offset, view) for offset, view in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        wanted = _offset(index)
        if index.index is not None and index.index < len(self.chunks) \
                and (self.chunks[index.index][0],) == wanted:
            return self.chunks[index.index][1]
        for offset, view in self.chunks:
            if (offset,) == wanted:
                return view
        raise ValueError(f"{index.fqn}: no piece at offset {wanted}")


def _offset(index: MetadataIndex) -> tuple[int, ...]:
    """The offset a shard's index names (DCP gives one for every SHARD item)."""
    if index.offset is None:
        raise ValueError(f"{index.fqn}: a piece's index names no offset")
    return tuple(index.offset)


def _chunk(offset: int, view: Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([view.numel()]))


def layout_pieces(layout: FlatLayout, rng: slice, values: Tensor,
                  infos: dict[str, ShardInfo] | None = None) -> dict[str, FlatPieces]:
    """The parameters inside elements `rng` of a flat buffer laid out by `layout`, by name.

    `values` holds elements `rng` (a slice of the master or of an optimizer
    state tensor); each piece is a view into it. Padding belongs to no
    parameter. `infos` (tensor-parallel shards) place the pieces in the full
    parameters.
    """
    if values.numel() != rng.stop - rng.start:
        raise InternalError(f"{values.numel()} values for range {rng}")
    return {e.name: param_pieces(infos.get(e.name) if infos else None, e.shape, start - e.offset,
                                 values[start - rng.start:stop - rng.start])
            for e, start, stop in layout.overlaps(rng)}


def param_pieces(info: ShardInfo | None, shape: tuple[int, ...], start: int, view: Tensor) -> FlatPieces:
    """Elements [start, start + len(view)) of a parameter of local `shape`, as chunks of the full parameter."""
    if info is None or info.dim is None or tuple(info.full_shape) == tuple(shape):
        # not split (tp = 1 included): one chunk, not one per row (each chunk is a file record DCP
        # reads back with its own torch.load, ~2 ms apiece)
        return FlatPieces(math.prod(shape), ((start, view),))
    inner = math.prod(shape[info.dim:])                # a run of the slice along its split dimension
    full_inner = math.prod(info.full_shape[info.dim:])
    chunks, i, stop = [], start, start + view.numel()
    while i < stop:
        outer, j = divmod(i, inner)
        n = min(stop - i, inner - j)
        chunks.append((outer * full_inner + info.shard.rank * inner + j, view[i - start:i - start + n]))
        i += n
    return FlatPieces(math.prod(info.full_shape), tuple(chunks))


def _lookup(state: dict, index: MetadataIndex):
    obj = state[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, FlatPieces) else None


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner for a flat state dict, finding chunks inside `FlatPieces`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        # DCP keeps one copy of chunks several ranks offer at the same offset;
        # for shards that would hide two ranks claiming the same elements.
        owners: dict[MetadataIndex, int] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if item.type is WriteItemType.SHARD and owners.setdefault(item.index, rank) != rank:
                    raise ValueError(f"ranks {owners[item.index]} and {rank} both write {item.index.fqn} at "
                                     f"offset {_offset(item.index)}: replicas must split their shard")
        return super()._dedup_save_plans(all_plans)

    def lookup_object(self, index: MetadataIndex) -> object:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a flat state dict of tensors, `FlatPieces` and plain values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner would first materialise meta tensors and, not knowing
        # FlatPieces, replace them by None; nothing here lives on the meta device.
        self.original_state_dict = self.state_dict = state_dict
        self.mappings = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)
