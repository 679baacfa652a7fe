"""benchmarks/gpu_check.py, the one-GPU check (issue 29, item 8): its CPU dry run, its overlap arithmetic,
and the CUDA path it exists for (`gpu`-marked: runs where torch.cuda is available, skips elsewhere)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check
from benchmarks.gpu_check import CHECKS, RUN_CPU, Context, Job, Row, run_checks, write_plans
from benchmarks.gpu_check_rank import copy_overlap, hidden_share, union

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STATUSES = {"ok", "fail", "n/a", "unsupported", "skipped", "error", "timeout"}
# the rows the dry run writes, in order: a check may write more than one row (the 1-rank run: two)
ROWS = ["versions", "verify 1B single (nccl)", "verify 1B zorse_offload (nccl)", "verify 1B pp2 (nccl)", "matmul asymptote",
        "streaming bandwidth", "GEMM curve", "profile", "step time, 1 rank", "peak memory, 1 rank", "offload overlap",
        "checkpoint + resume", "2-stage, one device, gloo", "fp16 loss scale", "gpu-marked tests", "loss falls"]
ONLY_ON_A_GPU = {"gpu-marked tests"}     # a CPU dry run records them as skipped

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())")


@pytest.mark.slow
def test_cpu_quick_dry_run_records_every_check(tmp_path: Path) -> None:
    """`gpu_check.py --cpu --quick` runs the whole sequence here and exits 0, and its JSON and table have a
    row with a status for every check: what a GPU session will run once must not break on its first run."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "cpu"
    rows = {row["check"]: row for row in report["checks"]}
    assert list(rows) == ROWS
    assert all(row["status"] in STATUSES for row in rows.values()), rows
    assert not [row for name, row in rows.items() if row["status"] in ("error", "timeout", "skipped")
                and name not in ONLY_ON_A_GPU], rows
    assert all(rows[name]["status"] == "skipped" for name in ONLY_ON_A_GPU)
    assert rows["checkpoint + resume"]["status"] == "ok"   # fp32 on CPU: the resumed losses are the same
    assert rows["loss falls"]["status"] == "ok"
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in ROWS)
    assert table in done.stdout


def test_every_check_has_a_limit_and_a_unique_name() -> None:
    names = [name for name, _, _ in CHECKS]
    assert len(set(names)) == len(names)
    assert all(limit > 0 for _, limit, _ in CHECKS)
    assert sum(limit for _, limit, _ in CHECKS) >= 480   # the budget, not the sum of limits, ends the run


def test_rows_are_recorded_after_every_check_so_a_run_cut_off_keeps_them(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A lent GPU machine can be taken back mid-run: each finished check's row must already be on disk, and a
    check that breaks is a row of its own, not the end of the run."""
    def broken(ctx: Context) -> list[Row]:
        raise RuntimeError("the device went away")

    checks = [("first", 10.0, lambda ctx: [Row("first", "ok")]), ("second", 10.0, broken),
              ("third", 10.0, lambda ctx: [Row("third", "ok")])]
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    seen: list[list[str]] = []
    rows = run_checks(Context(gpu=False, quick=True, work=tmp_path, kind="cpu"), 60,
                      lambda rows: seen.append([r.check for r in rows]))
    assert seen == [["first"], ["first", "second"], ["first", "second", "third"]]
    assert [r.status for r in rows] == ["ok", "error", "ok"] and "went away" in rows[1].detail


def test_only_runs_the_checks_it_names_and_refuses_a_name_it_does_not_know(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--only` reruns part of the sequence (a second lease after a run was cut off); a misspelt check is exit 2
    with the names, before any device work."""
    checks = [(name, 10.0, lambda ctx, name=name: [Row(name, "ok")]) for name in ("first", "second", "third")]
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    rows = run_checks(Context(gpu=False, quick=True, work=tmp_path, kind="cpu"), 60, only=frozenset({"third", "first"}))
    assert [r.check for r in rows] == ["first", "third"]
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--only", "matmul asymptote,matmul asymptot"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "'matmul asymptot'" in done.stderr and "GEMM curve" in done.stderr, done.stderr


def test_gemm_curve_times_every_block_shape_and_flash_attention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMM-curve row's own path, run here on CPU tensors against H100's curve at a tiny scale (the published
    blocks shrunk 16-fold): four multiplies a block in three layouts each, and flash attention where the run
    used it, each beside the model's figure; the first GPU session must not be where it first runs."""
    blocks = gpu_check._published_blocks()
    assert {name for name, *_ in blocks} >= {"GPT 1.7B (N21)", "Nemotron-4 340B DP 16 (N24)", "Llama 3 405B DP 64 (L24)"}

    def shrunk(model: Any) -> Any:
        return dataclasses.replace(model, hidden=model.hidden // 16, ffn=model.ffn // 16, heads=model.heads // 8,
                                   kv_heads=max(1, model.num_kv_heads // 8), seq=128)

    small = [(name, shrunk(model), mb, tp) for name, model, mb, tp in (blocks[0], blocks[-1])]
    monkeypatch.setattr(gpu_check, "_published_blocks", lambda: small)
    (row,) = gpu_check.check_gemm_curve(Context(gpu=False, quick=True, work=tmp_path, kind="H100"))
    assert row.status == "ok" and len(row.data["shapes"]) == 2 * 4 * 3
    assert {s["layout"] for s in row.data["shapes"]} == {"fprop", "dgrad", "wgrad"}
    assert all(s["measured_s"] > 0 and 0 < s["model"] <= 1 for s in row.data["shapes"])
    assert [a["run"] for a in row.data["attention"]] == ["Llama 3 405B DP 64 (L24)"]   # the last block, SwiGLU
    assert all(isinstance(s["compute_bound"], bool) for s in row.data["shapes"]) and "implied_asymptote" in row.data


def test_the_implied_asymptote_scales_the_catalogs_by_the_compute_bound_shapes_time() -> None:
    """Compute-bound shapes take 1/asymptote of time in the model: measured 25 % slower than modelled at 0.8,
    the device's asymptote is 0.64; memory-bound shapes (the roofline's time) say nothing about it."""
    shapes = [{"model_s": 1.0, "measured_s": 1.25, "compute_bound": True},
              {"model_s": 3.0, "measured_s": 3.75, "compute_bound": True},
              {"model_s": 1.0, "measured_s": 9.0, "compute_bound": False}]
    assert gpu_check.implied_asymptote(shapes, 0.8) == pytest.approx(0.64)
    assert gpu_check.implied_asymptote(shapes[2:], 0.8) is None


def test_hidden_share_counts_copy_time_under_compute_once() -> None:
    copies = [(0.0, 10.0), (5.0, 15.0), (30.0, 40.0)]         # 25 us of copies, two of them overlapping
    compute = [(0.0, 4.0), (2.0, 12.0), (35.0, 50.0)]         # covers 0..12 and 35..40: 17 us of the copies
    assert union(copies) == [(0.0, 15.0), (30.0, 40.0)]
    assert hidden_share(copies, compute) == pytest.approx(17 / 25)
    assert hidden_share(copies, []) == 0.0
    assert hidden_share([], compute) is None


def test_copy_overlap_reads_a_profiler_chrome_trace() -> None:
    trace = {"traceEvents": [
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 100, "dur": 50},
        {"cat": "kernel", "name": "ampere_bf16_gemm", "ts": 120, "dur": 100},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},          # host work hides nothing
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 300, "dur": 10},
    ]}
    found = copy_overlap(trace)
    assert found["hidden_share"] == pytest.approx(30 / 60)
    assert found["copy_s"] == pytest.approx(60e-6)
    assert found["kernel_s"] == pytest.approx(100e-6)


@gpu
@needs_cuda
def test_one_rank_bf16_training_step_on_cuda(tmp_path: Path) -> None:
    """A 1-rank bf16 plan of the demo model on this GPU's catalog kind trains through `hetc run --local`:
    finite, falling losses and a CUDA peak in the metrics."""
    from benchmarks.gpu_check import local_kind

    kind = local_kind()
    assert kind is not None
    specs = write_plans(Job(RUN_CPU, kind, global_batch=8, micro_batch=2, text_data=True), tmp_path / "specs")
    plan, metrics = tmp_path / "plan", tmp_path / "metrics.jsonl"
    hetc = [sys.executable, "-m", "hetc"]
    compiled = subprocess.run([*hetc, "compile", str(specs / "single.het"), "-o", str(plan)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
    if compiled.returncode != 0 and "unknown device kind" in compiled.stderr:
        pytest.skip(f"this GPU ({torch.cuda.get_device_name(0)}) has no kind in specs/catalog.het")
    assert compiled.returncode == 0, compiled.stderr
    done = subprocess.run([*hetc, "run", str(plan), "--local", "1", "--steps", "4", "--metrics", str(metrics),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert records[-1]["peak_memory_bytes"][0] > 0     # torch.cuda.max_memory_allocated on the rank
