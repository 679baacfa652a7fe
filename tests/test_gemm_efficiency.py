"""Compute time by matrix shape (passes/cost/gemm.py, Note [GEMM curve]) and the published-runs benchmark."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from benchmarks.published_runs import LLAMA3_ENGINE, RUNS, _stage_layers, predict, spec_text
from hetc.passes.cost import Profiles, compute, gemm
from hetc.passes.cost.compute import ComputeModel, streaming_bandwidth
from hetc.passes.cost.gemm import DeviceFacts, Gemm, attention_efficiency, block_gemms, gemm_efficiency, \
    gemm_seconds, head_gemms, layer_seconds
from hetc.passes.cost.params import block_params
from hetc.passes.cost.shapes import LayerKind, layer_flops
from hetc.runtime.nn.attention import causal_attention, unfused_causal_attention
from hetc.runtime.nn.model import build_layer
from hetc.ir.spec import DTYPE_BYTES, Arch, AttentionKind, DType, MoESpec, ModelSpec
from tests.costspecs import ONE_LANE, cluster, cost_model, plan_text
from tests.test_estimate_sanity import _profile

A100 = DeviceFacts(peak=312e12, asymptote=0.8, sms=108, memory_bandwidth=2.0e12, dtype_bytes=2)
# the catalog's A100 names its SM count: its compute without a profile follows the curve
SHAPED = cluster(device="A100-80")
LLAMA = ModelSpec(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=4096, dtype=DType.BF16)


def test_large_gemms_reach_the_asymptote_and_small_ones_less():
    sizes = (256, 1024, 4096, 16384)
    efficiency = [gemm_efficiency(n, n, n, A100) for n in sizes]
    assert efficiency == sorted(efficiency)
    assert efficiency[-1] == pytest.approx(A100.asymptote, rel=0.02)
    assert efficiency[0] < 0.5 * A100.asymptote


def test_a_partial_last_wave_costs_a_whole_wave():
    # 108 tiles of 256x128 fill one wave on 108 SMs; one more row of tiles needs a second, almost idle wave
    full, one_more = Gemm(256 * 108, 128, 8192), Gemm(256 * 109, 128, 8192)
    per_flop = [gemm_seconds(g, A100) / g.flops for g in (full, one_more)]
    assert per_flop[1] > 1.3 * per_flop[0]
    # on 132 SMs both fit in one wave: no step
    h100_like = dataclasses.replace(A100, sms=132)
    assert gemm_seconds(one_more, h100_like) / one_more.flops == pytest.approx(
        gemm_seconds(full, h100_like) / full.flops, rel=0.01)


def test_small_gemms_are_memory_bound():
    skinny = Gemm(16, 8192, 8192)   # a few tokens through a large weight
    moved = (16 * 8192 + 8192 * 8192 + 16 * 8192) * A100.dtype_bytes
    assert gemm_seconds(skinny, A100) == pytest.approx(moved / A100.memory_bandwidth)
    assert gemm_efficiency(16, 8192, 8192, A100) < 0.2 * gemm_efficiency(4096, 8192, 8192, A100)


def test_flash_attention_speeds_up_with_sequence_and_head_size():
    assert attention_efficiency(512, 128, A100) < attention_efficiency(8192, 128, A100)
    assert attention_efficiency(4096, 64, A100) < attention_efficiency(4096, 128, A100)
    assert attention_efficiency(4096, 128, A100, backward=True) < attention_efficiency(4096, 128, A100)


@pytest.mark.parametrize("model", [
    LLAMA,
    dataclasses.replace(LLAMA, arch=Arch.GPT, kv_heads=None, ffn=4 * 4096),
    dataclasses.replace(LLAMA, moe=MoESpec(experts=8, top_k=2)),
], ids=["llama", "gpt", "moe"])
def test_the_gemms_are_the_layer_flops(model):
    tokens, tp = model.seq, 4
    block = sum(g.flops for g in block_gemms(model, tokens, tp)) * tp
    assert block == pytest.approx(layer_flops(model, 1, 1).linear, rel=1e-3)
    head = sum(g.flops for g in head_gemms(model, tokens, tp)) * tp
    assert head == pytest.approx(layer_flops(model, model.layers + 1, 1).linear, rel=1e-3)


def test_unfused_attention_is_slower_than_flash_and_computes_the_same():
    flash = layer_seconds(LLAMA, LayerKind.BLOCK, 1, 1, A100)
    unfused = layer_seconds(dataclasses.replace(LLAMA, attention=AttentionKind.UNFUSED), LayerKind.BLOCK, 1, 1,
                            A100)
    assert unfused[0] > flash[0] and unfused[1] > flash[1]
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(unfused_causal_attention(q, k, v), expected)


def test_the_runtime_runs_the_attention_the_spec_names():
    small = ModelSpec(layers=1, hidden=64, heads=4, ffn=128, vocab=32, seq=16)
    for kind, core in ((AttentionKind.FLASH, causal_attention), (AttentionKind.UNFUSED, unfused_causal_attention)):
        block = build_layer(dataclasses.replace(small, attention=kind), 1, seed=0, initialise=False)
        assert block.attention.core is core


def test_explain_reads_compute_time_through_the_curve(tmp_path, monkeypatch):
    cm = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16", clusters=SHAPED))
    device = cm.hardware.devices["A100-80"]
    facts = DeviceFacts(device.peak.for_dtype(DType.BF16), device.efficiency, device.sms, streaming_bandwidth(device),
                        DTYPE_BYTES[DType.BF16])
    assert cm.compute.layer("A100-80", LayerKind.BLOCK, 1, 1).forward == \
        pytest.approx(layer_seconds(cm.model, LayerKind.BLOCK, 1, 1, facts)[0])
    before = cm.estimate().step_time_s
    # the largest tile only: this small model's multiplies fill fewer SMs, and the step is slower
    monkeypatch.setattr(gemm, "TILES", ((256, 128, 1.0),))
    after = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16", clusters=SHAPED)).estimate().step_time_s
    assert after > before


def test_memory_bound_work_streams_at_the_measured_fraction_of_the_datasheet(tmp_path, monkeypatch):
    """Note [streaming bandwidth]: the optimizer step and the embedding's bytes move at 0.9 of the datasheet's
    HBM rate, as the best streaming kernels measure, not at the datasheet's."""
    cm = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16", clusters=SHAPED))
    device = cm.hardware.devices["A100-80"]
    assert streaming_bandwidth(device) == pytest.approx(0.9 * device.memory_bandwidth)
    rank = cm.hardware.gpus[0].id
    streamed = (cm.hardware.optimizer_time(rank, 1e9, on_host=False),
                cm.compute.layer("A100-80", LayerKind.EMBED, 1, 1).forward)
    monkeypatch.setattr(compute, "STREAM_FRACTION", 1.0)
    at_datasheet = (cm.hardware.optimizer_time(rank, 1e9, on_host=False),
                    ComputeModel(cm.model, Profiles(), cm.hardware.devices).layer("A100-80", LayerKind.EMBED, 1, 1)
                    .forward)
    assert streamed == pytest.approx(tuple(t / 0.9 for t in at_datasheet))


def test_explain_says_which_way_the_arithmetic_timed_the_layers(tmp_path):
    """Note [provenance]: by matrix shape on a kind that names its SMs, one flat fraction of peak elsewhere."""
    shaped = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16", clusters=SHAPED)).estimate()
    flat = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16", clusters=cluster(device="P100"))).estimate()
    assert set(shaped.provenance.layers[0]) == \
        {"arithmetic, A100-80: each matrix multiply by its shape on 108 SMs, at most 0.8 of peak"}
    assert set(flat.provenance.layers[0]) == \
        {"arithmetic, P100: 0.35 of peak for every layer (name its `sms` to time them by shape)"}


def test_a_profile_overrides_the_curve(tmp_path):
    text = plan_text(ONE_LANE, dtype="fp32", clusters=SHAPED)
    cm = cost_model(tmp_path, text)
    measured = _profile("A100-80", cm.model.hidden, block_params(cm.model), (1e-3, 2e-3), (2e-3, 4e-3), "p")
    block = cost_model(tmp_path, text, measured).compute.layer("A100-80", LayerKind.BLOCK, 1, 1)
    assert block.forward == pytest.approx(3e-3) and block.source != "arithmetic"


def test_a_device_without_sms_keeps_the_flat_efficiency(tmp_path):
    cm = cost_model(tmp_path, plan_text(ONE_LANE, dtype="bf16", clusters=SHAPED))
    flat = dataclasses.replace(cm.hardware.devices["A100-80"], sms=0)
    compute = ComputeModel(cm.model, Profiles(), {"A100-80": flat})
    rate = flat.peak.for_dtype(DType.BF16) * flat.efficiency
    assert compute.layer("A100-80", LayerKind.BLOCK, 1, 1).forward == \
        pytest.approx(layer_flops(cm.model, 1, 1).forward / rate)


def test_a_published_run_becomes_a_spec_and_is_timed(tmp_path):
    run = next(r for r in RUNS if r.name.startswith("GPT 1T (N21)"))
    # the paper's aggregate: 163 TFLOP/s on each of 3,072 GPUs, 502 PFLOP/s in all
    assert run.model_flops(recompute=True) / run.measured_s() == pytest.approx(502e15, rel=0.01)
    text = spec_text(run)
    assert "attention = unfused" in text and "tp = 8" in text and text.count("stage pp") == 64
    assert predict(run) > 0


def test_an_interleaved_h100_run_becomes_a_spec_with_its_virtual_stages():
    run = next(r for r in RUNS if r.name.startswith("Nemotron-4 340B DP 64"))
    # the report's MFU at 6,144 GPUs (41.0 %) is the FLOP count (GQA, FFN 4h, logits) over its 8.0 s
    assert run.model_flops(recompute=False) / (run.gpus * run.machine.peak_bf16 * run.measured_s()) == \
        pytest.approx(0.410, abs=0.003)
    text = spec_text(run)
    assert "schedule = interleaved" in text and "device = H100\n" in text and "kv_heads = 8" in text
    # Megatron's round robin: stage 0 holds chunks 0, 12, 24, ...; the head ends the last stage's last chunk
    assert "layers = [embed..block0, block12..block12, block24..block24" in text
    assert text.rstrip().endswith("block95..head]\n    ranks = dgx[704:768]\n    lanes = 64\n    tp = 8\n"
                                  "    sequence_parallel = true\n  }\n}")
    assert predict(run) > 0


def test_a_published_run_times_at_another_asymptote_of_its_kind():
    """benchmarks/published_runs.py's sensitivity table: the kind's own asymptote times the run as the catalog
    does, and a lower one (a device held at its power limit) times it proportionally longer where compute
    paces it, the SM count and everything else of the kind kept."""
    run = next(r for r in RUNS if r.name.startswith("Nemotron-4 340B DP 16"))
    kind = run.machine.kind
    assert predict(run, asymptote=kind.efficiency) == pytest.approx(predict(run))
    text = spec_text(run, asymptote=0.7)
    assert "device = H100-at-70\n" in text and "efficiency = 0.7" in text and f"sms = {kind.sms}" in text
    slower = predict(run, asymptote=0.7) / predict(run)
    assert 1.0 < slower < kind.efficiency / 0.7


def test_every_published_plan_fits_the_gpus_it_ran_on(tmp_path):
    """A plan as published ran, so its spec must fit: a run whose facts are wrong (Nemotron-4 340B without
    its distributed optimizer: 93 GiB on an 80 GiB H100) is caught here, not read as a time. Llama 3's runs
    are the exception, and must stay one: their own schedule keeps fewer microbatches in flight than the
    interleaved 1F1B they are written as."""
    from hetc.compiler import load_checked
    from hetc.passes.cost import CostModel

    over = []
    for i, run in enumerate(RUNS):
        if run.engine == LLAMA3_ENGINE and run.dp > 64:
            continue                    # the 8,192-GPU run shows it; twice the lanes add only time here
        path = tmp_path / f"run{i}.het"
        path.write_text(spec_text(run))
        _, checked = load_checked(path, require_complete=True)
        plan = checked.explicit()
        assert plan is not None, run.name
        if not CostModel(plan, Profiles()).estimate().fits:
            over.append(run.name)
    assert over == [r.name for r in RUNS if r.engine == LLAMA3_ENGINE and r.dp == 64]


def test_llama3s_lighter_end_stages_leave_the_embedding_and_the_head_alone():
    """Llama 3 405B's 126 blocks over 16 stages of 8 one-block virtual stages: the first and the last stage
    hold one block fewer, so the first chunk is the embedding alone and the last the head alone, and every
    block is in exactly one chunk, in Megatron's round robin."""
    run = next(r for r in RUNS if r.engine == LLAMA3_ENGINE)
    chunks = {}
    for stage in range(run.pp):
        for j, text in enumerate(_stage_layers(run, stage).split(", ")):
            chunks[j * run.pp + stage] = text
    assert chunks[0] == "embed..embed" and chunks[len(chunks) - 1] == "head..head"
    assert [chunks[c] for c in range(1, len(chunks) - 1)] == [f"block{b}..block{b}" for b in range(run.layers)]
