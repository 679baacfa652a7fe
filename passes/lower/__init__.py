"""Lowering: an explicit Spec becomes one instruction program per rank.

The passes run in a fixed, named order (`PASSES`); each is a pure function
of the program so far and the plan. `lower(..., dump_after=NAME)` hands the
program after pass NAME to a callback (`hetc compile --dump-after NAME`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hetc.passes.cost import CostModel
from hetc.passes.lower.context import LowerContext
from hetc.passes.lower.finish import report_loss
from hetc.passes.lower.offload import insert_offload
from hetc.passes.lower.p2p import insert_p2p
from hetc.passes.lower.schedule import order_compute
from hetc.passes.lower.zero import insert_zero
from hetc.ir.plan import Plan
from hetc.ir.program import Program

__all__ = ["PASSES", "PASS_NAMES", "lower"]

# (name, what it does) in order; `schedule` builds the program, the rest rewrite it
# (the first takes the context, the others the program so far and the context)
PASSES: list[tuple[str, str, Callable[..., Program]]] = [
    ("schedule", "compute order per rank for the schedule kind", order_compute),
    ("p2p", "sends and receives around compute, asynchronous", insert_p2p),
    ("zero", "ZeRO gathers, reductions, optimizer steps, clipping", insert_zero),
    ("offload", "host offload and prefetch of parameters and activations", insert_offload),
    ("finish", "loss reporting", report_loss),
]
PASS_NAMES = [name for name, _, _ in PASSES]


def lower(plan: Plan, dump_after: str | None = None,
          on_dump: Callable[[str, Program], None] | None = None, costs: CostModel | None = None,
          ranks: Sequence[int] | None = None) -> Program:
    """`costs`: the cost model that times the schedule (Note [in-flight limit]); the catalog's by default.

    `ranks`: build only these ranks' programs, in this order (`Program.ranks` then holds them alone, not
    indexed by rank: the verifier's check by lane position reads it, Note [checking one lane position] in
    passes/verify/positions.py). Each pass builds a rank's program from its own place in the plan and, for
    its receives, from the programs of the ranks sending to it, so `ranks` must hold every rank that sends
    to one of them; the schedule pass is made for every lane (the lanes' timing couples them)."""
    ctx = LowerContext(plan, costs)
    program: Program | None = None
    for name, _, fn in PASSES:
        program = fn(ctx) if program is None else fn(program, ctx)
        if ranks is not None and name == PASS_NAMES[0]:
            program = Program(tuple(program.ranks[r] for r in ranks), program.groups)
        if on_dump is not None and dump_after in (name, "all"):
            on_dump(name, program)
    assert program is not None
    return program
