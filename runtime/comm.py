"""Communication for the interpreter: named process groups, tags, async copies.

Every collective and point-to-point call is asynchronous (`async_op=True`)
and returns a `CommWork`; the interpreter waits on it where the program
says (a failure is a `CommFailure`: Note [communication failures] in
runtime/nn/collectives.py). On CUDA, host<->device copies run on their own stream and their
"work" is an event that the compute stream waits for (Note [stream-ordered copies] in
runtime/host_copy.py); on CPU the same code path copies at once. With an `NcclOrder`
(`HETC_EMULATE_NCCL=1` on gloo) every op waits on its communicator's line
before it starts, as under NCCL (Note [NCCL order on gloo] in runtime/nccl_order.py).

Note [one communicator per direction]: torch's NCCL backend runs a process
group's point-to-point traffic between two ranks, both directions, on one
communicator and one stream, where the operations run one at a time in
posting order (Note [NCCL order] in passes/verify/machine.py). A pipeline
border sends activations one way and gradients the other: on one stream
they take turns, and a receive posted ahead of a send to the same peer
holds the stream while the peer's receive holds its own, a hang. So a send
to a higher rank goes on the default group and a send to a lower rank on a
second group of every rank (`TO_LOWER`): each direction of a pair has a
communicator and a stream of its own. A direction's line then holds its
messages in the order they match in, so NCCL's order can hang no program
that gloo runs, and the two directions of a border overlap as the cost
model counts them (a deep tp-4 pipeline over 25 Gb/s links: 41.1 ms a step
with one line a pair, 33.3 ms with one a direction; its closed form 29.5
ms). Megatron gets the overlap by posting a step point's sends and
receives as one `batch_isend_irecv` (one NCCL group); a communicator a
direction gives it without coupling a receive's post to a send's. It
relies on what every overlapped training loop relies on: CUDA runs NCCL
kernels of different streams side by side (a border's two directions here,
Megatron's gradient reduce beside its pipeline transfers). On NCCL a group
makes its point-to-point communicators lazily, at the first message
between two ranks, so the second group costs only the pairs that use it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from hetc.ir.program import Group, Recv, Send
from hetc.runtime.nn import collectives
from hetc.runtime.nn.collectives import CommWork
from hetc.runtime.nccl_order import NcclEmulation, NcclOrder
from hetc.ir.program import Tensor as Kind

__all__ = ["TO_LOWER", "Comm", "Waitable", "make_groups", "nccl_order"]

# The group that carries sends to lower ranks (Note [one communicator per direction]); the spaces keep it
# apart from every group a program can name.
TO_LOWER = "sends to lower ranks"


def make_groups(groups: tuple[Group, ...], timeout=None) -> dict[str, object]:
    """Create every group of the program, in table order, on every rank (torch requires all to call), and
    the group of sends to lower ranks (`TO_LOWER`), last.

    The program's "world" is the default group: the launcher made it of
    exactly the plan's ranks (hetc.runtime.worker checks WORLD_SIZE).
    """
    made = {g.name: dist.group.WORLD if g.name == "world" else dist.new_group(list(g.ranks), timeout=timeout)
            for g in groups}
    made[TO_LOWER] = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    return made


class Waitable(Protocol):
    """What an asynchronous operation returns: a torch Work, or a copy's event (`_EventWork`)."""

    def wait(self) -> object: ...


class _EventWork:
    """A copy on a side stream, as a Work: `wait` makes the current stream wait for it, not the host (Note
    [stream-ordered copies] in runtime/host_copy.py)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


def nccl_order(rank: int, emulation: NcclEmulation | None) -> NcclOrder | None:
    """The lines that hold this rank's gloo ops to NCCL's order, when `emulation` asks; none under NCCL,
    which orders them itself (and whose streams are the launching thread's)."""
    if emulation is None or dist.get_backend() != dist.Backend.GLOO:
        return None
    return NcclOrder(rank, emulation)


class Comm:
    def __init__(self, groups: dict[str, object], num_microbatches: int, act_dtype: torch.dtype,
                 device: torch.device, order: NcclOrder | None = None):
        self.groups = groups
        self.m = num_microbatches
        self.act_dtype = act_dtype
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.order = order      # Note [NCCL order on gloo]; None: every op starts when posted
        self.rank = dist.get_rank()
        self.to_lower = groups[TO_LOWER]    # Note [one communicator per direction]
        self._group_names = {id(g): name for name, g in groups.items()}

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

    def isend(self, t: Tensor, peer: int, tag: int, label: str = "") -> Waitable:
        """`label`: the instruction, named by the emulation's messages."""
        group = self._direction(self.rank, peer)
        return self._p2p((self.rank, peer), label or f"isend to {peer}",
                         lambda: collectives.isend(t, peer, tag=tag, group=group))

    def irecv(self, t: Tensor, peer: int, tag: int, label: str = "") -> Waitable:
        group = self._direction(peer, self.rank)
        return self._p2p((peer, self.rank), label or f"irecv from {peer}",
                         lambda: collectives.irecv(t, peer, tag=tag, group=group))

    def _direction(self, sender: int, receiver: int):
        """The group a message from `sender` to `receiver` travels on (Note [one communicator per direction])."""
        return self.to_lower if receiver < sender else dist.group.WORLD

    def all_gather(self, out: Tensor, mine: Tensor, group) -> Waitable:
        return self._collective(group, "all_gather", lambda: CommWork(
            collectives.all_gather_into_tensor(out, mine, group=group, async_op=True)))

    def reduce_scatter(self, out: Tensor, full: Tensor, group) -> Waitable:
        return self._collective(group, "reduce_scatter", lambda: CommWork(
            collectives.reduce_scatter_tensor(out, full, group=group, async_op=True)))

    def all_reduce(self, t: Tensor, group) -> Waitable:
        return self._collective(group, "all_reduce", lambda: CommWork(
            collectives.all_reduce(t, group=group, async_op=True)))

    # Under the emulation an op is queued on its communicator's line and started when the line reaches it.

    def _p2p(self, direction: tuple[int, int], label: str, start: Callable[[], CommWork]) -> Waitable:
        if self.order is None:
            return start()
        return self.order.post(direction, label, start)

    def _collective(self, group, kind: str, start: Callable[[], CommWork]) -> Waitable:
        if self.order is None:
            return start()
        name = self._group_names.get(id(group), "?")
        return self.order.post(name, f"{kind} on group '{name}'", start)

    def copy(self, move: Callable[[], None], done: Callable[[], None] | None,
             touches: Collection[Tensor] = ()) -> tuple[Waitable | None, Callable[[], None] | None]:
        """(work, on_done) for a host<->device copy; `touches`: the device tensors `move` reads or writes,
        allocated on the compute stream (Note [stream-ordered copies] in runtime/host_copy.py).

        On CUDA the copy runs on the copy stream after the compute stream's work so far (the activations
        it reads, the blocks it writes may be the compute stream's until then), and `touches` are recorded
        on the copy stream, so that freeing them after the wait does not hand their memory to the compute
        stream while the copy may still use it.
        """
        if self.copy_stream is None:
            move()
            return None, done
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            move()
            for t in touches:
                t.record_stream(self.copy_stream)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return _EventWork(event, self.device), done
