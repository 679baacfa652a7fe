"""Check, at start, that the processes are the machines the plan was compiled for.

Every rank reports (host, local rank, device, device memory); rank r must
be what the plan's GPU r is: a CUDA device of at least (nearly) the kind's
memory, or a CPU process for a `cpu` kind. Ranks the plan puts on one node
must share a host. A mismatch is a clear error on every rank.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetc.pipeline import Pipeline

__all__ = ["ClusterMismatch", "ProcessInfo", "check_cluster", "local_info"]

MEMORY_SLACK = 0.9   # a "80 GiB" device reports a little less


class ClusterMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class ProcessInfo:
    host: str
    local_rank: int
    device: str          # "cpu" or the CUDA device name
    memory: float        # bytes of device memory (0 for CPU)




def local_info(local_rank: int, device: torch.device) -> ProcessInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return ProcessInfo(socket.gethostname(), local_rank, props.name, float(props.total_memory))
    return ProcessInfo(socket.gethostname(), local_rank, "cpu", 0.0)


def check_cluster(pipeline: Pipeline, mine: ProcessInfo) -> list[ProcessInfo]:
    infos: list = [None] * dist.get_world_size()
    dist.all_gather_object(infos, mine)
    problems = []
    for rank, (gpu, info) in enumerate(zip(pipeline.world, infos)):
        kind = gpu.device
        if kind.is_cpu:
            continue
        if info.device == "cpu":
            problems.append(f"rank {rank} on {info.host} has no GPU, but the plan puts a {kind.name} there")
        elif info.memory < MEMORY_SLACK * kind.memory:
            problems.append(f"rank {rank} on {info.host} is a {info.device} with {info.memory / 2**30:.0f} GiB, "
                            f"but the plan expects a {kind.name} with {kind.memory / 2**30:.0f} GiB")
    hosts: dict = {}
    for rank, (gpu, info) in enumerate(zip(pipeline.world, infos)):
        if gpu.device.is_cpu:
            continue
        hosts.setdefault(gpu.host, set()).add(info.host)
    for node, seen in hosts.items():
        if len(seen) > 1:
            problems.append(f"the plan's node {node[0]}[{node[1]}] spans hosts {sorted(seen)}; launch one "
                            "node's ranks on one host")
    if problems:
        raise ClusterMismatch("the processes do not match the compiled cluster:\n  " + "\n  ".join(problems))
    return infos
