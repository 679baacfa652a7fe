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
import os
import shutil
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
    # Llama 3.2 (1B, 3B): llama3 RoPE scaling and tied embeddings
    "llama32": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
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
    "ulysses2": (2, """stage all {
    layers = embed..head
    ranks = host
    lanes = 1
    cp = 2
    cp_kind = ulysses
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


# (arch, plan): every architecture on one rank, each plan kind with one or two of them; the tied models
# (qwen2, llama32) across stages, the head's copy of the embedding read from the embedding's tensor
CASES = [(arch, "single") for arch in ARCHS] + [
    ("llama", "pp"), ("qwen2", "zero3"), ("qwen3", "tp2"), ("mistral", "cp2"), ("qwen3", "ulysses2"), ("llama", "hetero"),
    ("mixtral", "ep2"), ("mixtral", "pp"), ("qwen2", "pp"), ("llama32", "hetero"),
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


def test_the_reference_trainer_starts_from_the_weights(hf_dirs, plan_dirs):
    from hetc.plandir import read_plan
    from hetc.runtime.reference import train_reference

    plan_dir = plan_dirs["qwen2", "single"]
    spec = read_plan(plan_dir)[1].spec
    (loss,) = train_reference(spec.model, spec.train, base_dir=plan_dir, steps=1).losses
    assert_close(loss, transformers_loss(hf_dirs["qwen2"], plan_dir, 0))


@pytest.mark.slow
def test_init_random_ignores_the_weights(hf_dirs, plan_dirs, rank_pool):
    """The check the parity tests rest on: without the weights the first loss is far from transformers'."""
    (loss,) = agreed_losses(rank_pool.run(PlanJob(plan_dirs["llama", "random"], 1)))
    want = transformers_loss(hf_dirs["llama"], plan_dirs["llama", "random"], 0)
    assert abs(loss - want) > 0.1 * want
    assert abs(loss - math.log(96)) < 0.1      # hetc's own small initialisation: near uniform


@pytest.mark.slow
@pytest.mark.parametrize("arch, plan", [("llama", "single"), ("qwen3", "tp2sgd"), ("qwen2", "zero3"),
                                        ("mixtral", "ep2"), ("qwen2", "pp")])
def test_exported_weights_give_the_next_loss(arch, plan, plan_dirs, rank_pool, tmp_path):
    """Three steps under `plan`, export: transformers on the export gives the loss hetc logs at step 4. A tied
    model trained with the head's copy on another stage exports one tensor (tie_word_embeddings)."""
    plan_dir = plan_dirs[arch, plan]
    agreed_losses(rank_pool.run(PlanJob(plan_dir, 3, save_to=tmp_path / "ckpt")))
    (step4,) = agreed_losses(rank_pool.run(PlanJob(plan_dir, 4, resume_from=tmp_path / "ckpt")))
    out = tmp_path / "exported"
    assert hetc_main(["export", "hf", str(tmp_path / "ckpt" / "step-3"), "-o", str(out),
                      "--max-shard-size", "0.00002"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1          # sharded: ~21 KB shards
    tied = json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert tied == (arch == "qwen2") and ("lm_head.weight" in index["weight_map"]) != tied
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_close(step4, transformers_loss(out, plan_dir, 3))


def test_a_tied_model_is_planned_on_two_stages(hf_dirs, tmp_path, capsys):
    """Llama 3.2's shape (tied embeddings) imported and planned on two stages: the planner splits the layers
    with the head's copy of the embedding on the second (Note [tied copies] in runtime/nn/model.py)."""
    spec = write_job(tmp_path / "tied.het", hf_dirs["llama32"], "single")
    spec.write_text(spec.read_text().replace(_SINGLE, """schedule = 1f1b
  stage first {
    layers = auto
    ranks = host[0, 0]
    lanes = 1
  }
  stage second {
    layers = auto
    ranks = host[0, 1]
    lanes = 1
  }""").replace("gpus = 1", "gpus = 2"))
    assert hetc_main(["plan", str(spec), "-o", str(tmp_path / "planned.het")]) == 0
    assert hetc_main(["compile", str(tmp_path / "planned.het"), "-o", str(tmp_path / "plan")]) == 0
    listing = (tmp_path / "plan" / "programs" / "rank-0001.txt").read_text()
    assert "all_reduce tied group=tied ms=1" in listing, listing
    capsys.readouterr()


@pytest.mark.slow
def test_tensor_parallel_trains_like_one_rank(plan_dirs, rank_pool):
    """Qwen3's q/k norms see only a tp rank's heads: their gradients must be summed over tp (HeadNorm)."""
    single = agreed_losses(rank_pool.run(PlanJob(plan_dirs["qwen3", "singlesgd"], 4)))
    tp2 = agreed_losses(rank_pool.run(PlanJob(plan_dirs["qwen3", "tp2sgd"], 4)))
    assert single[-1] < single[0] - 0.05        # SGD at this rate moves the weights
    assert_losses_close(tp2, single)


# ---------------------------------------------------------------- bad weights: located errors, exit 2


def _edit_weights(src: Path, dst: Path, edit) -> Path:
    """A copy of the Hugging Face directory `src` whose tensors `edit(dict)` changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


BAD_WEIGHTS = {
    "missing": (lambda t: t.pop("model.norm.weight"), "missing tensor model.norm.weight"),
    "extra": (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
              "unexpected tensor model.layers.0.mlp.extra.weight"),
    "misshapen": (lambda t: t.update({"lm_head.weight": torch.zeros(95, 32)}),
                  "lm_head.weight has shape [95, 32], the model needs [96, 32]"),
}


@pytest.mark.parametrize("problem", sorted(BAD_WEIGHTS))
def test_bad_weights_are_a_located_error(problem, hf_dirs, tmp_path, capsys):
    edit, message = BAD_WEIGHTS[problem]
    bad = _edit_weights(hf_dirs["llama"], tmp_path / "bad", edit)
    spec = write_job(tmp_path / "job.het", bad, "single")
    assert hetc_main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:3:8: error: the safetensors in '{bad}' do not fit the model: "), err
    assert message in err


def test_an_index_naming_a_missing_shard_is_a_located_error(hf_dirs, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_dirs["llama"], bad)
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    spec = write_job(tmp_path / "job.het", bad, "single")
    assert hetc_main(["check", str(spec)]) == 2
    assert "names model-00002-of-00002.safetensors, which is not in" in capsys.readouterr().err


def test_export_of_a_non_checkpoint_is_refused(tmp_path, capsys):
    assert hetc_main(["export", "hf", str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "is not a complete checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------- hetc import hf


def test_import_prints_the_equivalent_block(hf_dirs, tmp_path, capsys):
    """The printed block describes the model hf = DIR does (checked by writing both ways)."""
    from hetc.frontend.load import load_spec

    assert hetc_main(["import", "hf", str(hf_dirs["qwen3"]), "--name", "tiny"]) == 0
    printed = capsys.readouterr().out
    assert "head_dim = 16" in printed and "qk_norm = true" in printed
    (tmp_path / "explicit.het").write_text(printed)
    (tmp_path / "hf.het").write_text(f'model tiny {{\n  hf = "{hf_dirs["qwen3"]}"\n}}\n')
    explicit, via_hf = load_spec(tmp_path / "explicit.het").spec.model, load_spec(tmp_path / "hf.het").spec.model
    import dataclasses

    assert dataclasses.replace(via_hf, hf="") == explicit


def test_a_written_block_with_hf_round_trips(hf_dirs, tmp_path):
    """plan.het prints every field beside hf; reading it back gives the same model (no contradiction)."""
    from hetc.frontend.load import load_spec
    from hetc.frontend.printer import format_spec

    spec = load_spec(write_job(tmp_path / "job.het", hf_dirs["mixtral"], "ep2")).spec
    (tmp_path / "again.het").write_text(format_spec(spec))
    again = load_spec(tmp_path / "again.het").spec
    assert again == spec and again.model.moe.capacity_factor == 2.0    # dropless: experts / top_k


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_plan_output_replaces_no_file_of_the_model_directory(name, hf_dirs, tmp_path, capsys):
    """Note [output files]: the spec reads the hf directory's files, so `-o` may not replace one."""
    hf = tmp_path / "model"
    shutil.copytree(hf_dirs["llama"], hf)
    spec = write_job(tmp_path / "job.het", hf, "single")
    before = (hf / name).read_bytes()
    assert hetc_main(["plan", str(spec), "-o", str(hf / name)]) == 2
    assert f"-o '{hf / name}' is a file of the model's hf directory" in capsys.readouterr().err
    assert (hf / name).read_bytes() == before
    assert hetc_main(["plan", str(spec), "-o", str(hf / "plan.het")]) == 0     # a new file there loses nothing


# ---------------------------------------------------------------- a rank reads only its share


def _write_sharded(directory: Path, config: dict, shards: int) -> dict[str, tuple[int, ...]]:
    """config.json and random fp32 weights of `config`'s model in `shards` files with an index."""
    from safetensors.torch import save_file

    from hetc.frontend.convert import import_model
    from hetc.hf.weights import expected_shapes

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    shapes = expected_shapes(import_model(directory, "big"))
    names = list(shapes)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: torch.randn(shapes[n]) for n in part}, str(directory / file))
        weight_map.update((n, file) for n in part)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return shapes


_BIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """~350 MB of random fp32 Llama weights in 3 safetensors files with an index, and their shapes."""
    directory = tmp_path_factory.mktemp("big_llama") / "big"
    return directory, _write_sharded(directory, _BIG, shards=3)


@pytest.mark.slow
def test_a_rank_materialises_only_its_shard_plus_one_tensor(big_llama):
    """~350 MB of sharded safetensors; one ZeRO-3 rank of 4 (the whole model) and one TP rank of 2 of a
    pipeline stage (the blocks) read their share."""
    from hetc.frontend.convert import import_model
    from hetc.hf.weights import WeightReader
    from hetc.runtime.flat import FlatLayout
    from hetc.runtime.hf_load import LoadStats, read_flat
    from hetc.runtime.nn.model import Ministage
    from hetc.runtime.nn.tensor_parallel import TPShard, shard_infos

    directory, shapes = big_llama
    whole = 4 * sum(math.prod(s) for s in shapes.values())
    largest = 4 * max(math.prod(s) for s in shapes.values())
    assert whole > 300e6
    model = import_model(directory, "big")
    everything, blocks = range(model.num_model_layers), range(1, model.layers + 1)
    for layers, tp, num_shards, index in ((everything, TPShard(0, 1), 4, 1), (blocks, TPShard(1, 2), 1, 0)):
        with torch.device("meta"):
            module = Ministage(model, layers, seed=0, shard=tp, device="meta")
        layout, infos = FlatLayout.of(module, num_shards), shard_infos(module)
        rng = layout.shard_range(index)
        stats = LoadStats()
        values = read_flat(WeightReader(directory), layout, infos, rng, stats)
        share = 4 * (rng.stop - rng.start)
        assert share < whole / 2                         # a quarter of the model, or half of the blocks
        assert stats.peak <= share + largest, (stats, share, largest)
        assert share <= stats.read <= share + 2 * largest    # partial rows at the range's two ends
        _check_some_values(values, layout, infos, rng, directory)


_PEAK_PROBE = """
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist

from hetc.plandir import read_plan, read_program
from hetc.runtime.checkpoint import read_checkpoint
from hetc.runtime.setup import build_rank_buffers
import hetc.hf.weights, safetensors.torch     # what the load imports, before the baseline

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

plan_dir, rank = Path(sys.argv[1]), int(sys.argv[2])
checkpoint = Path(sys.argv[3]) if len(sys.argv) > 3 else None
_, checked = read_plan(plan_dir)              # the model's config parsed, the weights' headers checked
program = read_program(plan_dir)
if checkpoint is not None:     # DCP's plan exchange over a group of one: the requests are this rank's own
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
except OSError as err:
    print(json.dumps({"skip": f"cannot reset the peak RSS: {err}"}))
    sys.exit(0)
baseline = status("VmRSS")
buffers = build_rank_buffers(program, checked, rank, torch.device("cpu"), resumes=checkpoint is not None)
if checkpoint is not None:
    read_checkpoint(buffers, checkpoint, dist.group.WORLD)
peak = status("VmHWM")
tensors = [t for b in buffers.values() for part in b.parts()
           for t in (part.master, part.compute, part.grad, part.acc, part.opt_grad, part.param_shard, part.host,
                     *part.opt_state.tensors().values()) if t is not None]
held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
parts = [part for b in buffers.values() for part in b.parts()]
ranges = [4 * (p.param_range.stop - p.param_range.start) for p in parts]   # a ZeRO-3 unit's each (Note [units])
print(json.dumps({"growth": peak - baseline, "held": held, "share": sum(ranges), "fill": max(ranges),
                  "first": parts[0].opt_range.start, "values": parts[0].master[:4].tolist()}))
"""


@pytest.fixture(scope="module")
def big_zero3_plan(big_llama, tmp_path_factory) -> Path:
    """The big Llama under ZeRO-3 over 4 CPU ranks, plain SGD (no optimizer state), compiled."""
    directory, _ = big_llama
    root = tmp_path_factory.mktemp("big_zero3")
    spec = root / "big.het"
    spec.write_text(f"""use "catalog.het"
model big {{
  hf = "{directory}"
  seq = 16
  dtype = fp32
  optimizer sgd {{
  }}
}}
cluster local {{
  node host {{
    device = cpu
    gpus = 4
  }}
}}
train {{
  global_batch = 8
  micro_batch = 2
  steps = 1
}}
parallel {{
  zero = 3
  stage all {{
    layers = embed..head
    ranks = host
    lanes = 4
  }}
}}
""")
    return compile_plans([spec], root / "out")["big"]


def _peak_of_rank_1(plan_dir: Path, checkpoint: Path | None = None) -> dict:
    """What the probe measured for rank 1 of `plan_dir` building its state (from `checkpoint` if given)."""
    import subprocess
    import sys

    if not Path("/proc/self/status").is_file():
        pytest.skip("measures the peak RSS through Linux's /proc/self/status")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", _PEAK_PROBE, str(plan_dir), "1", *([str(checkpoint)] if checkpoint else [])]
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    return got


def _assert_peak_within_own_shard(got: dict, shapes: dict[str, tuple[int, ...]], fill: int | None = None,
                                  reads: int = 2) -> None:
    whole = 4 * sum(math.prod(s) for s in shapes.values())
    largest = 4 * max(math.prod(s) for s in shapes.values())
    # Its own shard: what the rank keeps, three fp32 copies of its quarter (master, reduced gradients,
    # parameter shard; plain SGD has no optimizer state; the full compute and grad buffers released),
    # and while loading, the range the loader fills (`fill`: one buffer's, a ZeRO-3 unit's where the
    # ministage is split into units, Note [units] in hetc/ir/program.py); one tensor: the one being read
    # (`largest`). Slack: one more `largest` for the bytes of that read on their way in (safetensors'
    # mapped file pages, counted in RSS until WeightReader unmaps them after the read; DCP's record
    # of the stored tensor before its slice is copied out), and 16 MB for the allocator's and
    # Python's own growth. Building the ministage whole, as a random start does, would add at least
    # `whole`, more than the bound leaves.
    share = got["share"]
    bound = 3 * share + (got["fill"] if fill is None else fill) + reads * largest + 16 * 2**20
    assert share <= whole / 4 + largest and bound < 3 * share + whole, (got, whole)
    assert got["growth"] <= bound, {**got, "bound": bound, "whole": whole}
    assert got["held"] <= 3 * share, got


@pytest.mark.slow
def test_a_zero3_rank_starting_from_hf_weights_peaks_at_its_own_shard(big_llama, big_zero3_plan):
    """The real peak host memory of one ZeRO-3 rank of 4 building its state from ~350 MB of safetensors
    (runtime/setup.py's build_rank_buffers, what `build_rank` runs at startup), measured in a fresh process
    (VmHWM after a reset, over the RSS after imports and parsing the plan)."""
    _assert_peak_within_own_shard(_peak_of_rank_1(big_zero3_plan), big_llama[1])


@pytest.mark.slow
def test_a_zero3_rank_resuming_peaks_at_its_own_shard(big_llama, big_zero3_plan, tmp_path):
    """The same rank resuming from a checkpoint of those weights (as a one-rank plan writes it: every
    parameter whole, Note [Checkpoint layout]) reads its share and holds no more; its master starts
    with the file's values at its offset."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from hetc.frontend.convert import import_model
    from hetc.hf.names import hf_name
    from hetc.hf.weights import weight_map
    from hetc.runtime.checkpoint import STEP_KEY
    from hetc.runtime.nn.model import full_shapes

    directory, shapes = big_llama
    files = weight_map(directory)
    names = list(full_shapes(import_model(directory, "big")))
    state: dict[str, object] = {STEP_KEY: 3}
    for name in names:
        with safe_open(str(files[hf_name(name)]), "pt") as f:
            state[f"model.{name}"] = f.get_tensor(hf_name(name)).reshape(-1)
    with warnings.catch_warnings():     # one process on purpose: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp_path / "step-3", no_dist=True)
    got = _peak_of_rank_1(big_zero3_plan, tmp_path / "step-3")
    # One DCP load fills every range of the rank at once (`fill`: all of its share). Split into units
    # (Note [units]), the rank holds a quarter of every parameter, so DCP reads each stored tensor (not only
    # those one contiguous quarter overlaps): one more `largest` in the allocator's high-water mark.
    _assert_peak_within_own_shard(got, shapes, fill=got["share"], reads=3)
    flat = torch.cat([state[f"model.{n}"] for n in names])
    torch.testing.assert_close(torch.tensor(got["values"]), flat[got["first"]:got["first"] + 4])


def _check_some_values(values, layout, infos, rng, directory: Path) -> None:
    """The first and last parameters inside the range hold the file's values (their slices)."""
    from safetensors import safe_open

    from hetc.hf.names import hf_name
    from hetc.hf.weights import weight_map

    files = weight_map(directory)
    inside = [e for e in layout.entries if e.offset >= rng.start and e.offset + e.numel <= rng.stop]
    for e in (inside[0], inside[-1]):
        with safe_open(str(files[hf_name(e.name)]), "pt") as f:
            full = f.get_tensor(hf_name(e.name))
        want = infos[e.name].slice_of(full).reshape(-1)
        torch.testing.assert_close(values[e.offset - rng.start:e.offset - rng.start + e.numel], want)


# ---------------------------------------------------------------- config.json, as transformers 4 wrote it


def _config_dir(tmp_path: Path, **config) -> Path:
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


def test_a_transformers_4_llama_3_1_config(tmp_path):
    from hetc.frontend.convert import import_model
    from hetc.ir.spec import DType, RopeScalingKind

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model = import_model(_config_dir(tmp_path, rope_theta=500000.0, rope_scaling=scaling, torch_dtype="bfloat16",
                                     num_key_value_heads=2), "llama31")
    assert (model.rope_theta, model.dtype, model.num_kv_heads, model.seq) == (500000.0, DType.BF16, 2, 128)
    assert model.rope_scaling.kind is RopeScalingKind.LLAMA3 and model.rope_scaling.original_seq == 64


def test_attention_dropout_comes_from_the_config_and_goes_back(tmp_path):
    """config.json's attention_dropout is the model's default (a training field: a key beside hf may change
    it), and an export writes the model's."""
    from hetc.frontend.convert import import_model
    from hetc.runtime.hf_export import hf_config

    model = import_model(_config_dir(tmp_path, attention_dropout=0.1), "llama")
    assert (model.attention_dropout, model.hidden_dropout) == (0.1, 0.0)
    (tmp_path / "job.het").write_text(f'model m {{\n  hf = "{tmp_path}"\n  attention_dropout = 0.2\n}}\n')
    from hetc.frontend.load import load_spec

    model = load_spec(tmp_path / "job.het").spec.model
    assert model.attention_dropout == 0.2 and hf_config(model)["attention_dropout"] == 0.2


def test_initializer_range_is_init_std_both_ways(tmp_path):
    """config.json's initializer_range is the model's init_std (a training field), and an export writes it."""
    from hetc.frontend.convert import import_model
    from hetc.runtime.hf_export import hf_config

    model = import_model(_config_dir(tmp_path, initializer_range=0.006), "llama")
    assert model.init_std == 0.006 and hf_config(model)["initializer_range"] == 0.006
    assert import_model(_config_dir(tmp_path), "llama").init_std == 0.02     # transformers' default


@pytest.mark.parametrize("config, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"architectures": ["GPT2LMHeadModel"]}, "hetc reads LlamaForCausalLM, MistralForCausalLM"),
    ({"num_hidden_layers": 0}, "\"num_hidden_layers\" must be a positive integer"),
    # values of another JSON type: each named, not an internal error from float() or int()
    ({"rms_norm_eps": "x"}, "\"rms_norm_eps\" must be a number, not 'x'"),
    ({"num_key_value_heads": [0, 1]}, "\"num_key_value_heads\" must be a positive integer, not [0, 1]"),
    ({"tie_word_embeddings": -1}, "\"tie_word_embeddings\" must be true or false, not -1"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "\"low_freq_factor\" must be a number, not None"),
])
def test_configs_hetc_cannot_take(config, message, tmp_path, capsys):
    assert hetc_main(["import", "hf", str(_config_dir(tmp_path, **config))]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("config, message", [
    ({"rms_norm_eps": 16}, "'norm_eps' of {config} must be between 0 and 1, got 16"),
    ({"attention_dropout": -0.5}, "'attention_dropout' of {config} must be between 0 and 0.9, got -0.5"),
])
def test_config_values_are_held_to_the_keys_bounds(config, message, tmp_path, capsys):
    """A value from config.json meets the bounds the same key written in a spec does, in `hetc import hf`
    and beside `hf` (it passed `hetc check` and `hetc compile` and was refused only by the ranks of
    `hetc run`, which read plan.het's explicit keys)."""
    (tmp_path / "m").mkdir()
    directory = _config_dir(tmp_path / "m", **config)
    shown = message.format(config=directory / "config.json")
    assert hetc_main(["import", "hf", str(directory)]) == 2
    assert f"{directory / 'config.json'}:1:1: error: {shown}" in capsys.readouterr().err
    spec = tmp_path / "job.het"
    spec.write_text(f'model m {{\n  hf = "{directory}"\n}}\n')
    assert hetc_main(["check", str(spec)]) == 2
    assert f"{spec}:2:8: error: {shown}" in capsys.readouterr().err


def test_seq_beyond_a_sliding_window_is_a_located_error(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    directory = _config_dir(tmp_path / "m", architectures=["MistralForCausalLM"], sliding_window=32)
    spec = tmp_path / "job.het"
    spec.write_text(f'model m {{\n  hf = "{directory}"\n  seq = 64\n}}\n')
    assert hetc_main(["check", str(spec)]) == 2
    assert f"{spec}:3:9: error: seq (64) exceeds the sliding window (32)" in capsys.readouterr().err
