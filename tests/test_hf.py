"""Hugging Face models in and out: parity with transformers on tiny random models it builds.

Each model is built by transformers from a config (fp32, a fixed seed, its
weights then moved well away from transformers' small initialisation, so a
model whose weights were not loaded, or loaded under the wrong names,
gives a visibly different loss than the one transformers computes) and
saved with save_pretrained into a tmp folder; nothing is downloaded.
hetc's loss at step 1 is compared with transformers' loss on exactly the
tokens hetc's data source gives for step 1 (Note [Plan-independent data]:
the batch depends on (seed, step, microbatch) only, so the test asks the
same source), within 1e-5 relative, under several plans (tests/rank_pool.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hetc.cli import main as hetc_main
from tests.rank_pool import LOSS_RTOL, PlanJob, agreed_losses, assert_losses_close, compile_plans

transformers = pytest.importorskip("transformers")

SEQ, GLOBAL_BATCH, MICRO_BATCH, SEED = 16, 8, 2, 11
SGD = "  optimizer sgd {\n    momentum = 0.9\n  }\n"
PERTURB = 0.25     # added to every weight (std): logits far from uniform, loss far from ln(vocab)

_COMMON = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
ARCHS = {
    # Llama 3.1: GQA and llama3 RoPE scaling (original length 8 < seq, so the scaling matters)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True, "rms_norm_eps": 1e-6}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}

_SINGLE = """stage all {
    layers = embed..head
    ranks = host
    lanes = 1
  }"""
PLANS = {
    "single": (1, _SINGLE),
    "pp": (2, """schedule = 1f1b
  stage first {
    layers = embed..block0
    ranks = host[0, 0]
    lanes = 1
  }
  stage second {
    layers = block1..head
    ranks = host[0, 1]
    lanes = 1
  }"""),
    "zero3": (2, """zero = 3
  stage all {
    layers = embed..head
    ranks = host
    lanes = 2
  }"""),
    "tp2": (2, """stage all {
    layers = embed..head
    ranks = host
    lanes = 1
    tp = 2
  }"""),
    "cp2": (2, """stage all {
    layers = embed..head
    ranks = host
    lanes = 1
    cp = 2
    cp_kind = ring
  }"""),
    # uneven and heterogeneous: one lane, then two lanes taking 3 and 1 of the 4 microbatches
    "hetero": (3, """schedule = 1f1b
  stage first {
    layers = embed..block0
    ranks = host[0, 0]
    lanes = 1
  }
  stage second {
    layers = block1..head
    ranks = host[0, 1:3]
    lanes = 2
    microbatches = [3, 1]
  }"""),
    "ep2": (2, """stage all {
    layers = embed..head
    ranks = host
    lanes = 2
    ep = 2
  }"""),
}


def save_tiny(arch: str, directory: Path) -> Path:
    """A tiny random `arch` model saved by transformers into `directory`."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**_COMMON, **extra)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * PERTURB)
    model.save_pretrained(directory)
    return directory


def write_job(path: Path, hf_dir: Path, plan: str, extra_model: str = "", lr: float = 3e-3) -> Path:
    ranks, parallel = PLANS[plan]
    path.write_text(f"""use "catalog.het"
model tiny {{
  hf = "{hf_dir}"
  seq = {SEQ}
  dtype = fp32
{extra_model}}}
cluster local {{
  node host {{
    device = cpu
    gpus = {ranks}
  }}
}}
train {{
  global_batch = {GLOBAL_BATCH}
  micro_batch = {MICRO_BATCH}
  steps = 4
  lr = {lr}
  seed = {SEED}
}}
parallel {{
  {parallel}
}}
""")
    return path


def transformers_loss(hf_dir: Path, plan_dir: Path, step: int) -> float:
    """transformers' mean microbatch loss on hetc's batch of 0-based `step` (the tokens hetc trains on)."""
    from hetc.plandir import read_plan
    from hetc.runtime.data import make_data_source

    _, checked = read_plan(plan_dir)
    data = make_data_source(checked.spec.model, checked.spec.train, plan_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for mb in range(GLOBAL_BATCH // MICRO_BATCH):
            tokens, labels = data.get_microbatch(step, mb)
            logits = model(input_ids=tokens).logits
            total += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).item()
    return total / (GLOBAL_BATCH // MICRO_BATCH)


def assert_close(got: float, want: float) -> None:
    assert abs(got - want) <= LOSS_RTOL * abs(want), f"hetc {got!r}, transformers {want!r}"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: save_tiny(arch, root / arch) for arch in ARCHS}


# (arch, plan): every architecture on one rank, each plan kind with one or two of them
CASES = [(arch, "single") for arch in ARCHS] + [
    ("llama", "pp"), ("qwen2", "zero3"), ("qwen3", "tp2"), ("mistral", "cp2"), ("llama", "hetero"),
    ("mixtral", "ep2"), ("mixtral", "pp"),
]


@pytest.fixture(scope="module")
def plan_dirs(hf_dirs, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("hf_plans")
    specs = [write_job(root / f"{arch}-{plan}.het", hf_dirs[arch], plan) for arch, plan in CASES]
    specs.append(write_job(root / "llama-random.het", hf_dirs["llama"], "single", "  init = random\n"))
    for plan in ("single", "tp2"):     # SGD: an update proportional to the gradient (Adam's hides its scale)
        specs.append(write_job(root / f"qwen3-{plan}sgd.het", hf_dirs["qwen3"], plan, SGD, lr=0.05))
    dirs = compile_plans(specs, root / "out")
    return {tuple(stem.split("-")): path for stem, path in dirs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("arch, plan", CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_first_loss_equals_transformers(arch, plan, hf_dirs, plan_dirs, rank_pool):
    (loss,) = agreed_losses(rank_pool.run(PlanJob(plan_dirs[arch, plan], 1)))
    assert_close(loss, transformers_loss(hf_dirs[arch], plan_dirs[arch, plan], 0))


@pytest.mark.slow
def test_init_random_ignores_the_weights(hf_dirs, plan_dirs, rank_pool):
    """The check the parity tests rest on: without the weights the first loss is far from transformers'."""
    (loss,) = agreed_losses(rank_pool.run(PlanJob(plan_dirs["llama", "random"], 1)))
    want = transformers_loss(hf_dirs["llama"], plan_dirs["llama", "random"], 0)
    assert abs(loss - want) > 0.1 * want
    assert abs(loss - math.log(96)) < 0.1      # hetc's own small initialisation: near uniform


@pytest.mark.slow
@pytest.mark.parametrize("arch, plan", [("llama", "single"), ("qwen3", "tp2sgd"), ("qwen2", "zero3"),
                                        ("mixtral", "ep2")])
def test_exported_weights_give_the_next_loss(arch, plan, plan_dirs, rank_pool, tmp_path):
    """Three steps under `plan`, export: transformers on the export gives the loss hetc logs at step 4."""
    plan_dir = plan_dirs[arch, plan]
    agreed_losses(rank_pool.run(PlanJob(plan_dir, 3, save_to=tmp_path / "ckpt")))
    (step4,) = agreed_losses(rank_pool.run(PlanJob(plan_dir, 4, resume_from=tmp_path / "ckpt")))
    out = tmp_path / "exported"
    assert hetc_main(["export", "hf", str(tmp_path / "ckpt" / "step-3"), "-o", str(out),
                      "--max-shard-size", "0.00002"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1          # sharded: ~21 KB shards
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_close(step4, transformers_loss(out, plan_dir, 3))


@pytest.mark.slow
def test_tensor_parallel_trains_like_one_rank(plan_dirs, rank_pool):
    """Qwen3's q/k norms see only a tp rank's heads: their gradients must be summed over tp (HeadNorm)."""
    single = agreed_losses(rank_pool.run(PlanJob(plan_dirs["qwen3", "singlesgd"], 4)))
    tp2 = agreed_losses(rank_pool.run(PlanJob(plan_dirs["qwen3", "tp2sgd"], 4)))
    assert single[-1] < single[0] - 0.05        # SGD at this rate moves the weights
    assert_losses_close(tp2, single)
