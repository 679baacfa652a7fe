"""`hetc plan` + `hetc compile` of a realistic heterogeneous job as the cluster grows; writes docs/benchmarks.md
"Compile at scale".

    .venv/bin/python benchmarks/compile_scale.py [--gpus 1024 4096] [--max-memory 12GiB] [--no-write]

The job of issue 31: a Llama-70B-class model (80 blocks, hidden 8,192, GQA 64/8, sequence 8k, bf16) on
half H100, a quarter A100-40 and a quarter L4 nodes of 8 GPUs, the L4s in a second region, 2,048
sequences a step. Each size is planned (`hetc plan`, its default time limit) and the plan compiled
(`hetc compile --max-memory`, verified), each command in a process of its own: wall time and peak
resident memory of the whole command (the kernel's account of the child), and the instructions the plan
directory holds. A compile that passes the budget stops with its message (hetc/membudget.py), recorded
with the phase it reached, instead of the machine's memory being exhausted: issue 31 measured a
4,096-GPU compile killed by the kernel at 23 GB.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish

HEADING = "## Compile at scale"
GPUS_PER_NODE = 8


def job_text(gpus: int) -> str:
    nodes = gpus // GPUS_PER_NODE
    h100, a100 = nodes // 2, nodes // 4
    l4 = nodes - h100 - a100
    return f'''use "{(ROOT / "specs" / "catalog.het").as_posix()}"

model llama70b {{
  arch = llama
  layers = 80
  hidden = 8192
  heads = 64
  kv_heads = 8
  ffn = 28672
  vocab = 128256
  seq = 8192
  dtype = bf16
  optimizer adamw {{}}
}}

cluster mixed {{
  node h100 {{
    device = H100
    count = {h100}
    gpus = {GPUS_PER_NODE}
    region = east
  }}
  node a100 {{
    device = A100-40
    count = {a100}
    gpus = {GPUS_PER_NODE}
    region = east
  }}
  node l4 {{
    device = L4
    count = {l4}
    gpus = {GPUS_PER_NODE}
    region = west
  }}
  link east <-> west {{
    bandwidth = 12.5 GB/s
    latency = 30 ms
  }}
}}

train {{
  global_batch = 2048
  micro_batch = 1
}}
'''


def timed(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """(the finished `hetc argv`, wall seconds, peak RSS in bytes: the child's VmHWM, read as it runs)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hetc", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, _high_water(proc.pid))
        time.sleep(0.1)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.perf_counter() - start, peak


def _high_water(pid: int) -> float:
    """A process's peak resident set so far (/proc/PID/status VmHWM), in bytes; 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    got = re.search(r"VmHWM:\s+(\d+) kB", status)
    return float(got[1]) * 1024 if got else 0.0


def measure(gpus: int, budget: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job, planned, out = Path(tmp) / "job.het", Path(tmp) / "planned.het", Path(tmp) / "plan"
        job.write_text(job_text(gpus))
        plan, plan_s, plan_rss = timed(["plan", str(job), "-o", str(planned)])
        if plan.returncode != 0:
            return {"gpus": gpus, "plan": f"failed: {plan.stderr.strip().splitlines()[-1][:200]}"}
        comp, comp_s, comp_rss = timed(["compile", str(planned), "-o", str(out), "--max-memory", budget])
        row = {"gpus": gpus, "plan_s": plan_s, "plan_rss": plan_rss, "compile_s": comp_s, "compile_rss": comp_rss,
               "plan": next((line for line in plan.stdout.splitlines() if "ranks" in line), "")[:160]}
        if comp.returncode == 0:
            summary = json.loads((out / "summary.json").read_text())
            row.update(instructions=summary["instructions"], ranks=summary["ranks"],
                       microbatches=summary["microbatches"], classes=_classes(comp.stderr))
        else:
            stopped = re.search(r"stopped \(([^)]*)\)", comp.stderr)
            row["stopped"] = stopped[1] if stopped else comp.stderr.strip().splitlines()[-1][:200]
        return row


def _classes(progress: str) -> int:
    """The classes compile lowered the ranks in (its progress line `lowered N ranks in K classes`, Note
    [lowering by class] in passes/lower/classes.py)."""
    got = re.search(r"lowered [\d,]+ ranks in ([\d,]+) classes", progress)
    return int(got[1].replace(",", "")) if got else 0


def render(rows: list[dict], budget: str) -> str:
    lines = []
    for r in rows:
        if "plan_s" not in r:
            lines.append(f"| {r['gpus']:,} | {r['plan']} | | | |")
            continue
        if "instructions" in r:
            idle = re.search(r"\(idle: ([^)]*)\)", r["plan"])
            got = f"{r['instructions']:,} instructions, {r['ranks']:,} ranks in {r['classes']:,} classes" + \
                (f" (idle: {idle[1]})" if idle else "")
        else:
            got = f"**stopped at --max-memory {budget}** ({r['stopped']})"
        lines.append(f"| {r['gpus']:,} | {r['plan_s']:.1f} s, {r['plan_rss'] / 2**30:.2f} GiB | "
                     f"{r['compile_s']:.1f} s, {r['compile_rss'] / 2**30:.2f} GiB | {got} |")
    rows_text = "\n".join(lines)
    whole = "; ".join(f"{r['gpus']:,} GPUs {r['plan_s'] + r['compile_s']:.1f} s, "
                      f"{max(r['plan_rss'], r['compile_rss']) / 2**30:.2f} GiB" for r in rows if "instructions" in r)
    return f"""{HEADING}

`benchmarks/compile_scale.py`: issue 31's job, a Llama-70B-class model (80 blocks, sequence 8k, bf16) on
half H100, a quarter A100-40 and a quarter L4 (a second region, 12.5 GB/s, 30 ms), 2,048 sequences a
step; `hetc plan`, then `hetc compile --max-memory {budget}` of its plan, each a process of its own on
this 2-core machine (wall time, peak resident memory). Where a compile would pass the budget it stops
with a message naming its phase instead of being killed. Compile lowers one representative per class
of alike ranks (Note [lowering by class] in passes/lower/classes.py) and verifies every rank. Idle: the
node groups the planner left out (where they would slow the step). Plan and compile together (issue 31
bounds 16,384 GPUs by 60 s and 4 GiB, 131,072 by 10 minutes and 16 GiB):
{whole}.

| GPUs | hetc plan | hetc compile | plan directory |
|---|---|---|---|
{rows_text}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--max-memory", default="12GiB", help="the compile's budget (default 12GiB)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    rows = []
    for gpus in args.gpus:
        rows.append(measure(gpus, args.max_memory))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return publish(HEADING, render(rows, args.max_memory), not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
