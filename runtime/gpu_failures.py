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
"""

from __future__ import annotations

import datetime
import logging
import os

import torch

from hetc.passes.verify.memory import format_bytes

__all__ = ["NCCL_DEFAULTS", "DeviceOutOfMemory", "creation_timeout", "estimate_line", "nccl_environment", "out_of_memory_in",
           "out_of_memory_message", "use_step_timeout"]

log = logging.getLogger("hetc.runtime")

# torchtitan's settings (torchtitan/distributed/utils.py), applied where the user has not set them
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",     # on a timeout or error the watchdog ends the rank
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",    # the flight recorder's entries per rank
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",          # dumped to TORCH_NCCL_DEBUG_INFO_TEMP_FILE (/tmp/nccl_trace_rank_N)
}


class DeviceOutOfMemory(RuntimeError):
    """A rank ran out of device memory; the message is the whole paragraph (`out_of_memory_message`)."""


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

    costs = CostModel(plan.spec, plan.pipeline, plan.topology, None)
    return rank_peak(program.ranks[rank], plan.pipeline, costs, group_sizes(program.groups))


def _allocated() -> str:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    return (f"; this process had {format_bytes(torch.cuda.max_memory_allocated())} allocated at most, "
            f"{format_bytes(torch.cuda.max_memory_reserved())} reserved")

