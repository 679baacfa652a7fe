"""Placement by discovery: which launched process runs which GPU of the plan.

Note [Placement by discovery]
torchrun numbers processes in the order its agents join the rendezvous, so
launch rank r is not the plan's GPU r: on a mixed cluster an 8-GPU node and
a 4-GPU node start in no fixed order. Before any process group exists,
every process writes what it is (host, the agent that started it, local
rank, device and memory, and the plan node it was launched for when
`hetc launch --node` said so) into the rendezvous store and reads everyone
else's. Every process then runs the same pure function `place` on the same
reports, so all agree on the mapping without a further message:

  * processes are grouped into launched nodes (one per agent: host and
    GROUP_RANK, or the `--node` label);
  * a labelled node goes to the plan node it names; the others are matched
    to plan nodes of their process count and device, most demanding plan
    node first, each taking the smallest device that fits (the devices a
    kind accepts are nested by memory, so this greedy order finds a
    matching whenever one exists);
  * inside a node, the plan's GPU `local` runs on the process of that local
    rank (the one `cuda:local` belongs to).

The process group is then created with the plan's ranks (`init_process_group
(rank=plan rank)`), so programs, groups and checkpoints never see launch
order. A process that matches no plan GPU, or a plan GPU no process
matches, is an error every rank raises with the same text, except in an
elastic run, where the plan is made for the nodes present and processes it
leaves out stay idle.

Note [One GPU per rank]
A process that does not know its plan GPU yet takes `cuda:(LOCAL_RANK mod
the devices it sees)` (`local_gpu`): right where each process sees every
GPU of its node (torchrun) and where a launcher shows each process only its
own (CUDA_VISIBLE_DEVICES per task, as SLURM's --gpus-per-task does, where
every process sees one device). Where a node starts more processes than it
has GPUs, two of them land on one GPU; NCCL refuses that deep inside
`init_process_group` ("Duplicate GPU detected"), a traceback naming
neither node nor cause. So every process reports which physical GPU it
took (its UUID) and how many it sees, and `place` refuses, with the ranks,
the node and the device count, any two placed processes of one host that
report the same GPU, before any process group exists.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from typing import TYPE_CHECKING

from hetc.ir.spec import DeviceSpec
from hetc.ir.topology import Gpu

if TYPE_CHECKING:   # torch is imported where a rank needs it: `hetc launch` and `run --local` only label nodes
    import torch

__all__ = ["MEMORY_SLACK", "ClusterMismatch", "Placement", "Process", "discover", "local_gpu", "local_process",
           "node_label", "parse_node_label", "place", "shared_gpu_problems"]

MEMORY_SLACK = 0.9   # a "80 GiB" device reports a little less
PROC_KEY = "hetc/proc/"


class ClusterMismatch(RuntimeError):
    """The launched processes are not the machines the plan was compiled for."""


@dataclass(frozen=True)
class Process:
    """What one launched process reports about itself."""

    launch_rank: int     # RANK as torchrun gave it
    host: str
    agent: str           # the launching agent (host and GROUP_RANK), or the `--node` label
    label: str           # "GROUP[i]" from `hetc launch --node` / `hetc run --local`; "" when unknown
    local_rank: int
    device: str          # "cpu" or the CUDA device name
    memory: float        # bytes of device memory (0 for CPU)
    gpu: str = ""        # the physical GPU's UUID ("" for CPU): Note [One GPU per rank]
    visible: int = 0     # how many CUDA devices this process sees

    def describe(self) -> str:
        return f"launch rank {self.launch_rank} ({self.host}, local rank {self.local_rank}, {self.device})"


@dataclass(frozen=True)
class Placement:
    plan_rank: dict[int, int]      # launch rank -> plan rank
    idle: tuple[int, ...]          # launch ranks the plan leaves out (elastic runs only)
    nodes: dict[str, tuple[str, int]]   # launched node (agent) -> the plan node it runs

    def rank_of(self, launch_rank: int) -> int | None:
        return self.plan_rank.get(launch_rank)


def node_label(group: str, node: int) -> str:
    return f"{group}[{node}]"


def parse_node_label(text: str) -> tuple[str, int] | None:
    """"GROUP[i]" -> (GROUP, i); None when it is not of that form."""
    name, sep, rest = text.partition("[")
    if not sep or not rest.endswith("]") or not name or not rest[:-1].isdigit():
        return None
    return name, int(rest[:-1])


def local_gpu(local_rank: int, visible: int) -> int:
    """The CUDA device index a process of `local_rank` takes among the `visible` devices it sees (Note [One
    GPU per rank]: one each where the node has enough, or the one a per-process CUDA_VISIBLE_DEVICES shows)."""
    return local_rank % visible


def local_process(launch_rank: int, local_rank: int, agent: str, label: str, device: torch.device) -> Process:
    host = socket.gethostname()
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)    # absent from old torch: no check then
        return Process(launch_rank, host, agent, label, local_rank, props.name, float(props.total_memory),
                       str(uuid) if uuid is not None else "", torch.cuda.device_count())
    return Process(launch_rank, host, agent, label, local_rank, "cpu", 0.0)


def discover(store, mine: Process, world: int) -> list[Process]:
    """Every launched process's report, by launch rank (through the rendezvous store)."""
    import torch.distributed as dist

    store.set(f"{PROC_KEY}{mine.launch_rank}", json.dumps(asdict(mine)))
    keys = [f"{PROC_KEY}{r}" for r in range(world)]
    try:
        store.wait(keys)
    except dist.DistStoreError:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise ClusterMismatch(f"launch ranks {missing} of {world} never reported to the rendezvous store "
                              "(are all nodes started, with the same WORLD_SIZE?)") from None
    return [Process(**json.loads(v)) for v in store.multi_get(keys)]


def fit_problem(kind: DeviceSpec, proc: Process) -> str | None:
    """Why `proc` cannot run a GPU of `kind` (None when it can); a `cpu` kind runs anywhere."""
    if kind.is_cpu:
        return None
    if proc.device == "cpu":
        return f"has no GPU, but the plan wants a {kind.name}"
    if proc.memory < MEMORY_SLACK * kind.memory:
        return (f"is a {proc.device} with {proc.memory / 2**30:.0f} GiB, but the plan wants a {kind.name} "
                f"with {kind.memory / 2**30:.0f} GiB")
    return None


def _node_problem(gpus: list[Gpu], procs: list[Process]) -> str | None:
    locals_ = {p.local_rank: p for p in procs}
    for gpu in gpus:
        proc = locals_.get(gpu.local)
        if proc is None:
            return f"has no process of local rank {gpu.local} for {gpu}"
        why = fit_problem(gpu.device, proc)
        if why is not None:
            return f"{proc.describe()} {why}"
    return None


def place(world: Sequence[Gpu], procs: Sequence[Process], elastic: bool = False, partial: bool = False) -> Placement:
    """Map launched processes onto the plan's GPUs `world` (index = plan rank); see Note [Placement by
    discovery]. Raises ClusterMismatch, with every problem, when they do not match; `elastic` lets
    processes idle, `partial` lets plan nodes go without processes (a cluster's nodes, not a plan's)."""
    plan_nodes: dict[tuple[str, int], list[Gpu]] = {}
    for gpu in world:
        plan_nodes.setdefault(gpu.host, []).append(gpu)
    launched: dict[str, list[Process]] = {}
    for proc in sorted(procs, key=lambda p: (p.agent, p.local_rank)):
        launched.setdefault(proc.agent, []).append(proc)
    problems: list[str] = []
    chosen = _match_labelled(plan_nodes, launched, problems, elastic)
    _match_by_device(plan_nodes, launched, chosen)
    taken = set(chosen.values())
    for host, gpus in plan_nodes.items():
        if host not in taken and not partial:
            problems.append(f"no launched node fits the plan's node {node_label(*host)} ({len(gpus)} × "
                            f"{gpus[0].device.name}){_why_not(gpus, launched, chosen)}")
    index = {gpu.id: r for r, gpu in enumerate(world)}
    plan_rank: dict[int, int] = {}
    for agent, host in chosen.items():
        by_local = {p.local_rank: p for p in launched[agent]}
        for gpu in plan_nodes[host]:
            plan_rank[by_local[gpu.local].launch_rank] = index[gpu.id]
    idle = tuple(sorted(p.launch_rank for p in procs if p.launch_rank not in plan_rank))
    if idle and not elastic:
        by_rank = {p.launch_rank: p for p in procs}
        problems += [f"{by_rank[r].describe()} matches no GPU of the plan" for r in idle]
    problems += shared_gpu_problems([p for p in procs if p.launch_rank in plan_rank])
    if problems:
        raise ClusterMismatch("the processes do not match the compiled cluster:\n  " + "\n  ".join(problems))
    return Placement(plan_rank, idle, chosen)


def shared_gpu_problems(procs: Sequence[Process]) -> list[str]:
    """One paragraph for each GPU that two or more of `procs` (the placed ones) would share: Note [One GPU
    per rank]. Processes of a host that report the same GPU UUID are on one device."""
    on_gpu: dict[tuple[str, str], list[Process]] = {}
    for proc in procs:
        if proc.gpu:
            on_gpu.setdefault((proc.host, proc.gpu), []).append(proc)
    problems = []
    for (host, _), sharing in sorted(on_gpu.items(), key=lambda item: item[1][0].launch_rank):
        if len(sharing) < 2:
            continue
        sharing.sort(key=lambda p: p.launch_rank)
        ranks = ", ".join(str(p.launch_rank) for p in sharing)
        local = ", ".join(str(p.local_rank) for p in sharing)
        seen = max(p.visible for p in sharing)
        problems.append(
            f"launch ranks {ranks} (local ranks {local} on {host}) would share one GPU ({sharing[0].device} "
            f"{sharing[0].gpu}): each sees {seen} CUDA device{'s' if seen != 1 else ''}, and NCCL runs one rank "
            f"per GPU. Start at most {seen} process{'es' if seen != 1 else ''} on {host} (torchrun "
            f"--nproc-per-node {seen}), compile for the GPUs it has, or give each process its own GPU "
            "(CUDA_VISIBLE_DEVICES)")
    return problems


def _match_labelled(plan_nodes, launched, problems: list[str], elastic: bool) -> dict[str, tuple[str, int]]:
    """Launched nodes named by `--node` onto those plan nodes (in an elastic run a node the plan
    leaves out idles)."""
    chosen: dict[str, tuple[str, int]] = {}
    for agent, procs in launched.items():
        label = procs[0].label
        if not label:
            continue
        node = parse_node_label(label)
        if node is None or node not in plan_nodes:
            if not elastic:
                problems.append(f"{procs[0].host} was launched as node {label}, which the plan does not use")
        elif node in chosen.values():
            problems.append(f"two launched nodes claim the plan's node {label}")
        elif (why := _node_problem(plan_nodes[node], procs)) is not None:
            problems.append(f"node {label} {why}")
        else:
            chosen[agent] = node
    return chosen


def _match_by_device(plan_nodes, launched, chosen: dict[str, tuple[str, int]]) -> None:
    """Unlabelled launched nodes onto the plan nodes left: see Note [Placement by discovery]."""
    free_agents = sorted((a for a, procs in launched.items() if not procs[0].label),
                         key=lambda a: (min(p.memory for p in launched[a]), a))
    todo = (h for h in plan_nodes if h not in chosen.values())
    for host in sorted(todo, key=lambda h: -_memory_needed(plan_nodes[h])):
        gpus = plan_nodes[host]
        fits = [a for a in free_agents if _node_problem(gpus, launched[a]) is None]
        exact = [a for a in fits if len(launched[a]) == len(gpus)]
        pick = (exact or fits or [None])[0]
        if pick is not None:
            chosen[pick] = host
            free_agents.remove(pick)


def _memory_needed(gpus: list[Gpu]) -> float:
    return max((g.device.memory for g in gpus if not g.device.is_cpu), default=0.0)


def _why_not(gpus: list[Gpu], launched, chosen) -> str:
    left = [a for a in launched if a not in chosen]
    if not left:
        return ": no launched node is left for it"
    return ": " + "; ".join(f"{launched[a][0].host} ({len(launched[a])} processes) "
                            f"{_node_problem(gpus, launched[a])}" for a in left)
