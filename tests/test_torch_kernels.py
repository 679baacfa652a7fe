"""The runtime's hot loops run torch's own kernels: SDPA's GQA instead of copying K/V, ring-attention blocks
through SDPA in the compute dtype, MoE experts as grouped matmuls without host syncs, and torch.optim's
foreach / fused Adam instead of hand-written elementwise ops, with the numbers of the plain versions."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from hetc.runtime.nn import sdpa_blocks
from hetc.runtime.nn.attention import causal_attention
from hetc.runtime.nn.model import build_layer
from hetc.runtime.nn.moe import MoE
from hetc.runtime.nn.ring_attention import RingAttention
from hetc.runtime.optim import init_state, optimizer_step
from hetc.ir.spec import Arch, MoESpec, OptimizerKind, OptimizerSpec
from tests.test_model import tiny

TORCH_ADAM = importlib.import_module("torch.optim.adam")   # the module; torch.optim's `adam` name is not it
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())")


def qkv(n_q: int, n_kv: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(n_q * 10 + n_kv)
    return tuple(torch.randn(2, n, 12, 8, generator=gen, dtype=dtype).requires_grad_()  # type: ignore[return-value]
                 for n in (n_q, n_kv, n_kv))


def repeated_kv_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """GQA written out: every query head gets its own copy of its group's K/V."""
    repeat = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1),
                                          is_causal=True)


def test_causal_attention_hands_sdpa_the_compact_kv(monkeypatch):
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        seen.append(k.shape[1])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)   # the name attention.py calls
    causal_attention(*qkv(8, 2))
    assert seen == [2], "K/V reach SDPA with their own 2 heads, not copied to the 8 query heads"


@pytest.mark.parametrize("n_q, n_kv", [(4, 2), (8, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gqa_attention_equals_repeating_kv(n_q, n_kv, dtype):
    ours, plain = qkv(n_q, n_kv, dtype), qkv(n_q, n_kv, dtype)
    out, ref = causal_attention(*ours), repeated_kv_attention(*plain)
    assert torch.equal(out, ref), "the forward is the same computation"
    (out.float() ** 2).sum().backward()
    (ref.float() ** 2).sum().backward()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype is torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(ours, plain, strict=True):   # K/V gradients sum each group in another order
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, **tol)


# ---------------------------------------------------------------- ring attention blocks


def test_a_ring_block_runs_sdpa_in_the_compute_dtype(monkeypatch):
    """A one-rank ring is one causal block: SDPA's own bf16 kernel, forward and backward, bit for bit."""
    seen: list[torch.dtype] = []
    forward = sdpa_blocks.CpuFlash.forward

    def spy(self, q: Tensor, *args) -> tuple[Tensor, Tensor]:
        seen.append(q.dtype)
        return forward(self, q, *args)

    monkeypatch.setattr(sdpa_blocks.CpuFlash, "forward", spy)
    ours, plain = qkv(4, 2, torch.bfloat16), qkv(4, 2, torch.bfloat16)
    out = RingAttention(None, (0,), 0)(*ours)
    ref = F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True)
    assert seen == [torch.bfloat16], "the block's scores are bf16, not an fp32 copy"
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(ours, plain, strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_grouped_math_block_is_the_sdpa_block(causal, dtype):
    """The fallback (fp32 on CUDA, odd head sizes) shares K/V heads by reshaping Q and agrees with the kernel."""
    q, k, v = (t.detach() for t in qkv(4, 2, dtype))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    flash, math_ = sdpa_blocks.CpuFlash(), sdpa_blocks.GroupedMath()
    out, lse = flash.forward(q, k, v, causal, 0.5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype is torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(math_.forward(q, k, v, causal, 0.5), (out, lse), strict=True):
        torch.testing.assert_close(got, want, **tol)
    for got, want in zip(math_.backward(dout, q, k, v, out, lse, causal, 0.5),
                         flash.backward(dout, q, k, v, out, lse, causal, 0.5), strict=True):
        torch.testing.assert_close(got, want, **tol)


# ---------------------------------------------------------------- MoE experts


HOST_SYNCS = ("tolist", "item", "nonzero", "__bool__", "__int__", "__float__")


def moe_layer(arch: Arch) -> MoE:
    model = tiny(arch, moe=MoESpec(experts=4, top_k=2, capacity_factor=0.5))    # drops: the masked rows too
    moe = build_layer(model, 1, seed=3).feed_forward
    assert isinstance(moe, MoE)
    return moe


@pytest.mark.parametrize("arch", list(Arch))
def test_moe_layer_reads_nothing_back_to_the_host(arch, monkeypatch):
    """Note [static routing shapes]: without expert parallelism no count reaches the host."""
    moe = moe_layer(arch)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    calls: list[str] = []
    for name in HOST_SYNCS:
        method = getattr(Tensor, name)
        monkeypatch.setattr(Tensor, name, lambda self, *a, _m=method, _n=name, **k: calls.append(_n) or _m(self, *a, **k))
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: calls.append("torch.nonzero") or pytest.fail("nonzero"))
    moe(x).square().sum().backward()
    monkeypatch.undo()
    assert calls == []


@pytest.mark.parametrize("arch", list(Arch))
def test_moe_experts_run_as_one_grouped_matmul_per_projection(arch, monkeypatch):
    moe = moe_layer(arch)
    products: list[int] = []
    grouped_mm = torch._grouped_mm

    def spy(a: Tensor, b: Tensor, **kwargs) -> Tensor:
        products.append(b.shape[0] if b.dim() == 3 else -1)
        return grouped_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    for expert in moe.experts.values():
        monkeypatch.setattr(expert, "forward", lambda *_: pytest.fail("an expert ran on its own"))
    moe(torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0)))
    projections = 3 if arch is Arch.LLAMA else 2
    assert products == [4] * projections, "each projection: one call over all 4 experts' weights"


@pytest.mark.gpu
@needs_cuda
def test_a_bf16_ring_block_on_cuda_is_sdpa():
    """The CUDA flash path of a ring block (compact GQA K/V, its own backward) against torch's SDPA."""
    ours = [t.detach().cuda().requires_grad_() for t in qkv(4, 2, torch.bfloat16)]
    plain = [t.detach().clone().requires_grad_() for t in ours]
    out = RingAttention(None, (0,), 0)(*ours)
    ref = F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    for a, b in zip(ours, plain, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", list(Arch))
def test_moe_grouped_experts_on_cuda_match_cpu(arch):
    """torch._grouped_mm on CUDA (fp32 here) gives the CPU layer's output and gradients."""
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    results = []
    for device in ("cpu", "cuda"):
        moe = moe_layer(arch).to(device)
        xin = x.clone().to(device).requires_grad_()
        out = moe(xin)
        out.square().sum().backward()
        assert xin.grad is not None
        results.append((out.detach().cpu(), xin.grad.cpu()))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


ADAMS = [OptimizerSpec(kind=OptimizerKind.ADAMW, weight_decay=0.1, beta2=0.95),
         OptimizerSpec(kind=OptimizerKind.ADAM, weight_decay=0.01)]


def torch_adam(opt: OptimizerSpec, param: Tensor, **impl: bool) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if opt.kind is OptimizerKind.ADAMW else torch.optim.Adam
    return cls([param], lr=1.0, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay, **impl)


def run_both(opt: OptimizerSpec, device: str, **impl: bool) -> tuple[Tensor, Tensor]:
    """Four steps of hetc's shard step and of torch.optim on the same shard; the two final params."""
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(1000, generator=gen)
    ours, ref = init.clone().to(device), torch.nn.Parameter(init.clone().to(device))
    state, torch_opt = init_state(opt, ours), torch_adam(opt, ref, **impl)
    for step, lr in enumerate([1e-2, 3e-3, 5e-3, 1e-3]):
        grad = torch.randn(1000, generator=gen).to(device)
        optimizer_step(opt, ours, grad, state, lr=lr, step=step)
        ref.grad = grad.clone()
        torch_opt.param_groups[0]["lr"] = lr
        torch_opt.step()
    return ours, ref.detach()


@pytest.mark.parametrize("opt", ADAMS, ids=lambda o: o.kind.value)
def test_shard_step_is_one_foreach_adam_call_on_cpu(opt, monkeypatch):
    calls: list[int] = []
    multi_tensor = TORCH_ADAM._multi_tensor_adam

    def spy(params: list[Tensor], *args, **kwargs) -> None:
        calls.append(len(params))
        multi_tensor(params, *args, **kwargs)

    monkeypatch.setattr(TORCH_ADAM, "_multi_tensor_adam", spy)
    ours, ref = run_both(opt, "cpu", foreach=True)
    assert calls == [1, 1, 1, 1, 1, 1, 1, 1], "each step of hetc and of torch.optim is one foreach call"
    assert torch.equal(ours, ref), "bitwise torch.optim.Adam(W)(foreach=True)"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("opt", ADAMS, ids=lambda o: o.kind.value)
def test_shard_step_is_torch_fused_adam_on_cuda(opt):
    ours, ref = run_both(opt, "cuda", fused=True)
    assert torch.equal(ours, ref), "bitwise torch.optim.Adam(W)(fused=True)"
