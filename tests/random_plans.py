"""Random explicit plans, for property tests of lowering, the verifier and the runtime.

`random_plan(rng)` writes a plan of the 16-rank test job that the front-end
may accept or reject: 1–4 stages over contiguous layers, any lane count that
divides the stage's GPUs (tp 1 or 2, or one given), 1–3 ministages, uneven microbatch
routing, every schedule kind, ZeRO 0–3 (flat or hierarchical), parameter
and activation offload, prefetch depth, and gradient clipping.

`random_demo_plan(rng, job)` writes one of a demo job on its 4 CPU ranks (two
nodes of two), small enough to run: 1–4 stages of any split of the ranks
(idle ones left over), tp and cp 2 where a stage's ranks allow, sequence
parallelism, expert parallelism on a MoE job, uneven routing, ministages,
activation checkpointing and offload, hierarchical ZeRO over even and uneven
nodes. Running such plans against the 1-rank reference found two plans that
compiled and verified but stopped the runtime (hierarchical ZeRO over
uneven nodes, and on a stage of one node).

`random_chunks_plan(rng, job)` writes interleaved 1F1B over 2-4 stages of
contiguous chunks (`ministages` of a run of layers): a later stage runs a
chunk for its whole group before the next (Note [chunks after a stage] in
passes/cost/memory.py), which `random_demo_plan`'s looping chunks never do.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from tests.plans import TEST_SPECS

__all__ = ["random_chunks_plan", "random_demo_plan", "random_plan"]

LAYERS = ["embed"] + [f"block{i}" for i in range(14)] + ["head"]   # the model of tests/specs/job16.het
GPUS_PER_NODE = 4
STAGE_GPUS = {1: [16], 2: [8, 8], 3: [4, 8, 4], 4: [4, 4, 4, 4]}
KINDS = ["gpipe", "1f1b", "interleaved", "zb", "zorse"]


def _gpu(g: int) -> str:
    return f"n[{g // GPUS_PER_NODE}, {g % GPUS_PER_NODE}]"


def _zero(rng: random.Random, level: int) -> list[str]:
    if rng.random() < 0.6:
        return [f"  zero = {level}"]
    return ["  zero {", f"    level = {level}", "    shard = node", f"    across = {rng.choice([0, 1])}", "  }"]


def _stage(rng: random.Random, s: int, gpus: list[int], first: int, stop: int, idle: list[int],
           tp: int | None) -> list[str]:
    if tp is None:
        tp = rng.choice([1, 1, 2]) if len(gpus) % 2 == 0 else 1
    lanes = rng.choice([d for d in (1, 2, 4, 8, 16) if d <= len(gpus) // tp and (len(gpus) // tp) % d == 0])
    used = lanes * tp
    idle += gpus[used:]
    lines = [f"  stage s{s} {{", f"    layers = {LAYERS[first]}..{LAYERS[stop - 1]}",
             f"    ranks = [{', '.join(_gpu(g) for g in gpus[:used])}]", f"    lanes = {lanes}", f"    tp = {tp}",
             f"    ministages = {rng.choice([m for m in (1, 2, 3) if m <= stop - first])}"]
    if lanes > 1 and rng.random() < 0.5:
        counts = [1] * lanes
        for _ in range(16 - lanes):
            counts[rng.randrange(lanes)] += 1
        lines.append(f"    microbatches = [{', '.join(map(str, counts))}]")
    return lines + ["  }"]


def random_plan(rng: random.Random, tp: int | None = None) -> str:
    """The text of a whole plan importing tests/specs/job16.het (global batch 16, micro-batch 1); `tp`: every
    stage's (else 1 or 2 at random)."""
    num_stages = rng.choice([1, 2, 3, 4])
    bounds = [0, *sorted(rng.sample(range(1, len(LAYERS)), num_stages - 1)), len(LAYERS)]
    job = "job16_clip.het" if rng.random() < 0.3 else "job16.het"
    lines = [f'use "{(TEST_SPECS / job).as_posix()}"', "", "parallel {", f"  schedule = {rng.choice(KINDS)}",
             *_zero(rng, rng.choice([0, 1, 2, 3])), f"  prefetch = {rng.choice([1, 2])}"]
    if rng.random() < 0.3:
        lines += ["  offload {", f"    params = {rng.choice(['cpu', 'none'])}",
                  f"    activations = {rng.choice(['cpu', 'none'])}", "  }"]
    start, idle = 0, []
    for s, size in enumerate(STAGE_GPUS[num_stages]):
        lines += _stage(rng, s, list(range(start, start + size)), bounds[s], bounds[s + 1], idle, tp)
        start += size
    if idle:
        lines.append(f"  idle = [{', '.join(_gpu(g) for g in idle)}]")
    return "\n".join(lines + ["}"]) + "\n"


DEMO_UNITS = ["embed", "block0", "block1", "block2", "block3", "head"]   # the demo jobs' 4-block models
DEMO_GPUS = ["host[0, 0]", "host[0, 1]", "host[1, 0]", "host[1, 1]"]
DEMO_SPLITS = {1: [[4], [2], [1]], 2: [[2, 2], [1, 1], [1, 3], [3, 1], [1, 2], [2, 1]],
               3: [[1, 1, 2], [2, 1, 1], [1, 2, 1], [1, 1, 1]], 4: [[1, 1, 1, 1]]}   # ranks per stage
DEMO_INTERLEAVED = [["embed..block0", "block2"], ["block1", "block3..head"]]


def random_chunks_plan(rng: random.Random, job: Path) -> str:
    """The text of a plan of the demo job `job` under interleaved 1F1B, each stage 1-3 contiguous chunks."""
    stages = rng.choice([2, 3, 4])
    sizes = rng.choice(DEMO_SPLITS[stages])
    layers = _demo_layers(rng, stages)
    lines = [f'use "{job.as_posix()}"', "", "parallel {", "  schedule = interleaved", *_demo_zero(rng, sum(sizes) == 4)]
    start = 0
    for s, size in enumerate(sizes):
        stage = [line for line in _demo_stage(rng, s, DEMO_GPUS[start:start + size], layers[s], "moe" in job.name)
                 if "ministages" not in line]
        stage.insert(-1, f"    ministages = {rng.randint(1, min(3, _units(layers[s][0])))}")
        lines += stage
        start += size
    if start < len(DEMO_GPUS):
        lines.append(f"  idle = [{', '.join(DEMO_GPUS[start:])}]")
    return "\n".join(lines + ["}"]) + "\n"


def _units(layers: str) -> int:
    """How many of the demo model's units a range `lo..hi` (or one unit) holds."""
    ends = layers.split("..")
    return DEMO_UNITS.index(ends[-1]) - DEMO_UNITS.index(ends[0]) + 1


def _demo_zero(rng: random.Random, whole: bool) -> list[str]:
    """The plan's ZeRO line(s); hierarchical only where the plan uses every rank (both nodes)."""
    level = rng.choice([0, 0, 1, 2, 3])
    if level and whole and rng.random() < 0.2:
        return ["  zero {", f"    level = {level}", "    shard = node", f"    across = {rng.choice([0, 1])}", "  }"]
    return [f"  zero = {level}"] if level else []


def _demo_layers(rng: random.Random, stages: int) -> list[list[str]]:
    """Each stage's layer ranges: contiguous runs of the units."""
    cuts = [0, *sorted(rng.sample(range(1, len(DEMO_UNITS)), stages - 1)), len(DEMO_UNITS)]
    return [[f"{DEMO_UNITS[lo]}..{DEMO_UNITS[hi - 1]}" if hi - lo > 1 else DEMO_UNITS[lo]]
            for lo, hi in itertools.pairwise(cuts)]


def _demo_stage(rng: random.Random, s: int, gpus: list[str], ranges: list[str], moe: bool) -> list[str]:
    tp = rng.choice([1, 2]) if len(gpus) % 2 == 0 else 1
    cp = 2 if (len(gpus) // tp) % 2 == 0 and rng.random() < 0.2 else 1
    lanes = len(gpus) // (tp * cp)
    layers = ranges[0] if len(ranges) == 1 else f"[{', '.join(ranges)}]"
    lines = [f"  stage s{s} {{", f"    layers = {layers}", f"    ranks = [{', '.join(gpus)}]", f"    lanes = {lanes}"]
    lines += [f"    tp = {tp}"] if tp > 1 else []
    lines += [f"    cp = {cp}", f"    cp_kind = {rng.choice(['ring', 'ulysses'])}"] if cp > 1 else []
    lines += ["    sequence_parallel = true"] if tp > 1 and rng.random() < 0.5 else []
    units = sum(_units(r) for r in ranges)
    if len(ranges) == 1 and rng.random() < 0.3:
        lines.append(f"    ministages = {rng.choice([m for m in (1, 2, 3) if m <= units])}")
    if lanes > 1 and rng.random() < 0.4:
        counts = [1] * lanes
        for _ in range(4 - lanes):
            counts[rng.randrange(lanes)] += 1
        lines.append(f"    microbatches = [{', '.join(map(str, counts))}]")
    if rng.random() < 0.25:
        lines.append(f"    activation_checkpoint = {rng.choice(['selective', 'full'])}")
    if moe and lanes % 2 == 0 and rng.random() < 0.6:
        lines.append("    ep = 2")
    return lines + ["  }"]


def random_demo_plan(rng: random.Random, job: Path) -> str:
    """The text of a whole plan importing the demo job `job` (module docstring)."""
    schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb", "zorse", None])
    stages = 2 if schedule == "interleaved" else rng.choice([1, 2, 2, 3, 4])
    sizes = rng.choice(DEMO_SPLITS[stages])
    lines = [f'use "{job.as_posix()}"', "", "parallel {"] + ([f"  schedule = {schedule}"] if schedule else [])
    lines += _demo_zero(rng, sum(sizes) == len(DEMO_GPUS))
    lines += [f"  prefetch = {rng.choice([1, 2])}"] if rng.random() < 0.3 else []
    if rng.random() < 0.25:
        kinds = rng.sample(["params", "activations", "optimizer"], rng.randint(1, 2))
        lines += ["  offload {", *(f"    {k} = cpu" for k in kinds), "  }"]
    layers = DEMO_INTERLEAVED if schedule == "interleaved" else _demo_layers(rng, stages)
    start = 0
    for s, size in enumerate(sizes):
        lines += _demo_stage(rng, s, DEMO_GPUS[start:start + size], layers[s], "moe" in job.name)
        start += size
    if start < len(DEMO_GPUS):
        lines.append(f"  idle = [{', '.join(DEMO_GPUS[start:])}]")
    return "\n".join(lines + ["}"]) + "\n"
