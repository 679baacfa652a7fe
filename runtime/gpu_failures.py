"""GPU failures as one paragraph each: a CUDA out-of-memory, and the timeouts and NCCL settings of a run.

Ranks that would share a GPU are refused earlier, by placement (Note [One GPU per rank] in
runtime/placement.py). What reaches the user here is what a rank can say about itself: where it ran out
of memory, what the plan's estimate said for it, and what would make the plan fit.

Note [Init and step timeouts]
Creating the process groups waits for every rank to start and, on NCCL with `device_id`, for each
communicator to form: on a large or slowly starting cluster minutes, not the seconds a step's collective
takes. torchtitan therefore gives init 300 s and training its own (shorter) timeout; hetc does the same:
`--init-timeout` covers the rendezvous (the store every process reports to before placement) and, on
NCCL, `init_process_group` and every group `hetc run` creates; `use_step_timeout` then sets `--timeout`
on all of them before the first step, so a hung collective or message in a step fails after `--timeout`.
Gloo differs (measured on torch 2.13): a group's point-to-point waits keep the timeout the group was
created with, whatever is set after (its collectives take the new one), so gloo groups are created with
the step timeout (`creation_timeout`); their processes have all met in the store by then. NCCL's watchdog is what notices a timeout on a GPU (a `Work.wait()` does
not block the host), so `nccl_environment` sets torchtitan's settings unless the user set them:
TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (the watchdog ends the rank on a timeout or error instead of leaving it
hung) and a flight-recorder buffer dumped on a timeout (which collective each rank was in).

Note [A timeout or a dead peer]
A collective or message of a step fails for one of two reasons: a peer is gone, or the call waited out
its timeout while the peer lives on (stalled in a kernel, a slow file system, a hung data loader, a
program whose ranks disagree). torch 2.13 types neither: gloo raises the same RuntimeError for a closed
connection and for "Timed out waiting Nms", NCCL's `Work.wait()` a DistBackendError whose words change
between versions (Note [communication failures] in runtime/nn/collectives.py). The heartbeats tell them
apart on both backends (runtime/watchdog.py): a peer that stopped beating is dead (`PeerFailure`, as
before); when every other rank still beats, nobody died, so the call timed out (`CommTimeout`). Its
paragraph names the rank, the step, the instruction it waited in and the op that instruction waits for
(a `wait h=N` is resolved to the send, receive or collective that posted handle N, and so to the peer or
group), the timeout that expired and what to do; torch's own first line is quoted, so that a failure of
another kind still shows its words. The exit status is a failure's, 1 (2 is bad input, 3 a diverged run).
Under NCCL with TORCH_NCCL_ASYNC_ERROR_HANDLING=3 a timeout often never reaches Python (a `Work.wait()`
does not block the host): NCCL's watchdog dumps the flight recorder and ends the process (SIGABRT, status
134), and the peers that reach theirs say so here; on NCCL the paragraph therefore points at the dump
(TORCH_NCCL_DEBUG_INFO_TEMP_FILE), which says which collective each rank was in.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetc.passes.verify.memory import format_bytes
from hetc.ir.program import COLLECTIVE_TYPES, Group, Instr, Recv, Send, Wait

__all__ = ["NCCL_DEFAULTS", "CommTimeout", "DeviceOutOfMemory", "Waited", "creation_timeout", "estimate_line",
           "nccl_environment", "out_of_memory_in", "out_of_memory_message", "timeout_message", "use_step_timeout",
           "waited_for"]

log = logging.getLogger("hetc.runtime")

# torchtitan's settings (torchtitan/distributed/utils.py), applied where the user has not set them
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",     # on a timeout or error the watchdog ends the rank
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",    # the flight recorder's entries per rank
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",          # dumped to TORCH_NCCL_DEBUG_INFO_TEMP_FILE (/tmp/nccl_trace_rank_N)
}


class DeviceOutOfMemory(RuntimeError):
    """A rank ran out of device memory; the message is the whole paragraph (`out_of_memory_message`)."""


class CommTimeout(RuntimeError):
    """A collective or message waited out its timeout while every other rank was alive (Note [A timeout or a
    dead peer]); the message is the whole paragraph (`timeout_message`)."""


def nccl_environment() -> None:
    """NCCL's error handling and flight recorder (Note [Init and step timeouts]); before `init_process_group`."""
    for key, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(key, value)


def creation_timeout(backend: str, init: datetime.timedelta, step: datetime.timedelta) -> datetime.timedelta:
    """The timeout to create `backend`'s process groups with (Note [Init and step timeouts])."""
    return init if backend == "nccl" else step


def use_step_timeout(timeout: datetime.timedelta) -> None:
    """Give every process group of this rank the step timeout, now that they exist (Note [Init and step
    timeouts])."""
    from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout, _world

    for group in list(_world.pg_map):
        if not _rank_not_in_group(group):
            _set_pg_timeout(timeout, group)


def out_of_memory_in(err: BaseException) -> BaseException | None:
    """The CUDA out-of-memory error in `err` or its causes (a communication call types a RuntimeError as
    a CommFailure, chaining the cause), or None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def out_of_memory_message(rank: int, stage: int, lane: int, device: str, where: str, detail: str,
                          estimate: str) -> str:
    """One paragraph: which rank ran out where, what the estimate said, what to do.

    `where` is the interpreter's note (`[rank r] step s: instruction i ...`) or '' outside a step,
    `detail` torch's first line, `estimate` `estimate_line`'s."""
    place = f"during {where.split('] ', 1)[-1]}" if where else "while setting up (before the first step)"
    return (f"rank {rank} (stage {stage}, lane {lane}, {device}) ran out of device memory {place}: "
            f"{detail.rstrip('. ')}. "
            f"{estimate}. To fit, compile a plan that needs less on this stage: a smaller train.micro_batch, "
            "model.activation_checkpoint = full, offload { activations = cpu } or { params = cpu }, or a "
            "higher ZeRO level (zero = 1, 2 or 3); `hetc explain SPEC` shows each rank's estimated memory")


def estimate_line(plan, program, rank: int) -> str:
    """What the plan's estimate said for `rank`: the verifier's peak against the device's memory, and what
    this process had allocated at its peak. Never raises: a message about a failure must not fail."""
    capacity = plan.pipeline.world[rank].device.memory
    used = _allocated()
    try:
        peak = _peak(plan, program, rank)
    except Exception as err:  # noqa: BLE001 - the estimate is a courtesy; the paragraph must come out
        log.debug("no memory estimate for rank %d: %s", rank, err)
        return f"The plan's device has {format_bytes(capacity)}{used}"
    parts = ", ".join(f"{name} {format_bytes(b)}" for name, b in peak.parts.items() if b > 0)
    return (f"The plan's estimate for this rank was a peak of {format_bytes(peak.total)} of {format_bytes(capacity)} at "
            f"instruction {peak.index} ({parts}){used}")


def _peak(plan, program, rank: int):
    from hetc.passes.cost import CostModel
    from hetc.passes.verify.memory import group_sizes, rank_peak

    costs = CostModel(plan)
    return rank_peak(program.ranks[rank], plan.pipeline, costs, group_sizes(program.groups))


def _allocated() -> str:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    return (f"; this process had {format_bytes(torch.cuda.max_memory_allocated())} allocated at most, "
            f"{format_bytes(torch.cuda.max_memory_reserved())} reserved")


# the interpreter's note on a failed instruction (runtime/interpreter.py `_run`)
_STEP_NOTE = re.compile(r"\[rank (?P<rank>\d+)\] step (?P<step>\d+): instruction (?P<index>\d+) `(?P<instr>.*)`$")


@dataclass(frozen=True)
class Waited:
    """Where a rank's timed-out call was: the instruction it waited in and the op that instruction waits for."""

    step: int
    index: int
    instr: str                  # the instruction, as the listing prints it
    op: Instr | None            # the send, receive or collective it waits for; None when the note is not the program's
    peers: tuple[int, ...]      # the ranks that op waits on


def waited_for(notes: Sequence[str], rank: int, instrs: Sequence[Instr], groups: Sequence[Group]) -> Waited | None:
    """The instruction of `instrs` (this rank's training program) that the interpreter's note names, or None
    outside a step. A `wait h=N` stands for the op that posted handle N. An evaluation's note numbers the
    instructions of its own program: its text then differs from the training program's and `op` is None."""
    found = next((m for note in notes if (m := _STEP_NOTE.match(note)) and int(m["rank"]) == rank), None)
    if found is None:
        return None
    index = int(found["index"])
    op = instrs[index] if index < len(instrs) and str(instrs[index]) == found["instr"] else None
    if isinstance(op, Wait):
        handle = op.handle
        op = next((i for i in reversed(instrs[:index]) if getattr(i, "handle", None) == handle), None)
    return Waited(int(found["step"]), index, found["instr"], op, _peers(op, rank, groups))


def _peers(op: Instr | None, rank: int, groups: Sequence[Group]) -> tuple[int, ...]:
    if isinstance(op, Send):
        return (op.peer_to,)
    if isinstance(op, Recv):
        return (op.peer_from,)
    if isinstance(op, COLLECTIVE_TYPES):
        members = next((g.ranks for g in groups if g.name == op.group), ())
        return tuple(r for r in members if r != rank)
    return ()


def timeout_message(rank: int, waited: Waited | None, timeout_s: float, init_timeout_s: float, backend: str,
                    detail: str) -> str:
    """One paragraph: which rank timed out where, waiting for what and on whom, which timeout, what to do.

    `detail` is torch's first line (quoted: a failure of another kind still shows its words)."""
    peers = waited.peers if waited is not None else ()
    ranks = _ranks(peers) if peers else "the other ranks"
    if waited is not None:
        place = f"in step {waited.step}, instruction {waited.index} `{waited.instr}`"
        if waited.op is not None and str(waited.op) != waited.instr:
            place += f", waiting for `{waited.op}`"
        place += _on_whom(waited.op, peers)
        limit = f"--timeout {timeout_s:g} s"
    else:
        place = "outside a step (setting up or saving)"
        limit = f"its timeout (--timeout {timeout_s:g} s; --init-timeout {init_timeout_s:g} s while the groups form)"
    whose = f"{ranks}'s own message for where it" if len(peers) == 1 else f"the messages of {ranks} for where they"
    advice = [f"raise --timeout if a step's communication can take longer than {timeout_s:g} s",
              f"read {whose} stalled"]
    if backend == "nccl":
        advice.append("read the flight recorder NCCL dumped on the timeout (TORCH_NCCL_DEBUG_INFO_TEMP_FILE, "
                      "/tmp/nccl_trace_rank_N by default): the collective each rank was in")
    subject = f"{_ranks(peers).capitalize()} {'is' if len(peers) == 1 else 'are'}" if peers else "The other ranks are"
    alive = f"{subject} alive (heartbeats go on): stalled or slower than the timeout allows, not dead"
    return (f"rank {rank} timed out {place}: it did not complete within {limit} ({backend}: "
            f"{detail.rstrip('. ')}). {alive}. To go on: {'; '.join(advice)}")


def _on_whom(op: Instr | None, peers: tuple[int, ...]) -> str:
    if isinstance(op, Send):
        return f" to rank {op.peer_to}"
    if isinstance(op, Recv):
        return f" from rank {op.peer_from}"
    if isinstance(op, COLLECTIVE_TYPES):
        return f" on group '{op.group}' (with {_ranks(peers)})"
    return ""


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
