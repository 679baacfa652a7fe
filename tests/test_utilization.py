"""MFU and HFU over the GPUs a plan uses, the cluster-wide figures beside them (Note [utilization])."""

from __future__ import annotations

import json

import pytest

from hetc.cli import main
from hetc.passes.cost.shapes import LayerKind, layer_flops, layer_kind
from tests.costspecs import cost_model, plan_text, write_spec

# Two of the cluster's eight A100s hold a rank; the other six are idle.
TWO_OF_EIGHT = """
  stage all {
    layers = embed..head
    ranks = n[0, 0:2]
    lanes = 2
    OFFLOAD
  }
  idle = [n[0, 2:4], n[1]]
"""


def _estimate(tmp_path, ckpt: str = "none", offload: str = ""):
    body = TWO_OF_EIGHT.replace("OFFLOAD", offload)
    return cost_model(tmp_path, plan_text(body, ckpt=ckpt, global_batch=8)).estimate()


def test_idle_gpus_count_only_in_the_cluster_figure(tmp_path):
    e = _estimate(tmp_path)
    u = e.utilization
    assert (u.used_gpus, u.cluster_gpus) == (2, 8)
    assert u.used_peak_flops == 2 * 19.5e12 and u.cluster_peak_flops == 8 * 19.5e12   # fp32 A100 peaks
    assert e.mfu == pytest.approx(e.model_flops_per_step / (e.step_time_s * 2 * 19.5e12))
    assert u.cluster_mfu == pytest.approx(e.mfu / 4) and u.cluster_hfu == pytest.approx(e.hfu / 4)


def _block_forward_flops(m, micro_batch: int) -> float:
    return sum(layer_flops(m, i, micro_batch).forward for i in range(m.num_model_layers)
               if layer_kind(m, i) == LayerKind.BLOCK)


def test_hfu_counts_recomputation_and_mfu_does_not(tmp_path):
    none, full = _estimate(tmp_path), _estimate(tmp_path, ckpt="full")
    assert none.hfu == pytest.approx(none.mfu)
    assert full.model_flops_per_step == none.model_flops_per_step   # MFU's work ignores recomputation
    m, microbatches = cost_model(tmp_path, plan_text(TWO_OF_EIGHT.replace("OFFLOAD", ""), global_batch=8)).model, 8
    # full checkpointing runs every block's forward once more per microbatch
    recomputed = full.hardware_flops_per_step - full.model_flops_per_step
    assert recomputed == pytest.approx(microbatches * _block_forward_flops(m, 1))
    assert full.hfu / full.mfu == pytest.approx(full.hardware_flops_per_step / full.model_flops_per_step)
    assert full.hfu > full.mfu


def test_offloaded_activations_are_recomputed_work(tmp_path):
    plain = _estimate(tmp_path)
    offload = _estimate(tmp_path, offload="offload { activations = cpu }")
    recomputed = offload.hardware_flops_per_step - offload.model_flops_per_step
    # the stage reruns its whole forward (every layer, head included) for each microbatch
    assert recomputed == pytest.approx(plain.model_flops_per_step / 3)
    assert offload.hfu > offload.mfu


def test_explain_and_plan_show_both_figures(tmp_path, capsys):
    spec = write_spec(tmp_path, plan_text(TWO_OF_EIGHT.replace("OFFLOAD", ""), ckpt="full", global_batch=8))
    assert main(["explain", str(spec), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hfu"] > out["mfu"] > out["cluster_mfu"] > 0 and out["hfu"] > out["cluster_hfu"]
    assert (out["used_gpus"], out["cluster_gpus"]) == (2, 8)
    assert main(["explain", str(spec)]) == 0
    text = capsys.readouterr().out
    assert "over 2 used GPUs" in text and "cluster-wide MFU" in text and "over 8 GPUs" in text
    assert main(["plan", str(spec), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["mfu"] == pytest.approx(out["mfu"]) and planned["cluster_mfu"] == pytest.approx(out["cluster_mfu"])
    assert main(["plan", str(spec)]) == 0
    assert "cluster-wide MFU" in capsys.readouterr().err
