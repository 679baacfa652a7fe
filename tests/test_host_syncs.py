"""No host synchronisation inside a step but those the program names (issue 29: finding 2 and item 5, finding 6).

A step reads device values on the host twice at most: the loss, where its all-reduce is waited, and the
gradient norm, where its all-reduce is waited (when clipping). The CPU tests run a step of a 1-rank demo
plan in this process and count the calls that would make the host wait for a GPU (`.item()`, `float()`,
`.tolist()`, a device synchronize); they also pin the numerics those calls used to produce. The `gpu`-marked
tests run the CUDA paths (event timing, stream-waited copies) where a GPU is present and skip elsewhere.
"""

from __future__ import annotations

import datetime
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hetc.cli import main as hetc_main
from hetc.ir.program import Offload, Prefetch
from hetc.runtime.comm import Comm
from hetc.runtime import interpreter
from hetc.runtime.interpreter import Interpreter
from hetc.runtime.local import free_port
from hetc.runtime.optim import grad_sq_sum
from hetc.runtime.step_clock import StepClock
from tests.conftest import DEMO, demo_job

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CLIP = 0.05
# one rank, three ministages of the Zorse schedule, parameters and activations on the host
OFFLOADED = """use "job.het"

parallel {
  schedule = zorse
  offload {
    params = cpu
    activations = cpu
    pin_memory = PIN
  }
  stage all {
    layers = embed..head
    ranks = host[0, 0]
    lanes = 1
    ministages = 3
  }
  idle = [host[0, 1], host[1]]
}
"""


def _job(folder: Path, clip: float) -> None:
    edits = [("  lr = 3e-3\n", f"  lr = 3e-3\n  grad_clip = {clip}\n")] if clip else []
    (folder / "job.het").write_text(demo_job(*edits))


def _compile(folder: Path, name: str, text: str, clip: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _job(folder, clip)
    (folder / f"{name}.het").write_text(text)
    out = folder / f"{name}.plan"
    assert hetc_main(["compile", str(folder / f"{name}.het"), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("syncs")
    single = (DEMO / "single.het").read_text()
    return {"single": _compile(root / "plain", "single", single),
            "clipped": _compile(root / "clip", "single", single, CLIP),
            "pageable": _compile(root / "pageable", "offload", OFFLOADED.replace("PIN", "false"), CLIP),
            "pinned": _compile(root / "pinned", "offload", OFFLOADED.replace("PIN", "true"))}


@contextmanager
def one_rank(plan: Path, device: str = "cpu") -> Iterator:
    """The plan's only rank, built in this process on a 1-rank gloo group, its tensors on `device`."""
    from hetc.plandir import read_plan, read_program
    from hetc.runtime.comm import make_groups
    from hetc.runtime.data import make_data_source
    from hetc.runtime.setup import build_rank

    _, checked = read_plan(plan)
    program = read_program(plan)
    assert program.world_size == 1
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timeout)
    try:
        data = make_data_source(checked.model, checked.train, plan)
        yield build_rank(program, checked, 0, make_groups(program.groups, timeout), data, torch.device(device))
    finally:
        dist.destroy_process_group()


@dataclass
class HostReads:
    """Calls that read a tensor's value on the host (a host sync on a GPU), by the function that made them."""

    calls: list[str] = field(default_factory=list)
    paused: bool = False


@contextmanager
def counting_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    reads = HostReads()
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name):
            if not reads.paused:
                reads.calls.append(f"{_name} in {sys._getframe(1).f_code.co_name}")
            return _real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: reads.calls.append("torch.cuda.synchronize"))
    yield reads
    monkeypatch.undo()


def _uncounted(reads: HostReads, fn):
    def call(*args, **kwargs):
        reads.paused = True
        try:
            return fn(*args, **kwargs)
        finally:
            reads.paused = False
    return call


def _step(rt, step: int, monkeypatch, **flags) -> tuple[object, list[str]]:
    """Run a step, counting the host reads of device values it makes. Not counted: the data source's, whose
    tensors are host tensors by contract (`DataSource`), and the optimizer's: on CPU torch's foreach Adam
    reads its step count, a host tensor; on CUDA the fused kernel reads it on the device (runtime/optim.py)."""
    with counting_host_reads(monkeypatch) as reads:
        data = rt.interpreter.data
        monkeypatch.setattr(data, "get_microbatch", _uncounted(reads, data.get_microbatch))
        monkeypatch.setattr(interpreter, "optimizer_step", _uncounted(reads, interpreter.optimizer_step))
        result = rt.interpreter.run_step(step, **flags)
    return result, reads.calls


# ------------------------------------------------------------ host reads per step (CPU)


@pytest.mark.timeout(120)
def test_a_step_reads_the_loss_on_the_host_once(plans, monkeypatch):
    """The demo plan has four microbatches: one host read of the loss per step, not one per microbatch."""
    with one_rank(plans["single"]) as rt:
        for step in range(2):
            result, calls = _step(rt, step, monkeypatch)
            assert len(calls) == 1, calls
            assert math.isfinite(result.loss)


@pytest.mark.timeout(120)
def test_a_clipped_step_reads_the_norm_on_the_host_once(plans, monkeypatch):
    with one_rank(plans["clipped"]) as rt:
        result, calls = _step(rt, 0, monkeypatch)
        assert len(calls) == 2, calls                 # the loss and the norm
        assert result.grad_norm is not None and result.grad_norm > CLIP


@pytest.mark.timeout(120)
def test_measuring_adds_no_host_read(plans, monkeypatch):
    """`--metrics` and `--trace` time the step without a synchronize per instruction (finding 2)."""
    with one_rank(plans["clipped"]) as rt:
        result, calls = _step(rt, 0, monkeypatch, trace=True, classes=True)
        assert len(calls) == 2, calls
        assert len(result.events) == len(rt.interpreter.program.instrs)
        assert sum(result.classes.values()) <= result.seconds


@pytest.mark.timeout(180)
def test_an_offloading_step_reads_no_more(plans, monkeypatch):
    """Parameter and activation offload (pageable host buffers here) add no host read to a step."""
    with one_rank(plans["pageable"]) as rt:
        moves = {(type(i), i.what.value) for i in rt.interpreter.program.instrs if isinstance(i, (Offload, Prefetch))}
        assert moves == {(kind, what) for kind in (Offload, Prefetch) for what in ("act", "params")}
        result, calls = _step(rt, 0, monkeypatch, classes=True)
        assert len(calls) == 2, calls
        assert result.classes["offload"] >= 0


# ------------------------------------------------------------ the numbers stay what they were


@pytest.mark.timeout(120)
def test_the_loss_is_the_sum_of_the_microbatch_losses_in_microbatch_order(plans, monkeypatch):
    """The device accumulation gives bitwise the Python float sum it replaced: fp64 adds in microbatch order."""
    seen: list[float] = []
    real = Interpreter._forward

    def forward(self, instr):
        real(self, instr)
        if self.ends[instr.ms]:
            seen.append(self.outputs[(instr.ms, instr.mb)].detach().float().item())
    monkeypatch.setattr(Interpreter, "_forward", forward)
    with one_rank(plans["single"]) as rt:
        loss = rt.interpreter.run_step(0).loss
    assert len(seen) == rt.interpreter.m
    assert loss == sum(seen) / rt.interpreter.m


def test_the_squared_norm_is_exact_in_float64_over_chunks(monkeypatch):
    """A shard longer than a chunk sums the chunks' fp64 squares: the fp64 total, never an fp64 copy of it."""
    from hetc.runtime import optim

    g = torch.randn(10_001, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = grad_sq_sum(g)
    monkeypatch.setattr(optim, "SQ_SUM_CHUNK", 1000)
    chunked = grad_sq_sum(g)
    exact = sum(float(x) ** 2 for x in g.tolist())
    assert whole.dtype == chunked.dtype == torch.float64
    assert math.isclose(float(whole), exact, rel_tol=1e-13) and math.isclose(float(chunked), exact, rel_tol=1e-13)


def test_the_squared_norm_copies_at_most_a_chunk(monkeypatch):
    """The fp64 transient of `grad_sq_sum` is bounded by a chunk, however long the shard."""
    from hetc.runtime import optim

    monkeypatch.setattr(optim, "SQ_SUM_CHUNK", 100)
    sizes: list[int] = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.dtype == torch.float64 and out is not self:
            sizes.append(out.numel())
        return out
    monkeypatch.setattr(torch.Tensor, "to", to)
    grad_sq_sum(torch.ones(1050))
    monkeypatch.undo()
    assert sizes and max(sizes) <= 100


# ------------------------------------------------------------ the timing rule shared by CPU and CUDA


def test_the_step_clock_marks_the_instruction_boundaries_on_cpu():
    clock = StepClock(torch.device("cpu"))
    for _ in range(4):
        clock.mark()
    marks = clock.seconds()
    assert len(marks) == 4 and marks == sorted(marks) and marks[0] >= 0


# ------------------------------------------------------------ pin_memory of the spec


@pytest.mark.timeout(120)
def test_pin_memory_false_keeps_the_host_copies_pageable(plans):
    """`offload { pin_memory = false }` is read: the host buffers a CUDA rank would make are pageable. On
    CPU no buffer is pinned either way; the flag is what reaches the buffers."""
    for name, want in (("pageable", False), ("pinned", True)):
        with one_rank(plans[name]) as rt:
            parts = [p for buf in rt.buffers.values() for p in buf.parts()]
            assert parts and all(p.pin_host is want for p in parts)
            assert rt.interpreter.pin_memory is want


# ------------------------------------------------------------ CUDA (`gpu`: skipped without a GPU)


@gpu
@needs_cuda
def test_cuda_events_time_instructions_without_a_synchronize(monkeypatch):
    """The clock records events on the current stream and the host waits once, for the last one."""
    device = torch.device("cuda")
    syncs: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append("device"))
    clock = StepClock(device)
    a = torch.randn(2048, 2048, device=device)
    clock.mark()
    for _ in range(4):
        a = a @ a / 2048
        clock.mark()
    marks = clock.seconds()
    assert not syncs
    assert len(marks) == 5 and marks[0] == 0.0 and marks == sorted(marks) and marks[-1] > 0


@gpu
@needs_cuda
def test_a_copy_wait_is_a_stream_wait(monkeypatch):
    """`wait` on a host<->device copy makes the current stream wait for the copy's event, not the host."""
    device = torch.device("cuda")
    comm = Comm({}, 1, torch.bfloat16, device)
    src = torch.randn(1 << 20, device=device)
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    work, _ = comm.copy(lambda: host.copy_(src, non_blocking=True), None, (src,))
    assert work is not None
    synced: list[bool] = []
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda.Event, "synchronize", lambda self: synced.append(True))
        patched.setattr(torch.cuda, "synchronize", lambda *a, **k: synced.append(True))
        work.wait()
    assert not synced
    torch.cuda.current_stream(device).synchronize()
    assert torch.equal(host, src.cpu())


@gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_an_offloading_step_on_cuda_matches_cpu(plans):
    """Pinned and pageable offload on CUDA train to the CPU's loss (the frees after stream waits are safe)."""
    losses = {}
    for name in ("pinned", "pageable"):
        for device in ("cpu", "cuda"):
            with one_rank(plans[name], device) as rt:
                losses[(name, device)] = [rt.interpreter.run_step(s, classes=True).loss for s in range(3)]
    for name in ("pinned", "pageable"):
        assert losses[(name, "cuda")] == pytest.approx(losses[(name, "cpu")], rel=1e-4)
