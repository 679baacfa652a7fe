"""A blocking call's wait for a core, measured for `hetc profile` (Note [core wait] in passes/cost/cores.py).

`ranks` processes (as many as the cluster runs on this machine), each with
a rank's one thread, pair up (0-1, 2-3, ...; an odd one out only computes)
and run two rounds of `calls` blocking calls with their partner: an
all-reduce, then a message each way (a recv that waits for the partner's
send, as a pipeline border does). Each round runs twice, once back to back
and once with one forward of a model block before every call, so that
while a pair synchronises the other processes compute, as a step's ranks
do. Every process stamps each call with the machine's monotonic clock on
entry and on return; a call's time is from its last member's arrival (its
partner's entry, or the send) to its return. The wait is how much longer
the median call took with compute between the calls than back to back
(never below 0): what the back-to-back rates of the profile do not hold.

A third round times the exchange ring attention makes inside a layer (its
own `Ring.shift`, then `wait_all`: K and V of a cp rank's tokens to the
partner and the partner's back, four operations) from each member's entry
to its return, and keeps the mean over the calls, not the median: a layer's
many shifts pay the long tail of turns a process waits for a core too
(Note [exchange wait] in passes/cost/cores.py). With more than two
processes a fourth round all-reduces over all of them (a ZeRO group of all
the node's ranks needs every one of them scheduled, not two): the mean
extra from the last arrival, `world_collective_s`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.queues import SimpleQueue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetc.runtime.local import spawned_store
from hetc.runtime.nn.model import build_ministage
from hetc.runtime.nn.ring_attention import Ring, wait_all
from hetc.ir.spec import ModelSpec

__all__ = ["CoreWaitSample", "measure_core_wait"]

# (entry, return) of one call, in seconds of time.monotonic (CLOCK_MONOTONIC: one clock for every process)
_Stamp = tuple[float, float]


@dataclass(frozen=True)
class CoreWaitSample:
    """The measured waits, as the profile file records them (`core_wait`)."""

    ranks: int
    cores: int
    collective_s: float
    p2p_s: float
    exchange_s: float
    world_collective_s: float | None     # None: only two processes, the pairs' round is the world's
    calls: int

    def to_json(self) -> dict[str, float | int]:
        return {"ranks": self.ranks, "cores": self.cores, "collective_s": self.collective_s,
                "p2p_s": self.p2p_s, "exchange_s": self.exchange_s,
                "calls": self.calls, **({} if self.world_collective_s is None else
                                        {"world_collective_s": self.world_collective_s})}


@dataclass(frozen=True)
class _Rounds:
    """One process's stamps: per round (collective or p2p; back to back or loaded), one per call."""

    collective: tuple[list[_Stamp], list[_Stamp]]
    sends: tuple[list[_Stamp], list[_Stamp]]      # as sender, then receiver, per exchange
    recvs: tuple[list[_Stamp], list[_Stamp]]
    exchanges: tuple[list[_Stamp], list[_Stamp]]
    world: tuple[list[_Stamp], list[_Stamp]]     # all-reduces over every process (none with two)


def measure_core_wait(model: ModelSpec, micro_batch: int, ranks: int, calls: int) -> CoreWaitSample:
    """The waits of `calls` collectives and messages between pairs of `ranks` (at least 2) local gloo
    processes, computing `model`'s block at `micro_batch` between the calls of the loaded rounds."""
    assert ranks >= 2 and calls >= 1
    queue: SimpleQueue[tuple[int, _Rounds]] = mp.get_context("spawn").SimpleQueue()
    with spawned_store(ranks) as env:
        mp.start_processes(_worker, args=(model, micro_batch, ranks, calls, env, queue), nprocs=ranks,
                           join=True, start_method="spawn")
    stamps: dict[int, _Rounds] = dict(queue.get() for _ in range(ranks))
    pairs = [(a, a + 1) for a in range(0, ranks - 1, 2)]
    collective = [_median([_call_times(stamps[a].collective[k], stamps[b].collective[k]) for a, b in pairs])
                  for k in (0, 1)]
    p2p = [_median([_message_times(stamps[a], stamps[b], k) for a, b in pairs]) for k in (0, 1)]
    exchange = [statistics.fmean(out - entry for r in range(2 * len(pairs)) for entry, out in stamps[r].exchanges[k])
                for k in (0, 1)]
    world = [statistics.fmean(max(out for _, out in call) - max(entry for entry, _ in call)
                              for call in zip(*(stamps[r].world[k] for r in range(ranks)), strict=True))
             for k in (0, 1)] if ranks > 2 else None
    return CoreWaitSample(ranks, len(os.sched_getaffinity(0)), max(0.0, collective[1] - collective[0]),
                          max(0.0, p2p[1] - p2p[0]), max(0.0, exchange[1] - exchange[0]),
                          None if world is None else max(0.0, world[1] - world[0]), calls)


def _median(per_pair: list[list[float]]) -> float:
    """The median over every pair's calls."""
    return statistics.median(t for pair in per_pair for t in pair)


def _call_times(a: list[_Stamp], b: list[_Stamp]) -> list[float]:
    """Per call of a pair: the later return less the later entry."""
    return [max(ra, rb) - max(ea, eb) for (ea, ra), (eb, rb) in zip(a, b, strict=True)]


def _message_times(a: _Rounds, b: _Rounds, k: int) -> list[float]:
    """Per message of a pair (a to b, then b to a): the receive's return less the later of send and receive."""
    return [recv_out - max(send_in, recv_in) for sender, receiver in ((a, b), (b, a))
            for (send_in, _), (recv_in, recv_out) in zip(sender.sends[k], receiver.recvs[k], strict=True)]


def _worker(rank: int, model: ModelSpec, micro_batch: int, ranks: int, calls: int, env: dict[str, str],
            queue: SimpleQueue[tuple[int, _Rounds]]) -> None:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))   # a local-run rank's one thread
    os.environ.update(env)     # `spawned_store`'s
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    groups = [dist.new_group([a, a + 1]) for a in range(0, ranks - 1, 2)]   # every process creates every group
    partner = rank ^ 1 if (rank ^ 1) < ranks else None
    group = groups[rank // 2] if partner is not None else None
    block = build_ministage(model, range(1, 2), seed=0)
    hidden = torch.randn(micro_batch, model.seq, model.hidden)
    buf = torch.zeros(micro_batch * model.seq * model.hidden)

    def compute() -> None:
        with torch.no_grad():
            block(hidden, None)

    ring = None if partner is None else Ring(group, (rank & ~1, rank | 1), rank & 1)
    kv = [torch.zeros(micro_batch, model.num_kv_heads, max(1, model.seq // 2), model.hidden // model.heads)
          for _ in range(2)]   # K and V of a cp rank's half of the tokens (cp = 2)
    rounds = []
    for work in (None, compute):
        dist.barrier()
        rounds.append((_timed_calls(calls, None if group is None else lambda: dist.all_reduce(buf, group=group),
                                    work),
                       _messages(rank, partner, calls, buf, work),
                       _timed_calls(calls, None if ring is None else lambda: wait_all(ring.shift(kv)[1]), work),
                       _timed_calls(calls, lambda: dist.all_reduce(buf), work) if ranks > 2 else []))
    queue.put((rank, _Rounds((rounds[0][0], rounds[1][0]), (rounds[0][1][0], rounds[1][1][0]),
                             (rounds[0][1][1], rounds[1][1][1]), (rounds[0][2], rounds[1][2]),
                             (rounds[0][3], rounds[1][3]))))
    dist.barrier()
    dist.destroy_process_group()


def _timed_calls(calls: int, call: Callable[[], object] | None, work: Callable[[], None] | None) -> list[_Stamp]:
    """Per round, `work` then one blocking `call` (an all-reduce, a ring-attention shift waited), stamped;
    without a call (the odd one out of a pairing) the rank computes only."""
    out = []
    for _ in range(calls):
        if work:
            work()
        if call is None:
            continue
        start = time.monotonic()
        call()
        out.append((start, time.monotonic()))
    return out


def _messages(rank: int, partner: int | None, calls: int, buf: torch.Tensor,
              work: Callable[[], None] | None) -> tuple[list[_Stamp], list[_Stamp]]:
    """(sends, receives): per call, this rank sends to its partner and receives from it (the lower rank
    sends first)."""
    sends: list[_Stamp] = []
    recvs: list[_Stamp] = []
    for _ in range(calls):
        if work:
            work()
        if partner is None:
            continue
        for sending in ((True, False) if rank < partner else (False, True)):
            start = time.monotonic()
            if sending:
                dist.send(buf, partner)
            else:
                dist.recv(buf, partner)
            (sends if sending else recvs).append((start, time.monotonic()))
    return sends, recvs
