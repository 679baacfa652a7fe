"""Compile-and-verify time for 64, 256 and 1024 ranks; writes docs/benchmarks.md "Compile and verify".

    .venv/bin/python benchmarks/compile.py [--runs 3] [--ranks 64 256 1024] [--no-write]

Plans: 8 pipeline stages x (ranks / 8) lanes of H100s, 4 microbatches per
lane, a 14-block Llama; two policies — 1F1B with ZeRO-1, and Zorse with
two ministages per stage, ZeRO-3 and parameter + activation offload (the
longest programs). Phases, best of `--runs` (the 2 CPU cores are shared, so
the minimum is the least disturbed run):

- *check*: parse, validate and resolve the spec;
- *lower*: every lowering pass;
- *verify*: dataflow, protocol (joint simulation of every rank) and memory;
- *compile+verify*: the three together — what the issue bounds by 10 s;
- *hetc compile*: the whole command, also predicting the timeline and
  writing the plan directory (one listing and one JSON file per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish
from hetc.cli import main as hetc_main
from hetc.compiler import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.verify import verify

HEADING = "## Compile and verify"
NUM_STAGES = 8
PER_LANE = 4
GPUS_PER_NODE = 8
POLICIES = {
    "1F1B, ZeRO-1": "  schedule = 1f1b\n  zero = 1\n",
    "Zorse, ZeRO-3, offload": "  schedule = zorse\n  zero = 3\n  prefetch = 1\n"
                              "  offload {\n    params = cpu\n    activations = cpu\n  }\n",
}


def plan_text(ranks: int, policy: str) -> str:
    lanes, layers = ranks // NUM_STAGES, 2 * NUM_STAGES - 2
    nodes_per_stage = ranks // GPUS_PER_NODE // NUM_STAGES
    ministages = 2 if "Zorse" in policy else 1
    names = ["embed"] + [f"block{i}" for i in range(layers)] + ["head"]
    stages = []
    for s in range(NUM_STAGES):
        first, last = 2 * s, 2 * s + 1
        stages.append(f"  stage s{s} {{\n    layers = {names[first]}..{names[last]}\n"
                      f"    ranks = n[{s * nodes_per_stage}:{(s + 1) * nodes_per_stage}]\n"
                      f"    lanes = {lanes}\n    ministages = {ministages}\n  }}\n")
    return (f'use "{(ROOT / "specs" / "catalog.het").as_posix()}"\n\n'
            f"model bench {{\n  arch = llama\n  layers = {layers}\n  hidden = 1024\n  heads = 16\n  kv_heads = 8\n"
            f"  ffn = 2816\n  vocab = 32000\n  seq = 1024\n  dtype = bf16\n  optimizer adamw {{}}\n}}\n\n"
            f"cluster bench {{\n  node n {{\n    device = H100\n    count = {ranks // GPUS_PER_NODE}\n"
            f"    gpus = {GPUS_PER_NODE}\n  }}\n}}\n\n"
            f"train {{\n  global_batch = {lanes * PER_LANE}\n  micro_batch = 1\n  steps = 1\n}}\n\n"
            f"parallel {{\n{POLICIES[policy]}{''.join(stages)}}}\n")


def timed_call(fn):
    """(what `fn()` returns, its wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure_once(path: Path, out_dir: Path) -> dict:
    (_, checked), check_s = timed_call(lambda: load_checked(path, require_complete=True))
    program, lower_s = timed_call(lambda: lower(checked.explicit()))
    costs = CostModel(checked.explicit())
    _, verify_s = timed_call(lambda: verify(program, checked.explicit(), costs))
    with contextlib.redirect_stdout(io.StringIO()):
        code, cli_s = timed_call(lambda: hetc_main(["compile", str(path), "-o", str(out_dir)]))
    if code != 0:
        raise SystemExit(f"hetc compile {path} failed ({code})")
    return {"instructions": sum(len(r.instrs) for r in program.ranks), "check_s": check_s, "lower_s": lower_s,
            "verify_s": verify_s, "cli_s": cli_s}


def measure(ranks: int, policy: str, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"bench{ranks}.het"
        path.write_text(plan_text(ranks, policy))
        samples = [measure_once(path, Path(tmp) / "plan") for _ in range(runs)]
    best = {key: min(s[key] for s in samples) for key in samples[0]}
    best["total_s"] = min(s["check_s"] + s["lower_s"] + s["verify_s"] for s in samples)
    return {"ranks": ranks, "policy": policy, **best}


def section(results: list[dict], runs: int) -> str:
    rows = "\n".join(
        f"| {m['ranks']} | {m['policy']} | {m['instructions']:,} | {m['check_s']:.2f} s | {m['lower_s']:.2f} s | "
        f"{m['verify_s']:.2f} s | **{m['total_s']:.2f} s** | {m['cli_s']:.2f} s |" for m in results)
    return f"""{HEADING}

`benchmarks/compile.py`: 8 pipeline stages x (ranks / 8) lanes, {PER_LANE} microbatches per lane,
a 14-block Llama on H100 nodes of {GPUS_PER_NODE}; best of {runs} runs on 2 shared CPU cores.
*compile+verify* is check + lower + verify (dataflow, protocol, memory); *hetc compile* is
the whole command, which also predicts the timeline and writes one listing and one JSON
file per rank. The issue's bound: compile+verify of 1024 ranks under 10 s.

| ranks | plan | instructions | check | lower | verify | compile+verify | hetc compile |
|---|---|---|---|---|---|---|---|
{rows}
"""


def parse_sizes(doc: str, ranks: list[int]) -> argparse.Namespace:
    """--runs, --ranks (multiples of a node per stage; default `ranks`) and --no-write, of a benchmark of
    these plans."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=ranks)
    parser.add_argument("--no-write", action="store_true", help="print, do not update docs/benchmarks.md")
    args = parser.parse_args()
    bad = [r for r in args.ranks if r % (NUM_STAGES * GPUS_PER_NODE)]
    if bad:
        parser.error(f"ranks must be multiples of {NUM_STAGES * GPUS_PER_NODE}: {bad}")
    return args


def main() -> int:
    args = parse_sizes(__doc__, [64, 256, 1024])
    results = [measure(ranks, policy, args.runs) for ranks in args.ranks for policy in POLICIES]
    text = section(results, args.runs)
    return publish(HEADING, text, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
