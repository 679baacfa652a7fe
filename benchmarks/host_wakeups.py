"""What a blocking gloo call costs on this machine, by where its processes run. Writes docs/benchmarks.md
"Host wake-ups".

    .venv/bin/python benchmarks/host_wakeups.py [--rounds 3] [--calls 300] [--no-write]

Why: `hetc run --local` of the 4-rank demo plans puts four single-thread
ranks on this machine's two cores, and docs/benchmarks.md "Runtime
prediction" misses most of them. This measures the blocking calls alone, as
those ranks make them: four processes in two pairs (0-1, 2-3), each pair
calling its own group, in three placements: the operating system's choice;
each pair on one core (ranks 0 and 1 on core 0); each pair across the cores
(ranks 0 and 2 on core 0). Per placement and round, the median over the
ranks of their mean time per iteration of

- a ping-pong (send then receive 16 KiB, the partner the reverse): two
  wake-ups of a sleeping process per iteration, nothing else running;
- an all-reduce of 16 KiB over the pair, back to back;
- one forward-sized matmul loop (`--work` 256x256 matmuls) then that
  all-reduce: the pattern of a tensor-parallel layer, with the other pair
  computing beside it;
- the same matmul loop alone, no call: compute at four processes on two
  cores.

Rounds run minutes apart show how much the same call moves on its own. The
machine's facts that set it are printed beside: the kernel's command line
(a virtual machine's idle-halt polling) and the CPU time the hypervisor
stole while the benchmark ran (/proc/stat).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish
from hetc.runtime.host_load import cpu_times, steal_share

HEADING = "## Host wake-ups"
RANKS = 4
PLACEMENTS = {"scheduler's": None, "pair on one core": (0, 0, 1, 1), "pair across cores": (0, 1, 0, 1)}
LOOPS = ("ping-pong", "all-reduce", "matmuls + all-reduce", "matmuls alone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, cores: tuple[int, ...] | None, calls: int, work: int, out: mp.SimpleQueue) -> None:
    if cores is not None:
        os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, peer = pairs[rank // 2], rank ^ 1
    buf, a = torch.zeros(4096), torch.randn(256, 256)
    means = {}
    for loop in LOOPS:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            if loop.startswith("matmuls"):
                for _ in range(work):
                    a @ a
            if loop == "ping-pong":
                first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
                first(buf, peer, group=group)
                second(buf, peer, group=group)
            elif loop != "matmuls alone":
                dist.all_reduce(buf, group=group)
        means[loop] = (time.perf_counter() - start) / calls
    out.put((rank, means))
    dist.destroy_process_group()


def measure(cores: tuple[int, ...] | None, calls: int, work: int) -> dict[str, float]:
    """Per loop: the median over the ranks of their mean seconds per iteration."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, cores, calls, work, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return {loop: statistics.median(means[loop] for _, means in got) for loop in LOOPS}


def render(rounds: list[dict[str, dict[str, float]]], steal: float | None, work: int, calls: int) -> str:
    cmdline = Path("/proc/cmdline").read_text().split() if Path("/proc/cmdline").is_file() else []
    halt = [w for w in cmdline if "halt" in w or w.startswith("nested")]
    intro = (f"`benchmarks/host_wakeups.py`, {datetime.date.today().isoformat()}: four single-thread processes "
             f"on this machine's {len(os.sched_getaffinity(0))} cores in two pairs, each pair calling its own "
             f"gloo group; {calls} iterations a loop, {len(rounds)} rounds, the placements in turn within each "
             f"round. Milliseconds per iteration, the median over the ranks (rounds separated by /). "
             f"`{work}` 256x256 matmuls stand for a layer's forward. "
             f"Kernel command line: {' '.join(f'`{w}`' for w in halt) or 'no idle-halt settings'}. "
             + ("" if steal is None else f"Steal time while it ran: {steal:.1%} of the CPUs' time."))
    lines = [HEADING, "", intro, "", "| placement | " + " | ".join(LOOPS) + " |",
             "|---|" + "---:|" * len(LOOPS)]
    for name in PLACEMENTS:
        cells = [" / ".join(f"{r[name][loop] * 1e3:.2f}" for r in rounds) for loop in LOOPS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--work", type=int, default=5, help="matmuls per iteration in the compute loops")
    ap.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("host_wakeups: needs two cores to place the pairs on")
    ticks = cpu_times()
    rounds = []
    for i in range(args.rounds):
        rounds.append({name: measure(cores, args.calls, args.work) for name, cores in PLACEMENTS.items()})
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return publish(HEADING, render(rounds, steal_share(ticks, cpu_times()), args.work, args.calls),
                   not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
