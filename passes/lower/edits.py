"""Insertions into an instruction list, and handle numbering, for lowering passes.

Passes decide positions against the list they were given, then apply all
insertions at once, so no pass has to track shifting indices.

What a pass puts *after* an instruction goes after the sends that directly
follow it: a compute op's output is posted to its consumer first (Note [p2p
placement]), so a blocking wait or a step placed after the op never holds
back the next stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetc.ir.program import Instr, Send

__all__ = ["Edits", "Handles"]


@dataclass
class Edits:
    """Instructions to put before / after positions of the original list, and at its end."""

    before: dict[int, list[Instr]] = field(default_factory=dict)
    after: dict[int, list[Instr]] = field(default_factory=dict)
    first_after: dict[int, list[Instr]] = field(default_factory=dict)   # ahead of `after` at the same place
    end: list[Instr] = field(default_factory=list)

    def add_before(self, i: int, instr: Instr) -> None:
        self.before.setdefault(i, []).append(instr)

    def add_after(self, i: int, instr: Instr, first: bool = False) -> None:
        (self.first_after if first else self.after).setdefault(i, []).append(instr)

    def apply(self, instrs: tuple[Instr, ...]) -> tuple[Instr, ...]:
        out: list[Instr] = []
        held: list[Instr] = []     # after-insertions waiting for the sends that follow their instruction
        for i, instr in enumerate(instrs):
            if held and not isinstance(instr, Send):
                out += held
                held = []
            out += self.before.get(i, [])
            out.append(instr)
            held += self.first_after.get(i, []) + self.after.get(i, [])
        return tuple(out + held + self.end)


class Handles:
    """Hands out a rank's async handle numbers."""

    def __init__(self, start: int):
        self.next = start

    def take(self) -> int:
        self.next += 1
        return self.next - 1
