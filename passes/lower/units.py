"""Split a rank's instructions into units, one per compute op.

A unit is the compute op with the non-compute instructions just before it
(loads, waits); instructions after the last compute op form a final unit
without compute. Passes that place work "one compute op ahead" walk units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetc.ir.program import COMPUTE_TYPES, Instr

__all__ = ["Unit", "split_units"]


@dataclass
class Unit:
    instrs: list[Instr] = field(default_factory=list)

    @property
    def compute(self) -> list[Instr]:
        return [i for i in self.instrs if isinstance(i, COMPUTE_TYPES)]


def split_units(instrs: tuple[Instr, ...] | list[Instr]) -> list[Unit]:
    units: list[Unit] = []
    current = Unit()
    for instr in instrs:
        current.instrs.append(instr)
        if isinstance(instr, COMPUTE_TYPES):
            units.append(current)
            current = Unit()
    if current.instrs:
        units.append(current)
    return units
