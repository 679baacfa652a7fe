"""The model built from a ModelSpec: sizes, deterministic init, ministages, TP shards, checkpointing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hetc.passes.cost.params import layer_params, stage_params
from hetc.ir.pipeline import Ministage as PlanMinistage
from hetc.ir.pipeline import Pipeline
from hetc.passes.validate_runtime import check_tied_embeddings
from hetc.runtime.flat import FlatParams
from hetc.runtime.nn.mlp import GeluMLP, SwiGLU
from hetc.runtime.nn.model import build_layer, build_ministage, compute_dtype
from hetc.runtime.nn.tensor_parallel import ParallelLinear, Split, TPShard, set_tp_comm
from hetc.ir.spec import Arch, Checkpointing, DType, ModelSpec, MoESpec, ScheduleKind

SEED = 7


def tiny(arch: Arch = Arch.LLAMA, **kw) -> ModelSpec:
    base = ModelSpec(arch=arch, layers=3, hidden=32, heads=4, kv_heads=2, ffn=40, vocab=64, seq=12,
                     dtype=DType.FP32)
    return dataclasses.replace(base, **kw)


def tokens(model: ModelSpec, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.vocab, (b, model.seq), generator=torch.Generator().manual_seed(seed))


def whole(model: ModelSpec, seed: int = SEED):
    return build_ministage(model, range(model.num_model_layers), seed=seed)


def loss_and_grads(module, toks):
    module.zero_grad()
    loss = module(toks, toks.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("arch", list(Arch))
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("moe", [None, MoESpec(experts=3, top_k=2)], ids=["dense", "moe"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_layer_sizes_equal_the_cost_models(arch, kv_heads, moe, tied):
    model = tiny(arch, kv_heads=kv_heads, moe=moe, tied_embeddings=tied)
    stage = whole(model)
    for idx in range(model.num_model_layers):
        layer = stage.layers[model.layer_name(idx)]
        assert sum(p.numel() for p in layer.parameters()) == layer_params(model, idx), model.layer_name(idx)


@pytest.mark.parametrize("extra", [{"qkv_bias": True}, {"qkv_bias": True, "out_bias": True},
                                   {"qk_norm": True, "head_dim": 16}, {"head_dim": 6}],
                         ids=["qwen2-biases", "llama-attention-bias", "qwen3-norms", "head-dim"])
def test_hf_architecture_fields_equal_the_cost_models(extra):
    model = tiny(**extra)
    stage = whole(model)
    for idx in range(model.num_model_layers):
        layer = stage.layers[model.layer_name(idx)]
        assert sum(p.numel() for p in layer.parameters()) == layer_params(model, idx), model.layer_name(idx)


def test_init_is_independent_of_what_else_a_rank_builds():
    model = tiny()
    full = dict(whole(model).named_parameters())
    part = dict(build_ministage(model, range(2, 4), seed=SEED).named_parameters())
    alone = dict(build_layer(model, 2, seed=SEED).named_parameters())
    assert part and alone
    for name, p in part.items():
        assert torch.equal(p, full[name]), name
    for name, p in alone.items():
        assert torch.equal(p, full[f"block1.{name}"]), name


def test_init_depends_on_seed_layer_and_name():
    model = tiny()
    a, b = whole(model, seed=1), whole(model, seed=2)
    wq = "attention.wq.weight"
    assert not torch.equal(a.layers["block0"].get_parameter(wq), b.layers["block0"].get_parameter(wq))
    assert not torch.equal(a.layers["block0"].get_parameter(wq), a.layers["block1"].get_parameter(wq))
    assert not torch.equal(a.get_parameter("block0.attention.wk.weight")[:8],
                           a.get_parameter("block0.attention.wv.weight")[:8])


def test_init_statistics():
    model = tiny(layers=8, hidden=64, ffn=128)
    block = build_layer(model, 1, seed=SEED)
    assert torch.equal(block.attention_norm.weight, torch.ones(64))
    assert abs(block.attention.wq.weight.std().item() - 0.02) < 0.002
    assert abs(block.attention.wo.weight.std().item() - 0.02 / 4) < 0.0005  # 0.02 / sqrt(2 L)


def test_init_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    whole(tiny())
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("arch", list(Arch))
def test_a_chain_of_ministages_is_the_whole_model(arch):
    model = tiny(arch)
    toks, labels = tokens(model), tokens(model).roll(-1, dims=1)
    ref_loss, ref_grads = loss_and_grads(whole(model), toks)
    parts = [build_ministage(model, r, seed=SEED) for r in (range(2), range(2, 4), range(4, 5))]
    assert parts[0].takes_tokens and not parts[0].computes_loss and parts[2].computes_loss
    boundaries = []  # (received activation, sent activation) per non-last ministage
    x = toks
    for part in parts[:-1]:
        out = part(x)
        boundaries.append((x, out))
        x = out.detach().requires_grad_()
    loss = parts[-1](x, labels)
    loss.backward()
    grad = x.grad
    for received, sent in reversed(boundaries):  # the pipeline's backward, by hand
        sent.backward(grad)
        grad = received.grad
    assert torch.equal(loss.detach(), ref_loss)
    for part in parts:
        for name, p in part.named_parameters():
            assert torch.equal(p.grad, ref_grads[name]), name


@pytest.mark.parametrize("mode", [Checkpointing.FULL, Checkpointing.SELECTIVE])
def test_activation_checkpointing_changes_no_number(mode):
    model = tiny()
    toks = tokens(model)
    ref_loss, ref_grads = loss_and_grads(whole(model), toks)
    loss, grads = loss_and_grads(whole(dataclasses.replace(model, activation_checkpoint=mode)), toks)
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7)


def test_rope_depends_only_on_relative_positions():
    model = tiny(layers=2)
    stage = build_ministage(model, range(1, 3), seed=SEED)
    x = torch.randn(2, model.seq, model.hidden, generator=torch.Generator().manual_seed(3))
    base = stage(x)
    shifted = stage(x, positions=torch.arange(model.seq) + 100)
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-5)


def test_gpt_learned_positions_follow_the_positions_argument():
    model = tiny(Arch.GPT)
    embed = build_ministage(model, range(1), seed=SEED)
    toks = tokens(model)
    assert not torch.equal(embed(toks), embed(toks, positions=torch.arange(model.seq).flip(0)))


class RecordingComm:
    """Stands in for the all-reduce: records each rank's partial output."""

    def __init__(self):
        self.partials = []

    def enter(self, x):
        return x

    def exit(self, y):
        self.partials.append(y)
        return torch.zeros_like(y)  # the sum is formed by the test

    def replicated(self, p):
        return p


@pytest.mark.parametrize("arch", list(Arch))
@pytest.mark.parametrize("region", ["attention", "feed_forward"])
def test_tensor_parallel_shards_sum_to_the_full_sublayer(arch, region):
    model = tiny(arch, heads=4, kv_heads=2)
    full = build_layer(model, 1, seed=SEED).get_submodule(region)
    x = torch.randn(2, model.seq, model.hidden, generator=torch.Generator().manual_seed(5))
    comm = RecordingComm()
    for rank in range(2):
        shard = build_layer(model, 1, seed=SEED, shard=TPShard(rank, 2)).get_submodule(region)
        set_tp_comm(shard, comm)
        shard(x)
    row = next(m for m in shard.modules() if isinstance(m, ParallelLinear) and m.split is Split.ROW)
    got = comm.partials[0] + comm.partials[1] + (row.bias if row.bias is not None else 0)
    torch.testing.assert_close(got, full(x), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_keeps_gqa_groups_together():
    model = tiny(heads=4, kv_heads=2)
    full = build_layer(model, 1, seed=SEED).attention
    shards = [build_layer(model, 1, seed=SEED, shard=TPShard(r, 2)).attention for r in range(2)]
    assert [s.n_heads for s in shards] == [2, 2] and [s.n_kv_heads for s in shards] == [1, 1]
    for name in ("wq", "wk", "wv"):
        joined = torch.cat([getattr(s, name).weight for s in shards], dim=0)
        assert torch.equal(joined, getattr(full, name).weight)
    assert torch.equal(torch.cat([s.wo.weight for s in shards], dim=1), full.wo.weight)
    with pytest.raises(ValueError, match="kv_heads"):
        build_layer(model, 1, seed=SEED, shard=TPShard(0, 4))


def test_mlp_kinds():
    assert isinstance(build_layer(tiny(), 1, seed=SEED).feed_forward, SwiGLU)
    assert isinstance(build_layer(tiny(Arch.GPT), 1, seed=SEED).feed_forward, GeluMLP)


def test_tied_embeddings_share_one_matrix():
    model = tiny(tied_embeddings=True)
    stage = whole(model)
    names = [n for n, _ in stage.named_parameters()]
    assert "head.output.weight" not in names and "embed.tok_embeddings.weight" in names
    _, grads = loss_and_grads(stage, tokens(model))
    assert grads["embed.tok_embeddings.weight"].abs().sum() > 0


def test_a_head_apart_from_a_tied_embedding_holds_an_equal_copy():
    """Note [tied copies]: the last stage's head holds its own copy, drawn from the embedding's seed."""
    model = tiny(tied_embeddings=True)
    first, last = build_ministage(model, range(2), seed=SEED), build_ministage(model, range(3, 5), seed=SEED)
    assert last.tied_copy and not first.tied_copy and not whole(model).tied_copy
    assert torch.equal(last.head.output.weight, first.embed.tok_embeddings.weight)
    for module, layers in ((first, range(2)), (last, range(3, 5)), (whole(model), range(5))):
        assert sum(p.numel() for p in module.parameters()) == stage_params(model, layers)   # the copy counts


def plan(*cuts: tuple[int, int, int]) -> Pipeline:
    ministages = tuple(PlanMinistage(index=i, stage=s, chunk=0, first_layer=a, stop_layer=b)
                       for i, (s, a, b) in enumerate(cuts))
    return Pipeline(stages=(), ministages=ministages, world=(), num_microbatches=1, micro_batch=1,
                    schedule=ScheduleKind.ONE_F_ONE_B, prefetch=0)


def test_check_tied_embeddings_refuses_two_ministages_of_one_stage():
    tied = tiny(tied_embeddings=True)
    assert check_tied_embeddings(tied, plan((0, 0, 5))) is None
    assert check_tied_embeddings(tied, plan((0, 0, 2), (1, 2, 5))) is None    # a copy on each stage
    assert check_tied_embeddings(tiny(), plan((0, 0, 2), (0, 2, 5))) is None
    message = check_tied_embeddings(tied, plan((0, 0, 2), (0, 2, 5)))
    assert "stage 0 holds embed in ministage 0 and head in ministage 1" in message


def test_compute_dtypes():
    assert compute_dtype(DType.FP32) is torch.float32 and compute_dtype(DType.TF32) is torch.float32
    assert compute_dtype(DType.BF16) is torch.bfloat16 and compute_dtype(DType.FP16) is torch.float16


def test_bf16_compute_keeps_fp32_master_weights():
    model = tiny(dtype=DType.BF16)
    stage = whole(model)
    initial = {n: p.detach().clone() for n, p in stage.named_parameters()}
    flat = FlatParams(stage, dtype=compute_dtype(model.dtype))
    assert flat.master.dtype is torch.float32 and not flat.master_is_compute
    assert all(p.dtype is torch.bfloat16 for p in stage.parameters())
    assert torch.equal(flat.named_master()["block0.attention.wq.weight"], initial["block0.attention.wq.weight"])
    loss = stage(tokens(model), tokens(model, seed=1))
    loss.backward()
    assert loss.dtype is torch.float32 and flat.grad.dtype is torch.bfloat16 and flat.grad.abs().sum() > 0


def test_init_std_scales_a_random_start_and_its_residual_outputs_by_depth():
    """`init_std` (Megatron-LM's --init-method-std): matrices drawn N(0, init_std), residual output projections
    N(0, init_std / sqrt(2L)); the same draws as the default's, scaled."""
    default, narrow = whole(tiny(hidden=64, ffn=128)), whole(tiny(hidden=64, ffn=128, init_std=0.006))
    params = {n: p.detach() for n, p in default.named_parameters()}
    narrowed = {n: p.detach() for n, p in narrow.named_parameters()}
    embed = next(n for n in params if n.startswith("embed"))
    out = next(n for n in params if n.endswith("w2.weight"))
    assert float(params[embed].std()) == pytest.approx(0.02, rel=0.05)
    assert float(params[out].std()) == pytest.approx(0.02 / (2 * 3) ** 0.5, rel=0.05)
    for name in (embed, out):
        torch.testing.assert_close(narrowed[name], params[name] * (0.006 / 0.02))
