"""The precision the model costs is the precision that runs (issue 29, item 4; Note [Precision that runs]).

A kind runs the dtypes its peak block lists; a model dtype it does not list
is costed at its fp32 rate; fp8 is costed as bf16 (what the runtime computes)
and refused on kinds without fp8 units; the runtime turns TF32 on for tf32
models only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetc.cli import main
from hetc.compiler import load_checked
from hetc.passes.cost.memory import state_bytes_per_param
from hetc.passes.cost.profiles import dtype_class
from hetc.passes.cost.shapes import LayerKind
from hetc.runtime.nn import model as nn_model
from hetc.runtime.nn.model import build_ministage, compute_dtype, float32_matmul_precision, use_matmul_precision
from hetc.ir.spec import DType, DeviceSpec, ModelSpec
from tests.costspecs import ONE_LANE, cluster, cost_model, plan_text, write_spec

CATALOG = Path(__file__).resolve().parent.parent / "specs" / "catalog.het"

# Datasheet facts: which tensor-core formats each catalog kind has (dense; fp32 is every kind's).
# Volta/Turing: fp16 only; Pascal: no tensor cores (P100 has 2x fp16, P40 none); Ampere: tf32, bf16, fp16;
# Ada/Hopper: those and fp8; RDNA2 (W6800): 2x fp16.
NATIVE = {
    "H100": "tf32 bf16 fp16 fp8", "H100-NVL": "tf32 bf16 fp16 fp8", "H200": "tf32 bf16 fp16 fp8",
    "GH200": "tf32 bf16 fp16 fp8", "L4": "tf32 bf16 fp16 fp8", "L40S": "tf32 bf16 fp16 fp8",
    "A100-40": "tf32 bf16 fp16", "A100-80": "tf32 bf16 fp16", "A10G": "tf32 bf16 fp16",
    "RTX3090": "tf32 bf16 fp16", "A6000": "tf32 bf16 fp16",
    "V100-16": "fp16", "V100-32": "fp16", "T4": "fp16", "TitanRTX": "fp16", "RTX2080Ti": "fp16",
    "P100": "fp16", "W6800": "fp16", "P40": "", "cpu": "",
}


def _catalog() -> dict[str, DeviceSpec]:
    return {d.name: d for d in load_checked(CATALOG)[1].spec.devices}


def test_every_catalog_kind_lists_exactly_the_dtypes_its_datasheet_gives_it():
    catalog = _catalog()
    assert set(catalog) == set(NATIVE), "a new catalog kind needs its row in NATIVE"
    for name, device in catalog.items():
        expected = {DType.FP32, *(DType(d) for d in NATIVE[name].split())}
        assert set(device.peak.listed()) == expected, name
        assert all(device.runs(d) == (d in expected) for d in DType), name


def test_a_dtype_the_kind_lacks_runs_at_its_fp32_peak_not_another_formats():
    v100 = _catalog()["V100-16"]
    assert not v100.runs(DType.BF16)
    # before: the fp16 tensor-core peak, 8x what torch reaches for bf16 on a V100
    assert v100.peak.for_dtype(DType.BF16) == v100.peak.fp32
    assert v100.peak.for_dtype(DType.TF32) == v100.peak.fp32
    assert v100.peak.for_dtype(DType.FP16) == v100.peak.fp16


def test_a_bf16_model_on_v100_is_costed_at_the_fp32_rate(tmp_path):
    def block_forward(dtype: str) -> float:
        cm = cost_model(tmp_path, plan_text(ONE_LANE, dtype=dtype, clusters=cluster(device="V100-16")))
        return cm.compute.layer("V100-16", LayerKind.BLOCK, 1, 1).forward

    # the fp32 rate's arithmetic; only the memory-bound ops move two bytes an element, not four
    assert block_forward("fp32") * 0.95 < block_forward("bf16") <= block_forward("fp32")
    assert block_forward("bf16") > 5 * block_forward("fp16")   # 125 vs 15.7 TFLOP/s on the datasheet


def test_fp8_on_h100_is_costed_as_bf16_peak_and_bytes(tmp_path):
    def cost(dtype: str):
        return cost_model(tmp_path, plan_text(ONE_LANE, dtype=dtype, clusters=cluster(device="H100")))

    fp8, bf16 = cost("fp8"), cost("bf16")
    assert fp8.compute.layer("H100", LayerKind.BLOCK, 1, 1) == bf16.compute.layer("H100", LayerKind.BLOCK, 1, 1)
    assert state_bytes_per_param(fp8.model) == state_bytes_per_param(bf16.model)
    assert fp8.estimate().step_time_s == pytest.approx(bf16.estimate().step_time_s)
    assert _catalog()["H100"].peak.for_dtype(DType.FP8) == _catalog()["H100"].peak.bf16


def test_a_profile_times_only_models_that_run_at_its_speed():
    assert dtype_class("fp8") == dtype_class("bf16") == dtype_class("fp16")
    # the runtime turns TF32 on for tf32 models only: an fp32 profile does not time a tf32 model
    assert dtype_class("tf32") != dtype_class("fp32")


def test_fp8_on_a100_is_refused_at_the_models_dtype(tmp_path, capsys):
    path = write_spec(tmp_path, plan_text(ONE_LANE, dtype="fp8", clusters=cluster(device="A100-40")))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "plan.het:11:11: error: dtype = fp8, but device kind 'A100-40' has no fp8 units" in err
    assert "its peak lists fp32, tf32, bf16, fp16" in err and "Traceback" not in err


def test_fp8_on_a_kind_with_fp8_units_is_accepted(tmp_path):
    path = write_spec(tmp_path, plan_text(ONE_LANE, dtype="fp8", clusters=cluster(device="L4")))
    assert main(["check", str(path)]) == 0


def test_the_runtime_computes_fp8_in_bf16_as_the_cost_model_assumes():
    assert compute_dtype(DType.FP8) is torch.bfloat16


@pytest.mark.parametrize(("dtype", "precision"), [(DType.TF32, "high"), (DType.FP32, "highest"),
                                                  (DType.BF16, "highest"), (DType.FP16, "highest"),
                                                  (DType.FP8, "highest")])
def test_only_a_tf32_model_turns_tf32_matmuls_on(dtype, precision):
    assert float32_matmul_precision(dtype) == precision


def test_the_precision_is_set_on_cuda_ranks_only(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    use_matmul_precision(DType.TF32, torch.device("cuda", 0))
    use_matmul_precision(DType.FP32, torch.device("cuda", 0))
    use_matmul_precision(DType.TF32, torch.device("cpu"))
    assert calls == ["high", "highest"]


def test_a_rank_sets_the_precision_where_it_builds_its_ministage(monkeypatch):
    seen: list[tuple[DType, torch.device]] = []
    monkeypatch.setattr(nn_model, "use_matmul_precision", lambda dtype, device: seen.append((dtype, device)))
    model = ModelSpec(name="m", layers=1, hidden=32, heads=2, ffn=64, vocab=64, seq=8, dtype=DType.TF32)
    build_ministage(model, range(3), seed=0)
    assert seen == [(DType.TF32, torch.device("cpu"))]


ONE_RANK = """
parallel {
  stage all { layers = embed..head, ranks = host[0, 0], lanes = 1 }
  idle = [host[0, 1], host[1]]
}
"""
