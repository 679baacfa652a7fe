"""Random heterogeneous training jobs with the plan left to the planner, for the agreement test.

`random_job(rng, max_gpus)` writes a whole spec: 2-4 device kinds of the
catalog, node groups of 1-2 nodes with 2-8 GPUs each, slow links between
some groups, a dense Llama-style model of 125 M to 70 B parameters,
sequence 1k-8k, activation checkpointing, and `schedule = auto` (sometimes
a fixed schedule or ZeRO level) so the planner chooses the rest.
"""

from __future__ import annotations

import random

from tests.conftest import SPECS

__all__ = ["DEVICE_KINDS", "MODELS", "random_job"]

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
