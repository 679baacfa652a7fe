"""fp16 trains with a dynamic loss scale (Note [dynamic loss scale] in runtime/loss_scale.py).

The scaler's rule is torch.amp.GradScaler's kernel with hysteresis 1 and Megatron-LM's with more; an fp16
pipeline skips the steps whose scaled gradients overflow, as the one-rank plan does, and trains to its
losses; a resumed run goes on at the scale the checkpoint saved.
"""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest
import torch

from hetc.cli import main as hetc_main
from hetc.ir.spec import LossScaleSpec
from hetc.runtime.loss_scale import LossScaler
from tests.conftest import DEMO, REFERENCE_STEPS, demo_job
from tests.rank_pool import PlanJob, agreed_losses, compile_plans

# From 2^19 the demo's scaled gradients overflow on steps 1, 4 and 5 (the scale halves each time and doubles
# after two good steps): a run that skips none, or resumes at the initial scale, trains to other losses.
FP16 = (("  dtype = fp32\n", "  dtype = fp16\n"),
        ("  seed = 1234\n", ("  seed = 1234\n  grad_clip = 1.0\n"
                             "  loss_scale {\n    initial = 524288\n    window = 2\n    hysteresis = 1\n  }\n")))
PLANS = ["single", "pp", "zero3"]


def test_the_rule_is_torch_grad_scalers_kernel_with_hysteresis_one():
    """torch._amp_update_scale_, what torch.amp.GradScaler.update runs, on 300 random overflows."""
    ours = LossScaler.start(LossScaleSpec(initial=2.0 ** 16, window=2, hysteresis=1, min=2.0 ** -24))
    scale, growth = torch.tensor([2.0 ** 16]), torch.tensor([0], dtype=torch.int32)
    draws, seen = random.Random(7), []
    for _ in range(300):
        overflow = draws.random() < 0.25
        torch._amp_update_scale_(scale, growth, torch.tensor([float(overflow)]), 2.0, 0.5, 2)
        ours.update(overflow)
        assert (ours.scale, ours.good_steps) == (scale.item(), growth.item())
        seen.append(ours.scale)
    assert min(seen) < 2.0 ** 16 < max(seen), "the draws both grow and shrink the scale"


def test_hysteresis_spends_overflows_before_halving_and_the_minimum_holds():
    """Megatron-LM's DynamicGradScaler: `hysteresis` overflows since the scale last grew before it halves,
    then every overflow halves it (never below `min`); `window` good steps double it and restore them."""
    scaler = LossScaler.start(LossScaleSpec(initial=1024, window=2, hysteresis=2, min=256))
    scales = []
    for overflow in (True, True, True, True, False, False, True, False, True):
        scaler.update(overflow)
        scales.append(scaler.scale)
    assert scales == [1024, 512, 256, 256, 256, 512, 512, 512, 256]   # a good step does not restore one
    assert scaler.state() == (256, 0, 0)


@pytest.fixture(scope="module")
def fp16_plans(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("fp16")
    (folder / "job.het").write_text(demo_job(*FP16))
    for name in PLANS:
        shutil.copy(DEMO / f"{name}.het", folder / f"{name}.het")
    return compile_plans([folder / f"{name}.het" for name in PLANS], folder / "plans")


@pytest.fixture(scope="module")
def one_rank_losses(fp16_plans, rank_pool) -> tuple[float, ...]:
    return agreed_losses(rank_pool.run(PlanJob(fp16_plans["single"], REFERENCE_STEPS)))


@pytest.mark.parametrize("plan", ["pp", "zero3"])
def test_fp16_plans_skip_the_same_steps_and_train_to_the_one_rank_losses(plan, fp16_plans, one_rank_losses,
                                                                         rank_pool):
    """Every rank skips a step exactly when the global norm of the scaled gradients overflows, so a pipeline
    and ZeRO-3 skip the one-rank plan's steps; fp16 sums in another order, hence a tolerance."""
    want = one_rank_losses
    got = agreed_losses(rank_pool.run(PlanJob(fp16_plans[plan], REFERENCE_STEPS)))
    assert got == pytest.approx(want, rel=2e-3), (got, want)
    assert got[2] < got[0] - 0.1, "the steps between overflows train"


def test_a_resumed_fp16_run_goes_on_at_the_saved_scale(fp16_plans, rank_pool, tmp_path):
    """After step 2 the scale is 2^18 with one good step: a resume at the initial 2^19 would overflow and
    skip step 3, which the uninterrupted run trains."""
    straight = agreed_losses(rank_pool.run(PlanJob(fp16_plans["pp"], REFERENCE_STEPS)))
    agreed_losses(rank_pool.run(PlanJob(fp16_plans["pp"], 2, save_to=tmp_path / "ckpt")))
    resumed = rank_pool.run(PlanJob(fp16_plans["pp"], REFERENCE_STEPS, resume_from=tmp_path / "ckpt"))
    assert {r.start for r in resumed} == {2}
    assert agreed_losses(resumed) == straight[2:]


def test_fp16_without_clipping_is_refused_by_run_at_its_dtype(tmp_path, capsys):
    """The overflow check reads the global gradient norm, which the programs compute under clipping: compile
    warns (the cost model times the plan) and run refuses it."""
    (tmp_path / "job.het").write_text(demo_job(("  dtype = fp32\n", "  dtype = fp16\n")))
    shutil.copy(DEMO / "single.het", tmp_path / "single.het")
    assert hetc_main(["compile", str(tmp_path / "single.het"), "-o", str(tmp_path / "plan")]) == 0
    warned = capsys.readouterr().err
    assert "job.het:" in warned and "warning: dtype = fp16 trains with a dynamic loss scale" in warned, warned
    assert "`hetc run` refuses this plan until then" in warned
    assert hetc_main(["run", str(tmp_path / "plan"), "--local", "--steps", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "plan.het:" in err and "error: dtype = fp16 trains with a dynamic loss scale" in err, err
    assert "set train.grad_clip" in err and "Traceback" not in err


def test_the_step_line_and_metrics_carry_the_scale_and_the_skips(fp16_plans, tmp_path, capfd):
    """What Megatron-LM's and DeepSpeed's logs say each step: the loss scale, and an update skipped for an
    overflow (docs/metrics.md)."""
    metrics = tmp_path / "m.jsonl"
    assert hetc_main(["run", str(fp16_plans["single"]), "--local", "--steps", "2", "--metrics", str(metrics)]) == 0
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert lines[0].endswith("loss scale 524288  update skipped (fp16 overflow)"), lines
    assert lines[1].endswith("loss scale 262144"), lines
    norms = [re.search(r"  lr \S+  grad norm (\S+)  ", line) for line in lines]   # unscaled, as Megatron-LM logs it
    assert norms[0] and norms[0].group(1) == "inf" and norms[1] and 0 < float(norms[1].group(1)) < 100, lines
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["loss_scale"], r.get("skipped", False)) for r in records] == [(524288, True), (262144, False)]
    assert "1 of 2 steps skipped their update: a non-finite gradient norm (fp16 overflows; the loss scale is " \
           "now 262144)" in err, err
    assert hetc_main(["run", str(fp16_plans["single"]), "--local", "--steps", "2", "--log-every", "2"]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and lines[0].endswith("loss scale 262144  1 of 2 updates skipped (fp16 overflow)"), lines


def _saved_state(checkpoint, scratch) -> dict:
    """Every value a checkpoint holds, read back whole by torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=False)


def test_a_skipped_step_is_not_an_update_for_the_schedule_or_adam(fp16_plans, tmp_path, capfd):
    """Note [skipped updates]: step 1 overflows, so step 2 makes the first update, at warm-up's first rate
    and with Adam's bias corrections of step count 1, as Megatron-LM, DeepSpeed and torch.amp count; the
    checkpoints say so (train.updates)."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    assert hetc_main(["run", str(fp16_plans["single"]), "--local", "--steps", "2", "--checkpoint", str(ck),
                      "--every", "1", "--metrics", str(metrics), "-q"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    lr = 3e-3 / 3      # the demo's first warm-up rate: lr = 3e-3 over warmup = 3 updates
    assert [(r.get("skipped", False), r["lr"]) for r in records] == [(True, lr), (False, lr)]
    before = _saved_state(ck / "step-1", tmp_path / "1.pt")
    after = _saved_state(ck / "step-2", tmp_path / "2.pt")
    assert (before["train.step"], before["train.updates"], after["train.step"], after["train.updates"]) == (1, 0, 2, 1)
    beta1, beta2, weight_decay, eps = 0.9, 0.95, 0.1, 1e-8      # the demo's AdamW
    names = [key.removeprefix("model.") for key in after if key.startswith("model.")]
    for name in names:
        m, v = after[f"optimizer.state.{name}.exp_avg"], after[f"optimizer.state.{name}.exp_avg_sq"]
        assert not before[f"optimizer.state.{name}.exp_avg"].any(), "the skipped step left Adam's moments at 0"
        first = before[f"model.{name}"] * (1 - lr * weight_decay) - lr * (m / (1 - beta1)) / ((v / (1 - beta2)).sqrt() + eps)
        torch.testing.assert_close(after[f"model.{name}"], first, msg=name)
    assert len(names) > 10
    assert hetc_main(["run", str(fp16_plans["single"]), "--local", "--steps", "3", "--checkpoint", str(ck),
                      "--resume", "-q"]) == 0
    assert f"resumed from {ck / 'step-2'} at step 2 (updates applied: 1, skipped: 1)" in capfd.readouterr().out
