"""The sum of a tied embedding's copies: the handler of `all_reduce tied`.

Note [tied gradients] in hetc/ir/program.py says when it runs, Note [tied
copies] in runtime/nn/model.py why there are copies. Megatron sums the
embedding's and the head's gradients after its data-parallel reduction
(`_allreduce_embedding_grads`); so does hetc, on what the ZeRO reductions
left, which is a shard at levels 1-3:

- each rank holding a copy adds, into one zeroed V×H tensor, the reduced
  gradient of the elements of its copy that it alone counts (its
  `unique_range`, the elements the gradient norm and checkpoints take from
  it: every element of each copy is counted by exactly one replica; a tp
  rank other than 0 counts none of a matrix every tp rank holds whole);
- the tensor is all-reduced over the group of every rank holding a copy,
  giving the gradient of the whole tied matrix;
- each rank puts it into the reduced gradient its step reads (`opt_range`),
  in the embedding's copy and the head's alike.

So both copies, whatever their ZeRO level, lanes, units or tensor
parallelism, take the update a model holding the matrix once takes, and
stay equal. The tensor is V·H elements in the dtype gradients are reduced
in: `CostModel.tied_bytes`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hetc.ir.errors import InternalError
from hetc.runtime.buffers import MinistageBuffers
from hetc.runtime.flat import FlatEntry
from hetc.runtime.nn.model import TIED_WEIGHT
from hetc.runtime.unit_buffers import Buffers

__all__ = ["TiedCopy", "put_tied_sum", "tied_copy", "tied_share"]

TiedCopy = tuple[MinistageBuffers, FlatEntry]   # the flat buffer holding a copy, and the copy's place in it


def tied_copy(buffers: Buffers) -> TiedCopy:
    """The copy of the tied matrix that a ministage's buffers hold (in whichever unit holds it)."""
    for part in buffers.parts():
        for entry in part.layout.entries:
            if entry.name in (TIED_WEIGHT, part.tied_copy):
                return part, entry
    raise InternalError("`all_reduce tied` on a ministage holding no copy of the tied embedding")


def tied_share(copy: TiedCopy) -> Tensor:
    """The V·H tensor holding this rank's count of its copy's reduced gradient, zero elsewhere."""
    part, entry = copy
    reduced, base = part.reduced_grad(), part.opt_range.start
    share = torch.zeros(entry.numel, dtype=reduced.dtype, device=reduced.device)
    a, b = entry.overlap(part.unique_range)
    if a < b and part.writes_replicated:      # the matrix is whole on every tp rank: tp rank 0 counts it
        share[a - entry.offset:b - entry.offset] = reduced[a - base:b - base]
    return share


def put_tied_sum(copy: TiedCopy, total: Tensor) -> None:
    """Put the summed gradient of the tied matrix into the reduced gradient this rank's step reads."""
    part, entry = copy
    reduced, base = part.reduced_grad(), part.opt_range.start
    a, b = entry.overlap(part.opt_range)
    if a < b:
        reduced[a - base:b - base] = total[a - entry.offset:b - entry.offset]
