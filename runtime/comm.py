"""Communication for the interpreter: named process groups, tags, async copies.

Every collective and point-to-point call is asynchronous (`async_op=True`)
and returns a `CommWork`; the interpreter waits on it where the program
says (a failure is a `CommFailure`: Note [communication failures] in
runtime/nn/collectives.py). On CUDA, host<->device copies run on their own stream and their
"work" is an event; on CPU the same code path copies at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from hetc.program import Group, Recv, Send
from hetc.runtime.nn import collectives
from hetc.runtime.nn.collectives import CommWork
from hetc.program import Tensor as Kind

__all__ = ["Comm", "Waitable", "make_groups"]

def make_groups(groups: tuple[Group, ...], timeout=None) -> dict[str, object]:
    """Create every group of the program, in table order, on every rank (torch requires all to call).

    The program's "world" is the default group: the launcher made it of
    exactly the plan's ranks (hetc.runtime.worker checks WORLD_SIZE).
    """
    return {g.name: dist.group.WORLD if g.name == "world" else dist.new_group(list(g.ranks), timeout=timeout)
            for g in groups}


class Waitable(Protocol):
    """What an asynchronous operation returns: a torch Work, or a copy's event (`_EventWork`)."""

    def wait(self) -> object: ...


class _EventWork:
    """A copy on a side stream, as a Work: `wait` makes the current stream wait for it."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class Comm:
    def __init__(self, groups: dict[str, object], num_microbatches: int, act_dtype: torch.dtype,
                 device: torch.device):
        self.groups = groups
        self.m = num_microbatches
        self.act_dtype = act_dtype
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def group(self, name: str):
        try:
            return self.groups[name]
        except KeyError:
            raise RuntimeError(f"unknown group '{name}'") from None

    def tag(self, instr: Send | Recv) -> int:
        """One tag per message (kind, ministage, microbatch, piece): gloo matches on it.

        Pieces of one message (`seq=a:b`) are told apart by their first
        token (mod 1023; pieces that share a tag still match in posting order).
        """
        tag = (instr.ms * self.m + instr.mb) * 2 + (instr.what is Kind.GRAD)
        return tag if instr.seq is None else tag * 1024 + 1 + instr.seq[0] % 1023

    def isend(self, t: Tensor, peer: int, tag: int) -> CommWork:
        return collectives.isend(t, peer, tag=tag)

    def irecv(self, t: Tensor, peer: int, tag: int) -> CommWork:
        return collectives.irecv(t, peer, tag=tag)

    def all_gather(self, out: Tensor, mine: Tensor, group) -> CommWork:
        return CommWork(collectives.all_gather_into_tensor(out, mine, group=group, async_op=True))

    def reduce_scatter(self, out: Tensor, full: Tensor, group) -> CommWork:
        return CommWork(collectives.reduce_scatter_tensor(out, full, group=group, async_op=True))

    def all_reduce(self, t: Tensor, group) -> CommWork:
        return CommWork(collectives.all_reduce(t, group=group, async_op=True))

    def copy(self, move: Callable[[], None],
             done: Callable[[], None] | None) -> tuple[Waitable | None, Callable[[], None] | None]:
        """(work, on_done) for a host<->device copy."""
        if self.copy_stream is None:
            move()
            return None, done
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            move()
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return _EventWork(event), done
