"""The units a ZeRO-3 stage gathers: one block each (FSDP's unit), or its ministages whole.

Note [zero-3 units] — FSDP wraps every transformer block in a unit of its
own: forward gathers block i's parameters (the next block's gather posted
while block i computes: at most two blocks whole at once), frees them
after use; backward gathers again in reverse, reduce-scatters each block's
gradients as soon as they are ready, and frees. A ZeRO-3 stage under a
per-microbatch schedule does the same with the layers of each ministage
(embedding, blocks, head: one unit each), so its memory beyond its shards
is two layers' parameters, not a ministage's. Ministages stay the way to
gather larger units, and these keep one unit per ministage:

- Zorse gathers once per ministage sweep (its ministages *are* its units);
- zero-bubble defers each weight gradient (`bwd_w`) past other ops;
- offloaded parameters or activations move ministage by ministage;
- expert parallelism keeps a second buffer per ministage;
- tied embeddings share one tensor between the embedding and the head;
- a ministage of one layer is one unit already.

Lowering (passes/lower/zero.py) emits the units, the runtime keeps one
flat buffer per unit, and the cost model's memory counts the same window.
"""

from __future__ import annotations

from hetc.ir.program import Unit
from hetc.ir.spec import ModelSpec, OffloadSpec, OffloadTarget, ScheduleKind, ZeroSpec

__all__ = ["gathers_per_block", "in_run_order", "ministage_units"]


def gathers_per_block(schedule: ScheduleKind, zero: ZeroSpec, offload: OffloadSpec, ep: int) -> bool:
    """Whether a stage with a ZeRO group gathers per block (Note [zero-3 units])."""
    moves = offload.params is not OffloadTarget.NONE or offload.activations is not OffloadTarget.NONE
    return zero.resolved_level == 3 and schedule not in (ScheduleKind.ZORSE, ScheduleKind.ZB) and \
        not moves and ep == 1


def ministage_units(model: ModelSpec, layers: range, per_block: bool) -> tuple[Unit, ...]:
    """The units of a ministage of `layers`: one per layer when gathering per block, else none (the
    ministage is its own unit)."""
    tied = model.tied_embeddings and 0 in layers and model.num_model_layers - 1 in layers
    if not per_block or len(layers) < 2 or tied:
        return ()
    return tuple(Unit(i, i + 1) for i in layers)


def in_run_order(units: tuple[Unit, ...], forward: bool) -> tuple[Unit, ...]:
    """The order one compute op runs a ministage's units: forward in layer order, backward in reverse (so
    its first unit is the last a backward finishes and reduces)."""
    return units if forward else units[::-1]
