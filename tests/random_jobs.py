"""Random heterogeneous training jobs with the plan left to the planner, for the agreement test.

`random_job(rng, max_gpus)` writes a whole spec: 2-4 device kinds of the
catalog, node groups of 1-2 nodes with 2-8 GPUs each, slow links between
some groups, a dense Llama-style model of 125 M to 70 B parameters,
sequence 1k-8k, activation checkpointing, and `schedule = auto` (sometimes
a fixed schedule or ZeRO level) so the planner chooses the rest.

`deep_job(rng)` writes a whole plan instead, of the shape Sailor's measured
Megatron-DeepSpeed runs have and the planner seldom picks on small clusters
(issue 32, 2): 4-16 stages, 32-256 microbatches a lane, TP 2-8 inside a
node, one or two lanes, on one or two device kinds; a small model, so that
its programs (one a rank, two compute ops a microbatch) build in seconds.
"""

from __future__ import annotations

import random

from tests.conftest import SPECS

__all__ = ["DEEP_OPS", "DEEP_RANKS", "DEVICE_KINDS", "MODELS", "deep_job", "random_job"]

# catalog kinds; the ones without bf16 force fp16
DEVICE_KINDS = ("H100", "A100-80", "A100-40", "L40S", "L4", "A10G", "V100-32", "V100-16", "T4", "RTX3090")
NO_BF16 = {"V100-32", "V100-16", "T4"}
# name: (layers, hidden, heads, kv_heads, ffn)
MODELS = {
    "125M": (12, 768, 12, 12, 2048),
    "350M": (24, 1024, 16, 16, 2816),
    "1.3B": (24, 2048, 16, 16, 5504),
    "2.7B": (32, 2560, 20, 20, 6912),
    "7B": (32, 4096, 32, 32, 11008),
    "13B": (40, 5120, 40, 40, 13824),
    "30B": (60, 6656, 52, 52, 17920),
    "70B": (80, 8192, 64, 8, 28672),
}
SEQS = (1024, 2048, 4096, 8192)
SCHEDULES = ("1f1b", "gpipe", "zb", "interleaved", "zorse")


def _node(name: str, device: str, count: int, gpus: int, region: str) -> list[str]:
    return [f"  node {name} {{", f"    device = {device}", f"    count = {count}", f"    gpus = {gpus}",
            f"    region = {region}", "    host_memory = 512 GiB", "    intra {",
            "      bandwidth = 150 GB/s", "      latency = 5 us", "    }", "  }"]


def _cluster(rng: random.Random, max_gpus: int) -> tuple[list[str], list[str]]:
    """(cluster lines, device kinds used)."""
    kinds = rng.sample(DEVICE_KINDS, rng.randint(2, 4))
    lines, total, groups = ["cluster mix {"], 0, []
    for i, kind in enumerate(kinds):
        gpus = rng.choice([g for g in (2, 4, 8) if total + g <= max_gpus] or [2])
        most = max(2, max_gpus // (len(kinds) * gpus))   # nodes of this kind a large cluster may take
        several = total + 2 * gpus <= max_gpus and rng.random() < (0.3 if most == 2 else 1.0)
        count = (2 if most == 2 else rng.randint(2, most)) if several else 1
        count = min(count, max(1, (max_gpus - total) // gpus))
        total += gpus * count
        name = f"g{i}"
        groups.append(name)
        lines += _node(name, kind, count, gpus, rng.choice(["east", "east", "west"]))
    for a, b in ((a, b) for j, a in enumerate(groups) for b in groups[j + 1:]):
        if rng.random() < 0.3:   # a slow link between these two groups
            lines += [f"  link {a} <-> {b} {{", f"    bandwidth = {rng.choice([1, 2, 5])} GB/s",
                      f"    latency = {rng.choice([50, 500, 5000])} us", "  }"]
    regions = any("west" in line for line in lines) and any("east" in line for line in lines)
    if regions:
        lines += ["  link east <-> west {", "    bandwidth = 1 GB/s", "    latency = 10 ms", "  }"]
    lines += ["  inter_bandwidth = 100 Gb/s", "  inter_latency = 30 us", "}"]
    return lines, kinds


def _model(rng: random.Random, kinds: list[str]) -> list[str]:
    name = rng.choice(list(MODELS))
    layers, hidden, heads, kv, ffn = MODELS[name]
    dtype = "fp16" if NO_BF16 & set(kinds) else rng.choice(["bf16", "fp16"])
    ckpt = rng.choice(["none", "selective", "full"])
    return [f"model m{name.replace('.', '_')} {{", "  arch = llama", f"  layers = {layers}", f"  hidden = {hidden}",
            f"  heads = {heads}", f"  kv_heads = {kv}", f"  ffn = {ffn}", "  vocab = 32000",
            f"  seq = {rng.choice(SEQS)}", f"  dtype = {dtype}", f"  activation_checkpoint = {ckpt}", "}"]


def _parallel(rng: random.Random) -> list[str]:
    lines = ["parallel {"]
    lines.append(f"  schedule = {rng.choice(SCHEDULES)}" if rng.random() < 0.3 else "  schedule = auto")
    if rng.random() < 0.2:
        lines.append(f"  zero = {rng.choice([1, 2, 3])}")
    return lines + ["}"]


def random_job(rng: random.Random, max_gpus: int = 16) -> str:
    """The text of a whole spec (imports the catalog by absolute path)."""
    cluster, kinds = _cluster(rng, max_gpus)
    batch = rng.choice([8, 16, 32])
    lines = [f'use "{(SPECS / "catalog.het").as_posix()}"', "", *_model(rng, kinds), "", *cluster, "",
             "train {", f"  global_batch = {batch}", "  steps = 10", "  lr = 3e-4",
             f"  grad_clip = {rng.choice([0, 1])}", "}", "", *_parallel(rng)]
    return "\n".join(lines) + "\n"


# deep_job: at most this many ranks, and compute ops over all ranks where 32 microbatches a lane allow (lowering,
# verifying and simulating take about a second a 10k)
DEEP_RANKS = 64
DEEP_OPS = 4_096
DEEP_KINDS = ("H100", "A100-80", "A100-40", "L40S", "L4")   # bf16 kinds with 8-GPU nodes in common use
GPUS_PER_NODE = 8


def deep_job(rng: random.Random) -> str:
    """The text of a whole spec with an explicit deep TP pipeline (imports the catalog by absolute path)."""
    num_stages, tp, lanes = rng.randint(4, 16), rng.choice([2, 4, 8]), rng.choice([1, 1, 2])
    while num_stages * lanes * tp > DEEP_RANKS:   # one lane, then less TP
        lanes, tp = (1, tp) if lanes > 1 else (lanes, tp // 2)
    schedule = rng.choice(["1f1b", "1f1b", "zb", "interleaved"])
    ops = {"1f1b": 2, "zb": 3, "interleaved": 4}[schedule]   # compute ops of a microbatch on one rank
    per_lane = max(32, min(rng.choice([32, 64, 128, 256]), DEEP_OPS // (ops * num_stages * lanes * tp)))
    blocks, hidden = rng.choice([1, 2]), rng.choice([256, 512, 1024])
    kinds = rng.sample(DEEP_KINDS, rng.choice([1, 2]))
    per_kind = -(-num_stages // len(kinds))   # stages on each kind, the first kind's first
    chunks = 2 if schedule == "interleaved" else 1
    stage_lines: list[str] = []
    for s in range(num_stages):
        group, at = divmod(s, per_kind)
        stage_lines += _deep_stage(s, num_stages, chunks, blocks, f"g{group}", at, lanes, tp)
    cluster, idle = ["cluster deep {"], []
    for g, kind in enumerate(kinds):
        used = min(per_kind, num_stages - g * per_kind) * lanes * tp
        nodes = -(-used // GPUS_PER_NODE)
        cluster += _node(f"g{g}", kind, nodes, GPUS_PER_NODE, "east")
        if used % GPUS_PER_NODE:   # the last node's GPUs after the group's last stage
            idle.append(f"g{g}[{nodes - 1}, {used % GPUS_PER_NODE}:{GPUS_PER_NODE}]")
    cluster += [f"  inter_bandwidth = {rng.choice([100, 200, 400])} Gb/s", "  inter_latency = 10 us", "}"]
    model = ["model deep {", "  arch = llama", f"  layers = {num_stages * chunks * blocks}", f"  hidden = {hidden}",
             "  heads = 16", "  kv_heads = 16", f"  ffn = {4 * hidden}", "  vocab = 32000",
             f"  seq = {rng.choice([512, 1024, 2048])}", "  dtype = bf16", "}"]
    lines = [f'use "{(SPECS / "catalog.het").as_posix()}"', "", *model, "", *cluster, "",
             "train {", f"  global_batch = {per_lane * lanes}", "  micro_batch = 1", "  steps = 10", "  lr = 3e-4",
             "}", "", "parallel {", f"  schedule = {schedule}", *stage_lines,
             *([f"  idle = [{', '.join(idle)}]"] if idle else []), "}"]
    return "\n".join(lines) + "\n"


def _deep_stage(s: int, num_stages: int, chunks: int, blocks: int, group: str, at: int, lanes: int, tp: int
                ) -> list[str]:
    """Stage `s` of a deep pipeline: `blocks` blocks in each of its `chunks` ministages (chunk c the (c·S + s)-th
    of the model's, as interleaved 1F1B places them; the embedding before the first, the head after the last)
    on the `at`-th run of lanes × tp GPUs of node group `group`, whole nodes where it needs more than one."""
    last_chunk = chunks * num_stages - 1
    ranges = []
    for c in range(chunks):
        v = c * num_stages + s
        first = "embed" if v == 0 else f"block{v * blocks}"
        last = "head" if v == last_chunk else f"block{(v + 1) * blocks - 1}"
        ranges.append(f"{first}..{last}")
    width = lanes * tp
    if width > GPUS_PER_NODE:
        nodes = width // GPUS_PER_NODE
        ranks = f"{group}[{at * nodes}:{(at + 1) * nodes}, :]"
    else:
        node, slot = divmod(at * width, GPUS_PER_NODE)
        ranks = f"{group}[{node}, {slot}:{slot + width}]"
    layers = ranges[0] if chunks == 1 else f"[{', '.join(ranges)}]"
    lines = [f"  stage s{s} {{", f"    layers = {layers}", f"    ranks = {ranks}", f"    lanes = {lanes}",
             f"    tp = {tp}"]
    return lines + ([f"    ministages = {chunks}"] if chunks > 1 else []) + ["  }"]
