"""The buffers of a ZeRO-3 ministage split into units: one flat buffer per unit.

A ministage whose shard line lists `units` (Note [units] in hetc/ir/program.py;
Note [zero-3 units] in passes/cost/zero_units.py says which) is built as one
module per unit, each holding that unit's layers, each with buffers of its
own (`MinistageBuffers`, sharded over the ministage's group like a
ministage's). A gather, free or reduce-scatter naming a unit acts on that
unit's buffers alone, so a rank holds the full parameters of the units it
computes, not of the ministage. Whatever acts on all of a ministage's state
(the optimizer step, the gradient norm, checkpoints, loaders) walks `parts`.
"""

from __future__ import annotations

from hetc.ir.errors import InternalError
from hetc.ir.program import Shard, Unit
from hetc.runtime.buffers import MinistageBuffers

__all__ = ["Buffers", "UnitBuffers"]


class UnitBuffers:
    def __init__(self, shard: Shard, units: dict[Unit, MinistageBuffers]):
        if tuple(units) != shard.units:
            raise InternalError(f"buffers for units {list(units)} of a shard of units {list(shard.units)}")
        self.shard = shard
        self.units = units

    def unit(self, unit: Unit) -> MinistageBuffers:
        got = self.units.get(unit)
        if got is None:
            raise KeyError(f"ministage {self.shard.ms} has no unit {unit}")
        return got

    def parts(self) -> tuple[MinistageBuffers, ...]:
        """Each unit's buffers, in layer order."""
        return tuple(self.units.values())

    def zero_grads(self) -> None:
        for part in self.parts():
            part.zero_grads()


# what a rank keeps per ministage: one set of flat buffers, or one per unit
Buffers = MinistageBuffers | UnitBuffers
