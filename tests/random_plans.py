"""Random explicit plans on the 16-rank test job, for property tests of lowering and the verifier.

`random_plan(rng)` writes the `parallel` block of a plan that the front-end
may accept or reject: 1–4 stages over contiguous layers, any lane count that
divides the stage's GPUs (tp 1 or 2, or one given), 1–3 ministages, uneven microbatch
routing, every schedule kind, ZeRO 0–3 (flat or hierarchical), parameter
and activation offload, prefetch depth, and gradient clipping.
"""

from __future__ import annotations

import random

from tests.plans import TEST_SPECS

__all__ = ["random_plan"]

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
