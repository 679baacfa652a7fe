"""Llama-3 jobs on three kinds of GPU in two regions: H100 and A100-40 in one, L4 in another.

The shape of the jobs issue 32 measured on (explain against the compiled
peak, the printed step against the baselines): `llama_two_regions` writes
one at any size of cluster, `h100`, `a100` and `l4` GPUs each (8 a node,
or one node of fewer).
"""

from __future__ import annotations

from tests.conftest import SPECS

__all__ = ["LLAMA_8B_TWO_REGIONS", "llama_two_regions"]

_MODELS = {
    "8b": {"layers": 32, "hidden": 4096, "heads": 32, "ffn": 14336},
    "70b": {"layers": 80, "hidden": 8192, "heads": 64, "ffn": 28672},
}


def _node(name: str, device: str, gpus: int, region: str, intra: str, latency: str) -> str:
    count, per_node = (gpus // 8, 8) if gpus % 8 == 0 else (1, gpus)
    return f'''  node {name} {{
    device = {device}
    count = {count}
    gpus = {per_node}
    region = {region}
    intra {{
      bandwidth = {intra}
      latency = {latency}
    }}
  }}
'''


def llama_two_regions(size: str, h100: int, a100: int, l4: int, global_batch: int,
                      activation_checkpoint: str = "none", grad_dtype: str = "") -> str:
    """`grad_dtype`: the model's, where not its default (fp32 for bf16: Note [gradient dtype])."""
    m = _MODELS[size]
    grads = f"\n  grad_dtype = {grad_dtype}" if grad_dtype else ""
    return f'''use "{(SPECS / "catalog.het").as_posix()}"

model llama3_{size} {{
  arch = llama
  layers = {m["layers"]}
  hidden = {m["hidden"]}
  heads = {m["heads"]}
  kv_heads = 8
  ffn = {m["ffn"]}
  vocab = 128256
  seq = 4096
  dtype = bf16{grads}
  activation_checkpoint = {activation_checkpoint}
}}

cluster two_regions {{
{_node("h100", "H100", h100, "east", "450 GB/s", "3 us")}{_node("a100", "A100-40", a100, "east", "300 GB/s", "3 us")}{_node("l4", "L4", l4, "west", "32 GB/s", "5 us")}  link east <-> west {{
    bandwidth = 2 GB/s
    latency = 20 ms
  }}
  inter_bandwidth = 400 Gb/s
  inter_latency = 10 us
}}

train {{
  global_batch = {global_batch}
}}

parallel {{
  schedule = auto
}}
'''


# The job: Llama-3-8B on 256 H100 and 32 A100-40 in one region, 256 L4 in another.
LLAMA_8B_TWO_REGIONS = llama_two_regions("8b", 256, 32, 256, 1024)
