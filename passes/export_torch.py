"""Export lane-aligned pipelines in torch.distributed.pipelining's action format.

A plan is *lane-aligned* when every stage has the same lanes, each serving
the same microbatches; then lane l of every stage forms one ordinary
pipeline, which torch's `compute_comms` CSV can describe: one row per
pipeline rank, cells such as `0F1`, `1SEND_F0`, `2RECV_B3`. torch stage
indices are our ministage indices; microbatches are renumbered within the
lane. A receive is written where the program waits for it (torch's actions
block there), a send where it is posted. Plans whose lanes do not line up
(Zorse's many-to-many pipelines) have no torch equivalent and export nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetc.ir.pipeline import Pipeline, Stage
from hetc.ir.program import (PHASE_OF, Backward, BackwardInput, BackwardWeight, Forward, Instr, Program, Recv, Send,
                          Tensor, Wait)

__all__ = ["TorchPipeline", "lanes_aligned", "torch_pipelines", "why_not_exported"]


@dataclass
class TorchPipeline:
    """One exported pipeline: rows of action strings, and what torch needs to check them."""

    name: str
    rows: list[list[str]]
    num_stages: int
    num_microbatches: int
    stage_to_rank: dict[int, int]

    def csv(self) -> str:
        return "".join(",".join(row) + "\n" for row in self.rows)


def lanes_aligned(pipeline: Pipeline) -> bool:
    first = pipeline.stages[0]
    routes = [lane.microbatches for lane in first.lanes]
    return all([lane.microbatches for lane in s.lanes] == routes for s in pipeline.stages)


def why_not_exported(pipeline: Pipeline) -> str | None:
    """Why `torch_pipelines` writes nothing for `pipeline` (None when it exports every lane)."""
    if lanes_aligned(pipeline):
        return None
    first = pipeline.stages[0]
    odd = next(s for s in pipeline.stages
               if [lane.microbatches for lane in s.lanes] != [lane.microbatches for lane in first.lanes])
    def lanes(stage: Stage) -> str:
        return f"{len(stage.lanes)} lane{'s' if len(stage.lanes) > 1 else ''}"

    why = (f"stage '{first.name}' has {lanes(first)} and stage '{odd.name}' {lanes(odd)}"
           if len(odd.lanes) != len(first.lanes) else
           f"the lanes of stages '{first.name}' and '{odd.name}' serve different microbatches")
    return f"{why}: a many-to-many pipeline, which torch's action format cannot describe"


def torch_pipelines(program: Program, pipeline: Pipeline) -> list[TorchPipeline]:
    if not lanes_aligned(pipeline):
        return []
    stage_to_rank = {m.index: m.stage for m in pipeline.ministages}
    out = []
    for lane_idx, lane in enumerate(pipeline.stages[0].lanes):
        local = {mb: i for i, mb in enumerate(lane.microbatches)}
        rows = [_actions(program.ranks[stage.lanes[lane_idx].ranks[0]].instrs, local, pipeline)
                for stage in pipeline.stages]
        out.append(TorchPipeline(f"lane{lane_idx}", rows, len(pipeline.ministages), len(local), stage_to_rank))
    return out


def _completes(instr: Forward | Backward | BackwardInput | BackwardWeight, pipeline: Pipeline) -> bool:
    """Whether the op finishes its ministage's pass: torch's action is the ministage's, and a ZeRO-3
    ministage split into units (Note [units] in hetc/ir/program.py) runs it as one op per unit."""
    if instr.unit is None:
        return True
    m = pipeline.ministages[instr.ms]
    return instr.unit.stop == m.stop_layer if isinstance(instr, Forward) else instr.unit.first == m.first_layer


def _actions(instrs: Sequence[Instr], local: dict[int, int], pipeline: Pipeline) -> list[str]:
    pending: dict[int, Recv] = {}
    actions = []
    for instr in instrs:
        if isinstance(instr, Recv):
            if instr.handle is None:
                actions.append(_recv(instr, local))
            else:
                pending[instr.handle] = instr
        elif isinstance(instr, Wait) and instr.handle in pending:
            actions.append(_recv(pending.pop(instr.handle), local))
        elif isinstance(instr, Send):
            kind = "SEND_F" if instr.what is Tensor.ACT else "SEND_B"
            actions.append(f"{instr.ms}{kind}{local[instr.mb]}")
        elif isinstance(instr, (Forward, Backward, BackwardInput, BackwardWeight)) and _completes(instr, pipeline):
            actions.append(f"{instr.ms}{PHASE_OF[type(instr)]}{local[instr.mb]}")
    return actions


def _recv(instr: Recv, local: dict[int, int]) -> str:
    # torch names a receive by the stage that consumes it
    if instr.what is Tensor.ACT:
        return f"{instr.ms + 1}RECV_F{local[instr.mb]}"
    return f"{instr.ms - 1}RECV_B{local[instr.mb]}"
