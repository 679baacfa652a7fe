"""TP, sequence parallelism, Ulysses and ring attention against the unsharded model (the 4 gloo pool ranks).

Each case builds the whole tiny model twice on every rank of a lane: once
unsharded (the reference) and once as the rank's shard, wired by
`hetc.runtime.lane.place_ministage` exactly as the interpreter wires it.
The lane's ranks run forward and backward on their tokens of one
microbatch; then the parts' losses must add up to the reference loss and
every rank's parameter gradients (summed over the cp ranks, as the ZeRO
group does) must equal its slice of the reference gradients.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest

from hetc.ir.spec import Arch, Checkpointing, CPKind, DType, ModelSpec

WORLD = 4
TIMEOUT_S = 120
RING_BF16 = "ring4-bf16"


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int = 1
    cp: int = 1
    cp_kind: CPKind = CPKind.RING
    sequence_parallel: bool = False
    arch: Arch = Arch.LLAMA
    checkpoint: Checkpointing = Checkpointing.NONE     # recomputation reruns the collectives in backward

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"] + (["sp"] if self.sequence_parallel else [])
        parts += [f"{self.cp_kind.value}{self.cp}"] if self.cp > 1 else []
        parts += [self.arch.value] if self.arch is not Arch.LLAMA else []
        return "-".join(parts + ([f"ckpt-{self.checkpoint.value}"] if self.checkpoint is not Checkpointing.NONE
                                 else []))


CASES = [
    Case(tp=2),
    Case(tp=2, sequence_parallel=True),
    Case(cp=2, cp_kind=CPKind.ULYSSES),
    Case(cp=4, cp_kind=CPKind.ULYSSES),             # 2 K/V heads over 4 ranks: repeated K/V heads
    Case(cp=2),
    Case(cp=4),
    Case(tp=2, cp=2, sequence_parallel=True),
    Case(tp=2, cp=2, cp_kind=CPKind.ULYSSES),
    Case(tp=2, cp=2, sequence_parallel=True, arch=Arch.GPT),
    Case(tp=2, cp=2, sequence_parallel=True, checkpoint=Checkpointing.FULL),
    Case(cp=2, checkpoint=Checkpointing.SELECTIVE),
]


# Dropout on a lane (Note [dropout streams]): masks are not the unsharded model's, so these cases check what
# must hold instead: recomputation replays the masks, and the tp ranks draw one mask where they hold the
# hidden state whole (their replicated norm weights' gradients agree).
DROPOUT_CASES = [
    Case(tp=2),
    Case(tp=2, sequence_parallel=True),
    Case(cp=2, cp_kind=CPKind.ULYSSES),
    Case(tp=2, cp=2, cp_kind=CPKind.ULYSSES, arch=Arch.GPT),
]


def dropout_name(case: Case) -> str:
    return f"dropout-{case.name}"


def model_for(case: Case) -> ModelSpec:
    return ModelSpec(arch=case.arch, layers=2, hidden=32, heads=4, kv_heads=2, ffn=40, vocab=64, seq=16,
                     dtype=DType.FP32, activation_checkpoint=case.checkpoint)


@pytest.fixture(scope="module")
def outcomes(rank_pool) -> dict[str, str | None]:
    """{case name: None, or the first rank's traceback}, from one run of every case on the 4 pool ranks."""
    assert rank_pool.size == WORLD
    results = rank_pool.call(_cases)
    names = [case.name for case in CASES] + [RING_BF16] + [dropout_name(case) for case in DROPOUT_CASES]
    return {name: next((r[name] for r in results if r[name]), None) for name in names}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lane_matches_the_unsharded_model(outcomes, case):
    assert outcomes[case.name] is None, outcomes[case.name]


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=dropout_name)
def test_lane_dropout_is_replayed_and_whole_tensors_agree(outcomes, case):
    assert outcomes[dropout_name(case)] is None, outcomes[dropout_name(case)]


def test_bf16_ring_attention_matches_full_sdpa(outcomes):
    """Ring blocks run through SDPA in bf16 (Note [ring blocks through SDPA]); merged, they are full attention."""
    assert outcomes[RING_BF16] is None, outcomes[RING_BF16]


# ---------------------------------------------------------------- inside a worker


def _cases(rank: int) -> dict[str, str | None]:
    """Every case on this rank (torch.distributed initialised on the 4 ranks): {name: None or a traceback}."""
    import torch.distributed as dist

    groups = _groups()
    out = {}
    for case in CASES:
        try:
            _check(case, rank, groups)
            out[case.name] = None
        except Exception:  # noqa: BLE001 - report to the test
            out[case.name] = f"rank {rank}:\n{traceback.format_exc()}"
        dist.barrier()
    try:
        _check_ring_bf16(rank, groups[tuple(range(WORLD))])
        out[RING_BF16] = None
    except Exception:  # noqa: BLE001 - report to the test
        out[RING_BF16] = f"rank {rank}:\n{traceback.format_exc()}"
    for case in DROPOUT_CASES:
        try:
            _check_dropout(case, rank, groups)
            out[dropout_name(case)] = None
        except Exception:  # noqa: BLE001 - report to the test
            out[dropout_name(case)] = f"rank {rank}:\n{traceback.format_exc()}"
        dist.barrier()
    return out


def _groups() -> dict[tuple[int, ...], object]:
    """Every rank set a case may use, created on every rank in one order (torch requires it)."""
    import torch.distributed as dist

    sets = [(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)]
    return {s: dist.new_group(list(s)) for s in sets}


def _place(case: Case, rank: int, groups):
    """This rank's place in the case's lane (ranks 0 .. tp·cp - 1), its tp ranks; None off the lane."""
    from hetc.ir.pipeline import Stage
    from hetc.runtime.lane import LanePlace
    from hetc.ir.spec import OffloadSpec, ZeroSpec

    lane = tuple(range(case.tp * case.cp))
    if rank not in lane:
        return None, lane, ()
    stage = Stage(0, "s", (0,), (), case.tp, case.cp, case.cp_kind, case.sequence_parallel, ZeroSpec(),
                  OffloadSpec())
    pos = lane.index(rank)
    tp_ranks = lane[pos // case.tp * case.tp:][:case.tp]
    cp_ranks = lane[pos % case.tp::case.tp]
    return LanePlace(stage, pos, model_for(case).seq, groups.get(tp_ranks), groups.get(cp_ranks), cp_ranks), \
        lane, tp_ranks


def _tokens(model: ModelSpec):
    import torch

    tokens = torch.randint(0, model.vocab, (2, model.seq), generator=torch.Generator().manual_seed(5))
    return tokens, tokens.roll(-1, dims=1)


def _check(case: Case, rank: int, groups) -> None:
    import torch
    import torch.distributed as dist

    from hetc.runtime.lane import place_ministage, take_tokens
    from hetc.runtime.nn.model import build_ministage
    from hetc.runtime.nn.tensor_parallel import shard_infos

    place, lane, _ = _place(case, rank, groups)
    if place is None:
        return
    model = model_for(case)
    layers = range(model.num_model_layers)
    reference = build_ministage(model, layers, seed=3)
    mine = build_ministage(model, layers, seed=3, shard=place.shard)
    place_ministage(mine, place)

    tokens, labels = _tokens(model)
    want = reference(tokens, labels)
    want.backward()
    loss = mine(take_tokens(tokens, place), take_tokens(labels, place))
    loss.backward()

    total = (loss.detach() if place.counts_loss else torch.zeros(())).reshape(1).clone()
    dist.all_reduce(total, group=groups[lane] if len(lane) > 1 else None)
    torch.testing.assert_close(total[0], want.detach(), rtol=1e-5, atol=0)
    full = dict(reference.named_parameters())
    infos = shard_infos(mine)
    for name, p in mine.named_parameters():
        grad = p.grad.clone()
        if case.cp > 1:
            dist.all_reduce(grad, group=groups[place.cp_ranks])
        expected = infos[name].slice_of(full[name].grad)
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _check_dropout(case: Case, rank: int, groups) -> None:
    """With hidden and attention dropout: the lane's gradients with full recomputation equal those without
    (the masks are replayed), the loss is not the dropout-free one, and every parameter the tp ranks hold
    whole (the norms) has one gradient over the tp group."""
    import torch
    import torch.distributed as dist

    from hetc.runtime.lane import place_ministage, take_tokens
    from hetc.runtime.nn.dropout import seed_step
    from hetc.runtime.nn.model import build_ministage
    from hetc.runtime.nn.tensor_parallel import shard_infos

    place, _, tp_ranks = _place(case, rank, groups)
    if place is None:
        return
    tokens, labels = _tokens(model_for(case))
    runs = {}
    for checkpoint, p in ((Checkpointing.NONE, 0.3), (Checkpointing.FULL, 0.3), (Checkpointing.NONE, 0.0)):
        model = dataclasses.replace(model_for(case), hidden_dropout=p, attention_dropout=p,
                                    activation_checkpoint=checkpoint)
        mine = build_ministage(model, range(model.num_model_layers), seed=3, shard=place.shard)
        place_ministage(mine, place)
        seed_step(11, 0, tp_ranks[0])       # as the interpreter seeds each step
        loss = mine(take_tokens(tokens, place), take_tokens(labels, place))
        loss.backward()
        runs[(checkpoint, p)] = loss.detach(), {n: t.grad for n, t in mine.named_parameters()}
    (loss, grads), (replayed, regrads) = runs[(Checkpointing.NONE, 0.3)], runs[(Checkpointing.FULL, 0.3)]
    assert torch.equal(loss, replayed)
    assert all(torch.equal(grads[n], regrads[n]) for n in grads), "recomputation drew other masks"
    assert not torch.equal(loss, runs[(Checkpointing.NONE, 0.0)][0]), "no dropout ran"
    if case.tp > 1:
        whole = [n for n, info in shard_infos(mine).items() if info.dim is None]
        assert whole, "the case has no parameter the tp ranks hold whole"
        for name in whole:
            theirs = [torch.empty_like(grads[name]) for _ in tp_ranks]
            dist.all_gather(theirs, grads[name].contiguous(), group=groups[tp_ranks])
            assert all(torch.equal(t, theirs[0]) for t in theirs), f"{name}: the tp ranks drew other masks"


def _check_ring_bf16(rank: int, group) -> None:
    """A bf16 GQA ring over all ranks, forward and backward, against SDPA on the whole sequence."""
    import torch
    import torch.nn.functional as F

    from hetc.runtime.nn.ring_attention import RingAttention, zigzag_chunks

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, 32, 16, generator=gen).bfloat16().requires_grad_() for heads in (4, 2, 2))
    dout = torch.randn(2, 4, 32, 16, generator=gen).bfloat16()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    full.backward(dout)

    def mine(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.chunk(2 * WORLD, dim=2)[c] for c in zigzag_chunks(rank, WORLD)], dim=2)

    local = [mine(t.detach()).requires_grad_() for t in (q, k, v)]
    out = RingAttention(group, tuple(range(WORLD)), rank)(*local)
    out.backward(mine(dout))
    assert out.dtype is torch.bfloat16
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, mine(full.detach()), **tol)
    for name, got, ref in zip("qkv", local, (q, k, v), strict=True):
        assert got.grad is not None and ref.grad is not None
        torch.testing.assert_close(got.grad, mine(ref.grad), **tol, msg=lambda m, n=name: f"d{n}: {m}")
