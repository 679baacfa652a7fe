"""Measurements for `hetc profile`: layer times, copy bandwidth, collectives between local processes.

Layers are hetc's own (runtime/nn/model.py), built one at a time as a
ministage and timed forward and backward on random inputs; the fastest of
`repeats` runs after one warm-up (timed alone: interference only adds time,
and with few runs the first ones are slow, so on this machine the median of
five came out 2-3x the fastest, above what the layers take inside a step),
the median where several processes run at once (the load is then part of
the measurement). On CUDA the clock is CUDA events around
the work; on CPU the wall clock. `time_layers_at_once` times them in
several processes at once, as the ranks of a node run (Note [shared cores]
in passes/cost/cores.py). Collectives run in `ranks` spawned
processes (gloo on CPU, NCCL on GPUs, one per process).

Note [Only what was measured]
A profile's rates describe the device kind it names, and the cost model
prefers them to the catalog. So nothing is timed on another device than
the one it describes: on a machine with GPUs, collectives and messages run
with NCCL between processes that have a GPU each, and the layers "at once"
run one process per GPU. What that needs more GPUs than the machine has is
not measured (`measurable` says what and why) and left out of the file, so
the cost model takes those rates from the catalog; gloo between CPU tensors
would have recorded loopback TCP as the GPU's NVLink, and processes sharing
one GPU its time-slicing as a node's ranks at once.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetc.ir.program import Collective
from hetc.runtime.local import spawned_store
from hetc.runtime.nn.model import build_ministage, compute_dtype
from hetc.ir.spec import ModelSpec

__all__ = [
    "COLLECTIVE_KINDS",
    "LayerSample",
    "LayersAtOnce",
    "Measurable",
    "comm_rates",
    "copy_rates",
    "local_device",
    "measurable",
    "slowdown",
    "time_layers",
    "time_layers_at_once",
]

COLLECTIVE_KINDS = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER)   # what `_collectives` times
# torch renamed the flat-tensor collectives; use whichever this torch has
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class LayerSample:
    layer: str
    micro_batch: int
    seq: int
    forward_s: float
    backward_s: float


def local_device() -> torch.device:
    """CUDA if there is one; else the CPU, with the one thread a local-run rank uses (runtime/worker.py)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return torch.device("cpu")


@dataclass(frozen=True)
class Measurable:
    """What `hetc profile` can time on this machine (Note [Only what was measured])."""

    layers_at_once: int          # processes timing the layers at once (1: only alone)
    comm_at_once: int | None     # processes of the collectives' run (`comm_rates`' at_once); None: not timed
    skipped: tuple[str, ...]     # one line for each thing not measured, and why


def comm_world(ranks: int, at_once: int) -> int:
    """The processes `comm_rates(ranks, ..., at_once)` starts: whole blocks of `ranks`."""
    return max(ranks, at_once // ranks * ranks)


def measurable(gpus: int, ranks: int, at_once: int, comm: bool = True) -> Measurable:
    """What can be timed with `gpus` GPUs (0: a CPU machine, where processes share its cores as a local
    run's ranks do) for `ranks`-process collectives and `at_once` ranks of a node."""
    if gpus == 0:
        return Measurable(at_once, at_once if comm else None, ())
    skipped = []
    layers_at_once = at_once
    if at_once > gpus:
        layers_at_once = 1
        skipped.append(f"the layers in {at_once} processes at once: that needs a GPU each, and this machine "
                       f"has {gpus} (no slowdown recorded)")
    comm_at_once: int | None = None
    if comm and ranks > gpus:
        skipped.append(f"collectives and point-to-point between {ranks} processes: NCCL needs a GPU each, and "
                       f"this machine has {gpus} (the cost model takes these rates from the catalog)")
    elif comm:
        comm_at_once = at_once if comm_world(ranks, at_once) <= gpus else 1
        if comm_at_once != at_once:
            skipped.append(f"collectives in {comm_world(ranks, at_once)} processes at once: that needs a GPU "
                           f"each, and this machine has {gpus} (timed between {ranks} alone)")
    return Measurable(layers_at_once, comm_at_once, tuple(skipped))


def _clock(device: torch.device, fn: Callable[[], object], repeats: int,
           setup: Callable[[], None] | None = None, pick: Callable[[list[float]], float] = min) -> float:
    """Fastest of `repeats` timed runs of `fn` after one warm-up (`setup` runs untimed before each).

    The minimum, as timeit reports: interference from other processes only adds time. Under a load that
    is part of the measurement (ranks sharing cores) `pick` is the median instead.
    """
    if setup:
        setup()
    fn()
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return pick(times)


def time_layers(model: ModelSpec, micro_batches: list[int], seqs: list[int], repeats: int,
                progress: Callable[[str], None], pick: Callable[[list[float]], float] = min,
                device: torch.device | None = None) -> list[LayerSample]:
    """Forward and backward seconds of the embedding, one block and the head at each (b, S)."""
    device = device or local_device()
    dtype = compute_dtype(model.dtype) if device.type == "cuda" else torch.float32
    out = []
    for name, idx in (("embed", 0), ("block", 1), ("head", model.layers + 1)):
        stage = build_ministage(model, range(idx, idx + 1), seed=0, device=device).to(dtype)
        for seq in seqs:
            for b in micro_batches:
                progress(f"{name} b={b} S={seq}")
                fwd, bwd = _time_one(stage, name, model, b, seq, device, dtype, repeats, pick)
                out.append(LayerSample(name, b, seq, fwd, bwd))
        del stage
    return out


def _time_one(stage, name: str, model: ModelSpec, b: int, seq: int, device, dtype, repeats: int, pick=min):
    tokens = torch.randint(0, model.vocab, (b, seq), device=device)
    hidden = torch.randn(b, seq, model.hidden, device=device, dtype=dtype)
    labels = tokens if name == "head" else None
    pending: list[torch.Tensor] = []

    def inputs():
        return tokens if name == "embed" else hidden.detach().requires_grad_(True)

    def forward():
        y = stage(inputs(), labels)
        pending[:] = [y if y.dim() == 0 else y.float().square().mean()]

    def backward():
        pending.pop().backward()

    def reset():
        stage.zero_grad(set_to_none=True)
        forward()

    fwd = _clock(device, forward, repeats, setup=pending.clear, pick=pick)
    return fwd, _clock(device, backward, repeats, setup=reset, pick=pick)


@dataclass(frozen=True)
class LayersAtOnce:
    """`time_layers` in several processes at once: the per-point medians, and how much of the wall clock
    each process had a core for."""

    samples: list[LayerSample]
    wall_per_cpu: float    # median over the processes of the sweep's wall time / its CPU time


def time_layers_at_once(model: ModelSpec, micro_batches: list[int], seqs: list[int], repeats: int,
                        ranks: int) -> LayersAtOnce:
    """`time_layers` in `ranks` processes at once (each with a rank's one thread, or its own GPU while there
    are GPUs to go round): per point, the median over the processes of each one's median run."""
    _need_gpus(ranks)
    ctx = mp.get_context("spawn")
    queue, start = ctx.SimpleQueue(), ctx.Barrier(ranks)
    mp.start_processes(_layers_worker, args=(model, micro_batches, seqs, repeats, start, queue), nprocs=ranks,
                       join=True, start_method="spawn")
    runs = [queue.get() for _ in range(ranks)]
    samples = [LayerSample(first.layer, first.micro_batch, first.seq,
                           statistics.median(r[k].forward_s for r, _ in runs),
                           statistics.median(r[k].backward_s for r, _ in runs))
               for k, first in enumerate(runs[0][0])]
    return LayersAtOnce(samples, statistics.median(share for _, share in runs))


def slowdown(alone: list[LayerSample], at_once: LayersAtOnce) -> float:
    """How many times slower the layers ran at once than alone.

    Note [slowdown by throughput]: on CPU, processes sharing cores take turns in scheduler slices of a
    few ms, longer than most layers, so a layer timed at once mostly runs whole inside one slice and its
    median hardly moves (4 processes on 2 cores: 1.26x); the turns show as gaps between the layers. What a
    rank loses is its share of the wall clock, the sweep's wall time over its CPU time (one thread a rank:
    the CPU time is the work). On a GPU each process has its own device and the per-layer times are the
    measure: the median over points of the ratio of their forward + backward times."""
    if local_device().type != "cuda":
        return max(1.0, at_once.wall_per_cpu)
    return statistics.median((b.forward_s + b.backward_s) / (a.forward_s + a.backward_s)
                             for a, b in zip(alone, at_once.samples, strict=True))


def _layers_worker(rank: int, model: ModelSpec, micro_batches: list[int], seqs: list[int], repeats: int,
                   start, queue) -> None:
    device = local_device()
    if device.type == "cuda":
        device = torch.device("cuda", rank)     # a GPU each: Note [Only what was measured]
    start.wait()   # every process times its layers over the same stretch of wall time
    wall, cpu = time.perf_counter(), time.process_time()
    samples = time_layers(model, micro_batches, seqs, repeats, lambda _: None, statistics.median, device)
    share = (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-9)
    queue.put((samples, share))


def copy_rates(sizes: list[int], repeats: int) -> list[dict]:
    """Host<->device bytes/s (pinned memory); on CPU, a host memory copy."""
    device = local_device()
    rows = []
    for n in sizes:
        host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
        pairs: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]
        if device.type == "cuda":
            dev = torch.empty(n, dtype=torch.uint8, device=device)
            pairs = (("h2d", dev, host), ("d2h", host, dev))
        else:
            pairs = (("copy", torch.empty_like(host), host),)
        for direction, dst, src in pairs:
            copy = partial(dst.copy_, src, non_blocking=device.type == "cuda")
            rows.append({"direction": direction, "bytes": n, "seconds": _clock(device, copy, repeats)})
    return rows


def comm_rates(ranks: int, sizes: list[int], repeats: int, at_once: int = 1) -> tuple[list[dict], list[dict]]:
    """(collectives, p2p) measured between `ranks` local processes; rows as in the profile file.

    With `at_once` > `ranks` processes (as many as the node runs, Note [shared cores]), every block of
    `ranks` of them runs the same collectives and messages at the same time, and the median run is
    kept (the load is part of the measurement); the collectives over all of them are measured too.
    """
    world = comm_world(ranks, at_once)
    _need_gpus(world)
    queue = mp.get_context("spawn").SimpleQueue()
    with spawned_store(world) as env:
        mp.start_processes(_comm_worker, args=(ranks, world, env, sizes, repeats, queue), nprocs=world, join=True,
                           start_method="spawn")
    return queue.get()


def _need_gpus(processes: int) -> None:
    """On a GPU machine, one GPU per measuring process (Note [Only what was measured]; `measurable`)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < processes:
        raise ValueError(f"{processes} measuring processes need a GPU each; this machine has "
                         f"{torch.cuda.device_count()} (see measurable())")


def _comm_worker(rank: int, ranks: int, world: int, env: dict[str, str], sizes: list[int], repeats: int,
                 queue) -> None:
    use_nccl = torch.cuda.is_available()    # with a GPU per process: _need_gpus
    os.environ.update(env)     # `spawned_store`'s
    dist.init_process_group("nccl" if use_nccl else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if use_nccl else torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(device)
    blocks = [list(range(b, b + ranks)) for b in range(0, world - ranks + 1, ranks)]
    groups = [dist.new_group(b) for b in blocks]     # every process creates every group, in the same order
    pick = min if world == ranks else statistics.median
    group, block = next((g, b) for g, b in zip(groups, blocks) if rank in b)
    collectives, p2p = [], []
    for n in sizes:
        collectives += _collectives(device, n, ranks, group, repeats, pick)
        if world > ranks:
            collectives += _collectives(device, n, world, None, repeats, pick)
        buf = torch.ones(max(n // 4 // ranks * ranks, ranks), device=device)
        p2p.append({"bytes": buf.numel() * 4, "seconds": _ping(rank, block[:2], device, buf, repeats, pick),
                    "backend": dist.get_backend()})
    if rank == 0:
        queue.put((collectives, p2p))
    dist.barrier()
    dist.destroy_process_group()


def _collectives(device, n: int, count: int, group, repeats: int, pick) -> list[dict]:
    elems = max(n // 4 // count * count, count)
    full = torch.ones(elems, device=device)
    part = torch.ones(elems // count, device=device)
    ops = {Collective.ALL_REDUCE: partial(dist.all_reduce, full, group=group),
           Collective.ALL_GATHER: partial(_GATHER, full, part, group=group),
           Collective.REDUCE_SCATTER: partial(_SCATTER, part, full, group=group)}
    rows = []
    for kind, op in ops.items():
        try:
            dist.barrier()
            seconds = _clock(device, op, repeats, pick=pick)
        except (RuntimeError, NotImplementedError):  # gloo lacks some collectives in some builds
            dist.barrier()
            continue
        rows.append({"kind": kind, "ranks": count, "bytes": elems * 4, "seconds": seconds,
                     "backend": dist.get_backend()})
    return rows


def _ping(rank: int, pair: list[int], device: torch.device, buf: torch.Tensor, repeats: int, pick=min) -> float:
    """One-way time: half a round trip between the two ranks of `pair` (this rank's block)."""
    def round_trip():
        if len(pair) < 2 or rank not in pair:
            return
        other = pair[1] if rank == pair[0] else pair[0]
        if rank == pair[0]:
            dist.send(buf, other)
            dist.recv(buf, other)
        else:
            dist.recv(buf, other)
            dist.send(buf, other)
    dist.barrier()
    return _clock(device, round_trip, repeats, pick=pick) / 2
