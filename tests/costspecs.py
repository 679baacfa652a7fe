"""Build cost models from small .het texts for the cost-model tests."""

from __future__ import annotations

from pathlib import Path

from hetc.compiler import load_checked
from hetc.passes.cost import CostModel, Engine, Profiles

__all__ = ["MODEL", "ONE_LANE", "cluster", "cost_model", "plan_text", "write_spec"]

# A small Llama; fp32 everywhere unless a test says otherwise.
MODEL = """
model m {
  layers = 8
  hidden = 256
  heads = 4
  kv_heads = 2
  ffn = 704
  vocab = 1000
  seq = 128
  dtype = DTYPE
  optimizer adamw { master_dtype = MASTER }
  activation_checkpoint = CKPT
}
"""

# One stage of two lanes on node 0's first two GPUs, the rest idle: a plan for `plan_text`.
ONE_LANE = """
  stage all {
    layers = embed..head
    ranks = n[0, 0:2]
    lanes = 2
  }
  idle = [n[0, 2:4], n[1]]
"""


def cluster(nodes: int = 2, gpus: int = 4, device: str = "A100-40", intra: str = "100 GB/s",
            inter: str = "10 GB/s") -> str:
    return f"""
cluster c {{
  node n {{
    device = {device}
    count = {nodes}
    gpus = {gpus}
    intra {{ bandwidth = {intra} }}
  }}
  inter_bandwidth = {inter}
}}
"""


def plan_text(body: str, *, dtype: str = "fp32", master: str = "fp32", ckpt: str = "none",
              global_batch: int = 16, micro_batch: int = 1, clusters: str | None = None) -> str:
    model = MODEL.replace("DTYPE", dtype).replace("MASTER", master).replace("CKPT", ckpt)
    return (f'use "catalog.het"\n{model}{clusters or cluster()}\n'
            f"train {{\n  global_batch = {global_batch}\n  micro_batch = {micro_batch}\n}}\n"
            f"parallel {{\n{body}\n}}\n")


def write_spec(tmp: Path, text: str, name: str = "plan.het") -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def cost_model(tmp: Path, text: str, profiles: Profiles | None = None, engine: Engine = Engine.HETC) -> CostModel:
    _, checked = load_checked(write_spec(tmp, text))
    assert checked.pipeline is not None, "the test plan must be explicit"
    return CostModel(checked.explicit(), profiles, engine)
