"""One rank of a 1-rank plan, in this process, for benchmarks/gpu_check.py: what `hetc run` cannot report.

    python benchmarks/gpu_check_rank.py PLAN_DIR RESULT_JSON [--steps N] [--metrics FILE] [--profile-trace]

Runs `hetc run PLAN_DIR` through hetc.cli.main as rank 0 of 1 (the environment torchrun would give it),
then writes RESULT_JSON: the exit status, CUDA's peak allocated and reserved bytes (`hetc run --metrics`
records only the allocated peak), and with `--profile-trace` the share of the device's copy time that
ran while a kernel computed (Note [copy overlap]).

Note [copy overlap]: torch.profiler's Chrome trace lists the device's work as events of category
`kernel` (compute) and `gpu_memcpy` (host<->device copies, the offload and prefetch traffic), each
with a start and a duration in microseconds. The hidden share is |copies ∩ kernels| / |copies| over
the union of each kind's intervals: 1 when every copy ran under compute, 0 when compute waited for
every copy. On a CPU rank there are no device events, and the share is None.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hetc.cli import main as hetc_main

__all__ = ["copy_overlap", "hidden_share", "union"]

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they touch or overlap, in order."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _measure(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[Interval], b: list[Interval]) -> float:
    """The length both unions cover (each a sorted, disjoint list)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden_share(copies: Iterable[Interval], compute: Iterable[Interval]) -> float | None:
    """The share of the copies' time that compute covers (Note [copy overlap]); None without copies."""
    copy_union = union(copies)
    if not copy_union:
        return None
    return _intersection(copy_union, union(compute)) / _measure(copy_union)


def copy_overlap(trace: dict[str, Any]) -> dict[str, float | None]:
    """The hidden share and the copy and kernel seconds of a torch.profiler Chrome trace."""
    spans: dict[str, list[Interval]] = {"gpu_memcpy": [], "kernel": []}
    for event in trace.get("traceEvents", []):
        kind = event.get("cat")
        if kind in spans and "dur" in event:
            spans[kind].append((float(event["ts"]), float(event["ts"]) + float(event["dur"])))
    return {"hidden_share": hidden_share(spans["gpu_memcpy"], spans["kernel"]),
            "copy_s": _measure(union(spans["gpu_memcpy"])) * 1e-6,
            "kernel_s": _measure(union(spans["kernel"])) * 1e-6}


def _as_rank_zero() -> None:
    """The environment torchrun gives the one process of a 1-rank job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _run(argv: list[str], profile: bool) -> tuple[int, dict[str, float | None]]:
    if not profile:
        return hetc_main(argv), {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        status = hetc_main(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return status, copy_overlap(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("plan_dir", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--metrics", type=Path, default=None)
    ap.add_argument("--profile-trace", action="store_true", help="measure the copy overlap with torch.profiler")
    args = ap.parse_args(argv)
    _as_rank_zero()
    run = ["run", str(args.plan_dir), "--quiet"]
    run += ["--steps", str(args.steps)] if args.steps else []
    run += ["--metrics", str(args.metrics)] if args.metrics else []
    status, overlap = _run(run, args.profile_trace)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    result = {"status": status, "cuda": cuda,
              "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None,
              "max_memory_reserved": torch.cuda.max_memory_reserved() if cuda else None, **overlap}
    args.result.write_text(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
