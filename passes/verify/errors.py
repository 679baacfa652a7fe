"""Verifier errors: they name the rank, the instruction index and its text."""

from __future__ import annotations

from hetc.ir.program import Program

__all__ = ["Finding", "VerifyError"]


class Finding:
    """One problem at one instruction of one rank."""

    def __init__(self, rank: int, index: int, text: str, message: str):
        self.rank, self.index, self.text, self.message = rank, index, text, message

    def __str__(self) -> str:
        where = f"rank {self.rank}, instruction {self.index}" if self.index >= 0 else f"rank {self.rank}"
        shown = f" `{self.text}`" if self.text else ""
        return f"{where}{shown}: {self.message}"


class VerifyError(Exception):
    """The programs are unsafe; `findings` says where, `grid` shows the ranks involved."""

    def __init__(self, findings: list[Finding], grid: str = "", check: str = ""):
        self.findings = findings
        self.grid = grid
        self.check = check          # the failing check: dataflow, protocol, transfers, memory (or "" for the plan's shape)
        super().__init__("\n".join(str(f) for f in findings))

    @property
    def rank(self) -> int:
        return self.findings[0].rank

    @property
    def index(self) -> int:
        return self.findings[0].index

    def render(self) -> str:
        body = "\n".join(f"error: {f}" for f in self.findings)
        return body + ("\n\n" + self.grid if self.grid else "")


def at(program: Program, rank: int, index: int, message: str) -> Finding:
    instrs = program.ranks[rank].instrs
    text = str(instrs[index]) if 0 <= index < len(instrs) else ""
    return Finding(rank, index, text, message)
