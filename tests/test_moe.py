"""MoE blocks on one process: the capacity rule, the routed sum, experts held under their global names."""

from __future__ import annotations

import pytest
import torch

from hetc.runtime.nn.mlp import make_mlp
from hetc.runtime.nn.model import build_layer
from hetc.runtime.nn.moe import ALL_EXPERTS, AuxLoss, ExpertShard, MoE, capacity, is_expert_param, keep_mask
from hetc.ir.spec import MoESpec
from tests.test_model import tiny

SEED = 3


def _brute_force_keep(chosen: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """GShard's queue spelled out: slot by slot, sequence by sequence, position by position."""
    b, s, k = chosen.shape
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    served = [0] * experts
    for slot in range(k):
        for seq in range(b):
            for pos in range(s):
                e = int(chosen[seq, pos, slot])
                keep[seq, pos, slot] = served[e] < cap
                served[e] += 1
    return keep


@pytest.mark.parametrize("cap", [0, 1, 3, 100])
def test_keep_mask_serves_first_choices_first_in_sequence_order(cap):
    gen = torch.Generator().manual_seed(cap)
    chosen = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(2 * 7)]).view(2, 7, 2)
    assert torch.equal(keep_mask(chosen, 5, cap), _brute_force_keep(chosen, 5, cap))


def test_capacity_is_the_factor_times_the_mean_load_rounded_up():
    assert capacity(1.0, 64, 2, 4) == 32
    assert capacity(1.25, 64, 2, 4) == 40
    assert capacity(0.1, 10, 1, 3) == 1


def _moe(capacity_factor: float, experts: ExpertShard = ALL_EXPERTS) -> tuple[MoE, object]:
    model = tiny(moe=MoESpec(experts=4, top_k=2, capacity_factor=capacity_factor))
    block = build_layer(model, 1, seed=SEED, experts=experts)
    return block.feed_forward, model


def _by_hand(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Every token through its kept experts, one at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = moe.router(tokens)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        top, chosen = logits[t].topk(moe.top_k)
        gates = torch.softmax(top, -1)
        for slot in range(moe.top_k):
            if keep is None or keep.reshape(-1, moe.top_k)[t, slot]:
                out[t] += gates[slot] * moe.experts[str(int(chosen[slot]))](tokens[t:t + 1])[0]
    return out.view_as(x)


def test_without_drops_each_token_is_the_gated_sum_of_its_experts():
    moe, model = _moe(capacity_factor=100.0)
    x = torch.randn(2, model.seq, model.hidden, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x), _by_hand(moe, x), rtol=1e-5, atol=1e-6)


def test_over_capacity_assignments_are_dropped_as_the_mask_says():
    moe, model = _moe(capacity_factor=0.5)
    x = torch.randn(2, model.seq, model.hidden, generator=torch.Generator().manual_seed(1))
    chosen = moe.router(x.reshape(-1, model.hidden)).topk(2).indices.view(2, model.seq, 2)
    keep = keep_mask(chosen, 4, capacity(0.5, 2 * model.seq, 2, 4))
    assert not keep.all(), "the case must drop something"
    torch.testing.assert_close(moe(x), _by_hand(moe, x, keep), rtol=1e-5, atol=1e-6)


def test_an_ep_rank_holds_its_experts_under_their_global_names_and_values():
    whole, _ = _moe(1.0)
    second, _ = _moe(1.0, ExpertShard(1, 2))
    assert list(second.experts) == ["2", "3"]
    mine = dict(second.named_parameters())
    everything = dict(whole.named_parameters())
    assert {n for n in mine if is_expert_param(n)} == {n for n in everything if n.startswith(("experts.2", "experts.3"))}
    for name, p in mine.items():
        assert torch.equal(p, everything[name]), name


def test_expert_parameters_are_recognised_at_every_level():
    assert is_expert_param("block0.feed_forward.experts.3.w1.weight")
    assert is_expert_param("feed_forward.experts.0.fc1.bias")
    assert not is_expert_param("block0.feed_forward.router.weight")
    assert not is_expert_param("block0.feed_forward.w1.weight")


def test_expert_shard_needs_an_even_split():
    with pytest.raises(ValueError, match="do not split"):
        ExpertShard(0, 3).local(4)


def test_the_moe_demo_job_drops_token_choices():
    """moe_job.het's capacity factor 1 makes busy experts drop, so its plans test that every plan drops alike."""
    from hetc.compiler import load_checked
    from hetc.runtime.data import make_data_source
    from hetc.runtime.nn.model import build_ministage
    from tests.conftest import DEMO

    _, checked = load_checked(DEMO / "moe_single.het")
    model, train = checked.spec.model, checked.spec.train
    module = build_ministage(model, range(model.num_model_layers), seed=train.seed)
    kept = []
    for block in (module.get_submodule(model.layer_name(i)) for i in range(1, model.layers + 1)):
        moe = block.feed_forward
        block.ffn_norm.register_forward_hook(lambda _, __, out, moe=moe: kept.append(
            moe._kept(moe.router(out).topk(moe.top_k).indices)))
    tokens, labels = make_data_source(model, train, DEMO).get_microbatch(0, 0)
    with torch.no_grad():
        module(tokens, labels)
    assert len(kept) == model.layers
    assert any(not k.all() for k in kept)


@pytest.mark.parametrize("top_k", [1, 2])
def test_balancing_loss_is_megatrons_switch_loss_hugging_faces_over_k(top_k):
    """Note [load-balancing loss]: c · E · Σ_e f_e P_e with f_e over the T·K assignments, which is Hugging Face's
    Mixtral `load_balancing_loss_func` (over one layer) divided by K."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(top_k)
    experts, hidden = 8, 16
    moe = MoE(hidden, MoESpec(experts=experts, top_k=top_k, aux_loss_coeff=0.01), lambda: torch.nn.Identity())
    logits = moe.router(torch.randn(3 * 5, hidden)).float()
    chosen = logits.topk(top_k, dim=-1).indices.view(3, 5, top_k)
    hf = load_balancing_loss_func((logits,), experts, top_k)
    assert torch.allclose(moe.balancing_loss(logits, chosen), 0.01 * hf / top_k, rtol=1e-6)


def test_balancing_loss_reaches_the_router_with_the_seed_and_not_the_output():
    """The layer's output is unchanged; backward adds the balancing loss's gradient, times `aux_seed`, to the
    router's, as seeding that loss with the seed would."""
    def layer(coeff: float) -> MoE:
        torch.manual_seed(0)
        moe = make_mlp(tiny(hidden=16, ffn=24, moe=MoESpec(experts=4, top_k=2, capacity_factor=4.0,
                                                          aux_loss_coeff=coeff)))
        assert isinstance(moe, MoE)
        return moe

    plain, balanced, probe = layer(0.0), layer(0.3), layer(0.3)
    balanced.aux_seed = 0.25
    x = torch.randn(2, 3, 16)
    out_plain, out_balanced = plain(x), balanced(x)
    assert torch.equal(out_plain, out_balanced)
    out_plain.sum().backward()
    out_balanced.sum().backward()
    logits = probe.router(x.reshape(-1, 16)).float()
    (0.25 * probe.balancing_loss(logits, logits.topk(2, dim=-1).indices.view(2, 3, 2))).backward()
    assert probe.router.weight.grad is not None and probe.router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(balanced.router.weight.grad, plain.router.weight.grad + probe.router.weight.grad)


def test_each_backward_tallies_the_balancing_loss_once_under_activation_checkpointing():
    """The step's load_balancing_loss counts each microbatch once: backward tallies it, which runs once, and
    not the forward, which full activation checkpointing runs again."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    moe = make_mlp(tiny(hidden=16, ffn=24, moe=MoESpec(experts=4, top_k=2, capacity_factor=4.0, aux_loss_coeff=0.3)))
    assert isinstance(moe, MoE)
    x = torch.randn(2, 3, 16, requires_grad=True)
    out = checkpoint(moe, x, use_reentrant=False)
    assert moe.tallied[AuxLoss.LOAD_BALANCING] == [], "tallied in backward, not forward"
    out.sum().backward()
    logits = moe.router(x.detach().reshape(-1, 16)).float()
    expected = moe.balancing_loss(logits, logits.topk(2, dim=-1).indices.view(2, 3, 2))
    assert len(moe.tallied[AuxLoss.LOAD_BALANCING]) == 1
    torch.testing.assert_close(moe.tallied[AuxLoss.LOAD_BALANCING][0], expected.detach())


def _megatron_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Megatron-LM's z_loss_func (ST-MoE's router z-loss), ported: the mean of the squared log-sum-exp."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def _z_layer(coeff: float) -> MoE:
    torch.manual_seed(0)
    moe = make_mlp(tiny(hidden=16, ffn=24, moe=MoESpec(experts=4, top_k=2, capacity_factor=4.0, z_loss_coeff=coeff)))
    assert isinstance(moe, MoE)
    return moe


def test_router_z_loss_is_megatrons_and_its_gradient_reaches_the_router_with_the_seed():
    """Note [router z-loss]: the layer's z-loss equals Megatron-LM's z_loss_func over the microbatch's tokens
    (each cp rank's share summing to it), the output is unchanged, and backward adds the z-loss's gradient,
    times `aux_seed`, to the router's."""
    layer = _z_layer(0.01)
    x = torch.randn(2, 3, 16)
    logits = layer.router(x.reshape(-1, 16)).float()
    whole = logits.topk(2, dim=-1).indices.view(2, 3, 2)
    torch.testing.assert_close(layer.z_loss(logits, whole), _megatron_z_loss(logits, 0.01))
    halves = layer.z_loss(logits[:3], whole) + layer.z_loss(logits[3:], whole)     # two cp ranks' tokens
    torch.testing.assert_close(halves, _megatron_z_loss(logits, 0.01))

    plain, with_z, probe = _z_layer(0.0), _z_layer(0.01), _z_layer(0.01)
    with_z.aux_seed = 0.25
    out_plain, out_z = plain(x), with_z(x)
    assert torch.equal(out_plain, out_z)
    out_plain.sum().backward()
    out_z.sum().backward()
    probe_logits = probe.router(x.reshape(-1, 16)).float()
    (0.25 * _megatron_z_loss(probe_logits, 0.01)).backward()
    assert probe.router.weight.grad is not None and probe.router.weight.grad.abs().sum() > 0
    torch.testing.assert_close(with_z.router.weight.grad, plain.router.weight.grad + probe.router.weight.grad)
    assert list(with_z.tallied) == [AuxLoss.Z] and len(with_z.tallied[AuxLoss.Z]) == 1    # once, by backward
