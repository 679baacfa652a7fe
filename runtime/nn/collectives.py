"""The runtime's torch.distributed calls, typed when they fail.

Note [communication failures]
A rank whose peer died or stopped answering should say so (`PeerFailure`,
runtime/worker.py) instead of crashing with a backend's message. torch
2.13 types some of these failures: NCCL's as `DistBackendError`, the
store's as `DistStoreError` / `DistNetworkError` (all `dist.DistError`).
Gloo types none: a peer that exited gives a plain `RuntimeError`
("Connection closed by peer"), so does a timeout ("Timed out waiting Nms
for recv operation to complete", "Application timeout caused pair
closure"), from the call and from `Work.wait()` alike (measured on 2
gloo processes: all_reduce, recv, irecv().wait()). So hetc types them
where it calls: every collective and point-to-point call of a training
step goes through `comm_call`, which re-raises a `RuntimeError` as
`CommFailure` (the cause chained), and async calls return a `CommWork`
whose `wait` does the same. The worker then recognises a communication
failure by its type (`is_comm_failure`), never by the text of a message.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist

__all__ = ["CommFailure", "CommWork", "all_gather_into_tensor", "all_gather_object", "all_reduce",
           "all_to_all_single", "barrier", "batch_isend_irecv", "comm_call", "irecv", "is_comm_failure", "isend",
           "reduce_scatter_tensor"]

P = ParamSpec("P")
R = TypeVar("R")


class CommFailure(RuntimeError):
    """A collective or point-to-point call failed: a peer died, closed its connection or timed out."""


def comm_call(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` (a torch.distributed call), raising CommFailure for the untyped RuntimeErrors of gloo."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except dist.DistError:
            raise                       # typed by torch already
        except RuntimeError as err:
            raise CommFailure(str(err)) from err

    return call


def is_comm_failure(err: BaseException) -> bool:
    """Whether `err` is a failed communication (Note [communication failures])."""
    return isinstance(err, CommFailure | dist.DistError)


class CommWork:
    """The Work of an asynchronous call; `wait` fails as the call would."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    @comm_call
    def wait(self) -> None:
        self.work.wait()


def _async(fn: Callable[..., Any]) -> Callable[..., CommWork]:
    """An `async_op=True` call whose Work is a CommWork."""
    typed = comm_call(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> CommWork:
        return CommWork(typed(*args, **kwargs))

    return call


isend = _async(dist.isend)
irecv = _async(dist.irecv)
all_gather_into_tensor = comm_call(getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)
reduce_scatter_tensor = comm_call(getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)
all_reduce = comm_call(dist.all_reduce)
all_to_all_single = comm_call(dist.all_to_all_single)
all_gather_object = comm_call(dist.all_gather_object)
barrier = comm_call(dist.barrier)


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[CommWork]:
    return [CommWork(work) for work in comm_call(dist.batch_isend_irecv)(ops)]
