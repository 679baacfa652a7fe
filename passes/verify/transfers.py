"""Every send and receive moves the tensor the plan gives that transfer: its peer, shape and tokens.

Note [transfers against the plan]: a plan directory is read back as two
things, plan.het (which builds the model, the data and the process groups on
every rank) and the listings (what each rank does). Both may be edited by
hand: a listing to change a schedule, plan.het to ask "does it fit a smaller
device?" or to change a learning rate. The listings spell out one fact the
plan also decides, the boundary tensors on the wire: `shape=2x32x64` is
micro_batch × tokens × hidden. When the two disagree (a `hidden` edited in
plan.het, a shape edited in both a send and its receive, so that they still
match each other), the sender's tensor is not the size the receiver posted
and gloo aborts the whole job (exit 134) or NCCL corrupts memory, after
every rank started.

Two ways to catch it before launch: hash plan.het at compile and refuse any
edit, or check the programs against the plan. The hash is simpler but wrong
twice over: it refuses the edits that are fine (a device's memory, which
`hetc verify` then re-checks; lr; steps; a data path) and misses the
listing edit that is not. The check is the real one, and small: the
lowering's own `LowerContext.messages` (one implementation of which tokens
go where, Note in passes/lower/context.py) names each transfer of
(tensor, ministage, microbatch) with its ranks, shape and tokens; a send or
receive whose (peer, shape, tokens) is not one of them is a finding at that
instruction. Everything else plan.het decides is built from plan.het on
every rank alike, so it cannot disagree with itself. The plan directory
still records every file's sha256 (hetc/ir/outdir.py), and `hetc verify` names
the files changed since compile when a check fails.
"""

from __future__ import annotations

from hetc.passes.lower.context import LowerContext
from hetc.passes.verify.errors import Finding, at
from hetc.ir.pipeline import Pipeline
from hetc.ir.program import Program, Recv, Send, Tensor
from hetc.ir.plan import Plan

__all__ = ["check_transfers"]

Transfer = tuple[int, int, tuple[int, ...], tuple[int, int] | None]   # src, dst, shape, seq

def check_transfers(program: Program, plan: Plan) -> list[Finding]:
    """The first send or receive whose peer, shape or tokens are not a transfer of the plan, with a count
    of the others (one edit of plan.het makes most of them wrong at once); empty when all agree."""
    pipeline = plan.pipeline
    transfers = _PlannedTransfers(LowerContext(plan))
    wrong: list[tuple[int, int, str]] = []
    for rp in program.ranks:
        for index, instr in enumerate(rp.instrs):
            if not isinstance(instr, (Send, Recv)) or not _known(instr, pipeline):
                continue   # the dataflow check reports a ministage or microbatch out of range
            src, dst = (rp.rank, instr.peer_to) if isinstance(instr, Send) else (instr.peer_from, rp.rank)
            planned = transfers.between(instr.what, instr.ms, instr.mb)
            if (src, dst, instr.shape, instr.seq) not in planned:
                shapes = [shape for (s, d, shape, _) in planned if (s, d) == (src, dst)]
                wrong.append((rp.rank, index, _mismatch(instr.shape, shapes)))
    if not wrong:
        return []
    rank, index, message = wrong[0]
    others = f"; {len(wrong) - 1} more sends and receives disagree" if len(wrong) > 1 else ""
    return [at(program, rank, index, message + others)]


class _PlannedTransfers:
    """The plan's transfers as (src, dst, shape, seq), once per pair of lanes: every microbatch a lane pair
    carries moves the same tensors (a 128-rank, 2048-microbatch plan has 74k sends and receives)."""

    def __init__(self, ctx: LowerContext):
        self.ctx = ctx
        self.memo: dict[tuple[Tensor, int, int, int], frozenset[Transfer]] = {}

    def between(self, what: Tensor, ms: int, mb: int) -> frozenset[Transfer]:
        consumer = ms + 1 if what is Tensor.ACT else ms - 1
        key = (what, ms, self.ctx.lane_for(ms, mb).index, self.ctx.lane_for(consumer, mb).index)
        got = self.memo.get(key)
        if got is None:
            got = self.memo[key] = frozenset((m.src, m.dst, m.shape, m.seq) for m in self.ctx.messages(what, ms, mb))
        return got


def _known(instr: Send | Recv, pipeline: Pipeline) -> bool:
    consumer = instr.ms + 1 if instr.what is Tensor.ACT else instr.ms - 1
    return all(0 <= ms < len(pipeline.ministages) for ms in (instr.ms, consumer)) and \
        0 <= instr.mb < pipeline.num_microbatches


def _mismatch(shape: tuple[int, ...], planned: list[tuple[int, ...]]) -> str:
    def dims(s: tuple[int, ...]) -> str:
        return "x".join(map(str, s))

    said = (f"the plan moves this tensor as {' or '.join(sorted({dims(s) for s in planned}))} "
            f"(micro_batch x tokens x hidden), not {dims(shape)}" if planned
            else "the plan has no such transfer between these ranks")
    return (f"{said}: plan.het and the programs disagree (was plan.het edited since `hetc compile`? "
            "compile the spec again)")
