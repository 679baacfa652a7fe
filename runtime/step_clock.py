"""The clock of measuring mode (`--metrics`, `--trace`, `hetc calibrate`): when a step reached each instruction.

The interpreter marks the boundary before each instruction and after the
last; `seconds` gives the marks as seconds since the first, once the step has
ended. On CPU a mark is the host's clock. On CUDA it is an event recorded on
the current (compute) stream, and the marks are read once, at the step's end
(Note [timing with CUDA events]). The same marks feed the trace's events and
the time classes (hetc/ir/timeline.py `class_times`), on either device.
"""

from __future__ import annotations

import time

import torch

__all__ = ["StepClock"]


# Note [timing with CUDA events]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A CUDA launch returns to the host before the kernel runs, so the host's clock around a handler times the
# launch, not the work; the old fix, a device-wide synchronize after every instruction, made the host wait
# for every stream, NCCL's too: with a receive posted ahead it blocked until the peer sent (a hang when the
# peer did the same) and it serialised communication and copies with compute, so the split described
# another program (issue 29, finding 2). CUDA orders the work of one stream: an event recorded on the
# compute stream after an instruction's kernels completes when they have, and no earlier, and
# `elapsed_time` between two such events is device time on that stream. So each mark is an event on the
# stream that was current when the interpreter reached the instruction (every handler leaves the compute
# stream current; copies and NCCL run on their own streams and enter the compute stream only where a
# `wait` makes it wait for them). The time between two marks is then what the compute stream spent on the
# instruction, or waiting at it: the meaning `class_times` gives the host's marks on CPU. Reading the
# events needs them complete: the host waits once, for the last mark (an event wait, not a device-wide
# synchronize), after the step's last instruction, where it waits for the loss anyway.


class StepClock:
    """Marks on one step's timeline, on the host's clock (CPU) or as CUDA events (Note [timing with CUDA events])."""

    def __init__(self, device: torch.device):
        self.device = device
        self._on_cuda = device.type == "cuda"
        self._host: list[float] = []
        self._events: list[torch.cuda.Event] = []

    def mark(self) -> None:
        """The step has reached this point: the host's time, or an event on the current stream."""
        if not self._on_cuda:
            self._host.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._events.append(event)

    def seconds(self) -> list[float]:
        """Every mark in seconds since the first; on CUDA the host waits for the last mark's event first."""
        if not self._on_cuda:
            return [t - self._host[0] for t in self._host]
        if not self._events:
            return []
        self._events[-1].synchronize()
        first = self._events[0]
        return [first.elapsed_time(e) / 1e3 for e in self._events]
