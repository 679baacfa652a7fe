"""Optimizer and parameter offload hold on the device what the memory verifier counts (Note [optimizer
offload] in runtime/buffers.py); that they train to the 1-rank numbers is the plan-invariance test's
(offload_opt, zero3_offload).

The meta device stands in for the GPU: every allocation a rank makes on its device lands there and
holds no memory, so a rank of a plan can be built whole and its placement read off its tensors.
"""

from __future__ import annotations

import pytest
import torch

from hetc.passes.cost import CostModel
from hetc.passes.verify.memory import rank_peaks
from hetc.runtime.buffers import MinistageBuffers
from hetc.runtime.setup import build_buffers
from tests.conftest import DEMO
from tests.plans import compile_plan

META = torch.device("meta")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _optimizer_parts(buf: MinistageBuffers) -> list[torch.Tensor]:
    """The tensors of the optimizer part: the state, and the master where it is not the parameters."""
    return list(buf.opt_state.tensors().values()) + ([] if buf.master_is_params else [buf.master])


def _rank_parts(plan: str, rank: int) -> list[MinistageBuffers]:
    lowered = compile_plan(DEMO / f"{plan}.het")
    buffers = build_buffers(lowered.program, lowered.plan, rank, META, initialise=False)
    return [part for buf in buffers.values() for part in buf.parts()]


@pytest.mark.parametrize("plan", ["pp", "zero2", "offload_opt"])
def test_the_device_holds_the_optimizer_state_the_verifier_counts(plan):
    lowered = compile_plan(DEMO / f"{plan}.het")
    peaks = rank_peaks(lowered.program, lowered.pipeline,
                       CostModel(lowered.plan))
    for rank, peak in enumerate(peaks):
        tensors = [t for part in _rank_parts(plan, rank) for t in _optimizer_parts(part)]
        on_device = sum(_nbytes(t) for t in tensors if t.device == META)
        assert on_device == pytest.approx(peak.parts["optimizer"], rel=1e-3), f"rank {rank}"
        if plan == "offload_opt":
            assert on_device == 0 and all(t.device.type == "cpu" for t in tensors)


def test_offloaded_optimizer_state_and_its_step_live_on_the_host():
    for part in _rank_parts("offload_opt", 0):
        assert part.state_device.type == "cpu" and part.master.device.type == "cpu"
        assert not part.master_is_params     # the fp32 parameters stay on the device; the host steps its own copy


def test_offloaded_fp32_parameters_are_their_own_master_as_counted():
    """Parameter offload of an fp32 model keeps no master copy on the device: the master is a view of the
    parameters (the memory model counts none), and between steps their host copy holds it."""
    lowered = compile_plan(DEMO / "zero3_offload.het")
    buffers = build_buffers(lowered.program, lowered.plan, 0, torch.device("cpu"))
    for buf in buffers.values():
        for part in buf.parts():
            assert part.master_is_params
            assert part.master._base is part.resident()
            assert torch.equal(part.master_values(), part.host_params[part.opt_range_in_inner()])
