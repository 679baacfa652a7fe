"""MoE blocks on one process: the capacity rule, the routed sum, experts held under their global names."""

from __future__ import annotations

import pytest
import torch

from hetc.runtime.nn.model import build_layer
from hetc.runtime.nn.moe import ALL_EXPERTS, ExpertShard, MoE, capacity, is_expert_param, keep_mask
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
