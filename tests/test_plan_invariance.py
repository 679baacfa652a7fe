"""Plan invariance, the main runtime test: every demo plan trains to the 1-rank numbers.

Each plan in specs/demo/ is compiled and run for 5 steps on the session's
pool of 4 gloo ranks (tests/rank_pool.py); its per-step losses must equal
the single-process reference trainer's within 1e-5 relative, and its
parameters after the last step — written by the plan's ranks as a DCP
checkpoint, each element by exactly one rank, and read back by name — must
equal the reference's. Plans named moe_* train the MoE demo job
(moe_job.het: top-2 routing with dropped tokens, gradient clipping), whose
reference is moe_single's model and data; plans named tied_* the tied demo
job (tied_job.het: the embedding and the head share one matrix, gradient
clipping), whose reference is tied_single's.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from hetc.compiler import load_checked
from hetc.ir.program import Offload
from hetc.passes.lower import lower
from hetc.plandir import read_plan
from hetc.runtime.checkpoint import latest_checkpoint, read_params
from hetc.runtime.nn.moe import AuxLoss
from hetc.runtime.reference import train_reference
from tests.conftest import DEMO, REFERENCE_STEPS, demo_job
from tests.plans import DEMO_PLANS
from tests.rank_pool import COMM_ORDERS, PlanJob, agreed_losses, assert_losses_close, assert_params_close, compile_plans
from tests.test_checkpoint import SAVED_AT, _save_then_resume

MOE = "moe_"   # plans of the MoE demo job
TIED = "tied_"   # plans of the tied demo job
DENSE_PLANS = sorted(p.stem for p in DEMO_PLANS if not p.stem.startswith((MOE, TIED)))
MOE_PLANS = sorted(p.stem for p in DEMO_PLANS if p.stem.startswith(MOE))
TIED_PLANS = sorted(p.stem for p in DEMO_PLANS if p.stem.startswith(TIED))

# What the issues ask the demo folder to cover (hetero: lanes 1, 2, 1 with microbatches [3, 1]; the
# block layouts: TP, Ulysses, ring attention, TP x CP in one lane, a TP -> CP border, TP in a hetero pipeline).
REQUIRED = {"single", "dp", "zero1", "zero2", "zero3", "hsdp", "gpipe", "pp", "interleaved", "zb",
            "zero3_offload", "offload_opt", "hetero", "offload_act", "recompute",
            "tp2", "ulysses2", "ring2", "tp2_cp2", "tp_to_cp", "hetero_tp",
            "moe_single", "moe_ep2", "moe_ep2_cp2", "moe_pp_ep2",
            "tied_single", "tied_pp", "tied_hetero", "tied_zero3"}


def test_demo_folder_has_every_required_plan():
    names = {p.stem for p in DEMO_PLANS}
    assert REQUIRED <= names, f"missing demo plans: {sorted(REQUIRED - names)}"


@pytest.mark.parametrize("order", COMM_ORDERS)
@pytest.mark.parametrize("plan", DENSE_PLANS)
def test_plan_matches_reference(plan, order, rank_pool, demo_plan_dirs, demo_reference, tmp_path):
    """Each plan trains to the reference on gloo, and with gloo held to NCCL's order (`order` nccl:
    HETC_EMULATE_NCCL, runtime/nccl_order.py), as its programs would run on GPUs."""
    reports = rank_pool.run(PlanJob(demo_plan_dirs[plan], REFERENCE_STEPS, save_to=tmp_path,
                                    emulation=COMM_ORDERS[order]))
    assert_losses_close(agreed_losses(reports), demo_reference.losses)
    assert_params_close(latest_checkpoint(tmp_path), demo_reference.params)


TWO_NODE_STAGES = """use "{job}"

parallel {{
  schedule = {schedule}
{zero}
  stage first {{
    layers = embed..block1
    ranks = host[0]
    lanes = 2
  }}
  stage second {{
    layers = block2..head
    ranks = host[1]
    lanes = 2
  }}
}}
"""


@pytest.mark.parametrize("level", [2, 3])
def test_zero_bubble_with_sharded_gradients_matches_reference(level, rank_pool, demo_reference, tmp_path):
    """ZB-H1 with ZeRO-2/3 (no demo plan has both): the weight-gradient op fills the buffer the input-gradient
    op left alone, and each reduce-scatter is waited once the next op ran (Note [gradient buffer release])."""
    _two_node_stages_match(rank_pool, demo_reference, tmp_path, "zb", f"  zero = {level}")


def _two_node_stages_match(rank_pool, demo_reference, tmp_path, schedule: str, zero: str) -> None:
    """`TWO_NODE_STAGES` under `schedule` and the `zero` line(s) trains to the reference."""
    _plan_matches(rank_pool, demo_reference, tmp_path, "two_node_stages",
                  TWO_NODE_STAGES.format(job=DEMO / "job.het", schedule=schedule, zero=zero))


def _plan_matches(rank_pool, reference, tmp_path, name: str, text: str) -> None:
    """The plan `text` (compiled as NAME.het) trains to `reference`'s losses and parameters."""
    spec = tmp_path / f"{name}.het"
    spec.write_text(text)
    plan_dir = compile_plans([spec], tmp_path / "plans")[spec.stem]
    reports = rank_pool.run(PlanJob(plan_dir, REFERENCE_STEPS, save_to=tmp_path / "ckpt"))
    assert_losses_close(agreed_losses(reports), reference.losses)
    assert_params_close(latest_checkpoint(tmp_path / "ckpt"), reference.params)


def test_norms_and_biases_without_weight_decay_match_reference_under_zero3(rank_pool, tmp_path):
    """`decay_norms_and_biases = false` (Megatron-LM's parameter groups): each rank decays only the spans of its
    ZeRO-3 shards that hold matrices, which the shards' edges cut (`FlatLayout.matrix_spans`); the
    plan trains to the 1-rank reference of the same job, which decays them nowhere either."""
    from hetc.runtime.reference import train_reference

    (tmp_path / "job.het").write_text(demo_job(("    weight_decay = 0.1\n",
                                                "    weight_decay = 0.1\n    decay_norms_and_biases = false\n")))
    _, checked = load_checked(tmp_path / "job.het")
    spec = checked.spec
    assert spec.model is not None and spec.train is not None
    reference = train_reference(spec.model, spec.train, steps=REFERENCE_STEPS)
    _plan_matches(rank_pool, reference, tmp_path, "zero3_no_decay",
                  TWO_NODE_STAGES.format(job=tmp_path / "job.het", schedule="1f1b", zero="  zero = 3"))


@pytest.mark.parametrize("level", [1, 3])
def test_hierarchical_zero_on_stages_of_one_node_each_matches_reference(level, rank_pool, demo_reference, tmp_path):
    """shard = node with across = 1 where each stage's lanes sit on one node: no other node holds replicas, so
    nothing is reduced across nodes (`Geometry.outer_group`). Lowering once reduced over a group of the rank
    alone, which the runtime's buffers, sized by that group, had no room for (found by random plans)."""
    hsdp = f"  zero {{\n    level = {level}\n    shard = node\n    across = 1\n  }}"
    _two_node_stages_match(rank_pool, demo_reference, tmp_path, "gpipe", hsdp)






ZORSE_OFFLOADED = """use "{job}"

parallel {{
  schedule = zorse
  zero = 2
  stage all {{
    layers = embed..head
    ranks = host
    lanes = 4
    ministages = 5
    offload {{
      params = cpu
      optimizer = cpu
    }}
  }}
}}
"""


def test_zorse_regathering_offloaded_parameters_one_op_after_each_step_matches_reference(rank_pool, demo_reference,
                                                                                          tmp_path):
    """Zorse's interleaved update under ZeRO-2 with the parameters and optimizer on the host: each ministage's
    gather after its step is waited one op later, and its parameters go back to the host then (Note
    [regathers of offloaded parameters] in passes/lower/zero.py), not at the end of the step."""
    _plan_matches(rank_pool, demo_reference, tmp_path, "zorse_offloaded", ZORSE_OFFLOADED.format(job=DEMO / "job.het"))


INTERLEAVED_OFFLOADED = """use "{job}"

parallel {{
  schedule = interleaved
  stage all {{
    layers = embed..head
    ranks = host
    lanes = 4
    ministages = 2
    offload {{
      params = cpu
    }}
  }}
}}
"""


def test_offloaded_parameters_copied_back_only_after_their_step_match_reference(rank_pool, demo_reference, tmp_path):
    """Interleaved 1F1B with its parameters on the host fetches a chunk's around nearly every op; only the window
    holding the chunk's step (on the device) copies them back, the others release the device copy (Note
    [clean parameter offload] in passes/lower/offload.py). A stale host copy would train other losses."""
    text = INTERLEAVED_OFFLOADED.format(job=DEMO / "job.het")
    (tmp_path / "check.het").write_text(text)
    program = lower(load_checked(tmp_path / "check.het", require_complete=True)[1].explicit())
    offloads = [i for i in program.ranks[0].instrs if isinstance(i, Offload)]
    assert sum(not i.host_current for i in offloads) == 2 < len(offloads)   # one copy back per chunk, after its step
    _plan_matches(rank_pool, demo_reference, tmp_path, "interleaved_offloaded", text)


@pytest.mark.parametrize("plan", MOE_PLANS)
def test_moe_plan_matches_reference(plan, rank_pool, demo_plan_dirs, moe_reference, tmp_path):
    """Expert parallelism (EP = 2 alone, across cp = 2 lanes, in a zero-bubble pipeline) drops, dispatches
    and clips like one rank."""
    reports = rank_pool.run(PlanJob(demo_plan_dirs[plan], REFERENCE_STEPS, save_to=tmp_path))
    assert_losses_close(agreed_losses(reports), moe_reference.losses)
    assert_params_close(latest_checkpoint(tmp_path), moe_reference.params)


@pytest.fixture(scope="module")
def balanced_moe(tmp_path_factory, moe_reference):
    """The MoE demo job with a load-balancing loss and a router z-loss (Notes [load-balancing loss] and [router
    z-loss] in runtime/nn/moe.py): its plans and its one-rank reference, which each loss moves off the job's
    without it."""
    from hetc.runtime.reference import train_reference

    folder = tmp_path_factory.mktemp("balanced")
    losses = "    aux_loss_coeff = 0.5\n    z_loss_coeff = 0.05\n    capacity_factor"
    (folder / "moe_job.het").write_text(demo_job(("    capacity_factor", losses), job="moe_job.het"))
    for name in MOE_PLANS:
        shutil.copy(DEMO / f"{name}.het", folder / f"{name}.het")
    dirs = compile_plans([folder / f"{name}.het" for name in MOE_PLANS], folder / "plans")
    _, checked = read_plan(dirs["moe_single"])
    model, train = checked.spec.model, checked.spec.train
    reference = train_reference(model, train, base_dir=dirs["moe_single"], steps=REFERENCE_STEPS)
    assert model.moe is not None
    without_z = dataclasses.replace(model, moe=dataclasses.replace(model.moe, z_loss_coeff=0.0))
    balanced_only = train_reference(without_z, train, base_dir=dirs["moe_single"], steps=REFERENCE_STEPS)
    assert reference.losses[1:] != moe_reference.losses[1:], "the auxiliary losses must change training"
    assert reference.losses[1:] != balanced_only.losses[1:], "the z-loss must change training"
    return dirs, reference


@pytest.mark.parametrize("plan", [p for p in MOE_PLANS if p != "moe_single"])
def test_moe_auxiliary_losses_train_every_plan_as_one_rank(plan, rank_pool, balanced_moe, tmp_path):
    """Each layer's balancing loss and z-loss reach backward with the loss's seed on every rank: under EP, with
    the balancing counts over the whole sequence split by cp = 2, and in a zero-bubble pipeline's split
    backward; and every rank reports the one rank's load_balancing_loss and z_loss (each microbatch and layer
    counted once)."""
    dirs, reference = balanced_moe
    reports = rank_pool.run(PlanJob(dirs[plan], REFERENCE_STEPS, save_to=tmp_path))
    assert_losses_close(agreed_losses(reports), reference.losses)
    assert_params_close(latest_checkpoint(tmp_path), reference.params)
    assert all(r.aux_losses == reports[0].aux_losses for r in reports)
    for kind in AuxLoss:
        reported = [step[kind] for step in reports[0].aux_losses]
        assert reported == pytest.approx(reference.aux_losses[kind], rel=1e-6), kind
    balancing, z = reference.aux_losses[AuxLoss.LOAD_BALANCING], reference.aux_losses[AuxLoss.Z]
    assert all(0.5 < b < 4 for b in balancing), balancing    # E = 4: at most E
    assert all(0 < v < 100 for v in z), z                   # logsumexp² of 4 small logits: about ln(4)² = 1.9


@pytest.mark.parametrize("saver, resumer", [("moe_ep2", "moe_ep2_cp2"), ("moe_pp_ep2", "moe_single")])
def test_moe_checkpoint_resumes_under_another_expert_layout(saver, resumer, rank_pool, demo_plan_dirs,
                                                            moe_reference, tmp_path):
    """Experts are saved under their global names by the ranks holding them, so any layout resumes."""
    losses, path = _save_then_resume(rank_pool, demo_plan_dirs, tmp_path, saver, resumer)
    assert_losses_close(losses, moe_reference.losses[SAVED_AT:])
    assert_params_close(path, moe_reference.params)




@pytest.mark.parametrize("order", COMM_ORDERS)
@pytest.mark.parametrize("plan", TIED_PLANS)
def test_tied_plan_matches_reference(plan, order, rank_pool, demo_plan_dirs, tied_reference, tmp_path):
    """A tied embedding and head on different stages (Note [tied copies] in runtime/nn/model.py) train like
    one matrix on one rank, in both communication orders: the copies start equal, their gradients are summed
    (over ZeRO-1, ZeRO-2 shards of lanes of another width, ZeRO-3 units), the norm counts the matrix once,
    and the checkpoint holds it once, under the embedding's name."""
    reports = rank_pool.run(PlanJob(demo_plan_dirs[plan], REFERENCE_STEPS, save_to=tmp_path,
                                    emulation=COMM_ORDERS[order]))
    assert_losses_close(agreed_losses(reports), tied_reference.losses)
    assert_params_close(latest_checkpoint(tmp_path), tied_reference.params)
    assert "head.output.weight" not in read_params(latest_checkpoint(tmp_path))


@pytest.mark.parametrize("saver, resumer", [("tied_pp", "tied_single"), ("tied_single", "tied_zero3")])
def test_tied_checkpoint_resumes_with_or_without_a_copy(saver, resumer, rank_pool, demo_plan_dirs, tied_reference,
                                                        tmp_path):
    """The tied matrix is saved once; a plan whose head holds a copy fills it from the embedding's values and
    optimizer state, and a plan holding it once reads what two stages wrote."""
    losses, path = _save_then_resume(rank_pool, demo_plan_dirs, tmp_path, saver, resumer)
    assert_losses_close(losses, tied_reference.losses[SAVED_AT:])
    assert_params_close(path, tied_reference.params)


TIED_ZERO2 = """use "{job}"

parallel {{
  schedule = 1f1b
  stage first {{
    layers = embed..block1
    ranks = host[0, 0]
    lanes = 1
  }}
  stage second {{
    layers = block2..head
    ranks = [host[0, 1], host[1, 0]]
    lanes = 2
    zero = 2
  }}
  idle = [host[1, 1]]
}}
"""


def test_tied_copy_under_zero2_matches_reference(rank_pool, tied_reference, tmp_path):
    """The head's copy reduce-scattered after every microbatch (ZeRO-2 under 1F1B, the full gradient released
    in between) is summed from its shards with the embedding's whole gradient (runtime/tied.py)."""
    _plan_matches(rank_pool, tied_reference, tmp_path, "tied_zero2", TIED_ZERO2.format(job=DEMO / "tied_job.het"))


TIED_ZORSE = """use "job.het"

parallel {
  schedule = zorse
  zero = 2
  stage first {
    layers = embed..block1
    ranks = host[0]
    lanes = 2
    ministages = 2
  }
  stage second {
    layers = block2..head
    ranks = host[1]
    lanes = 2
    ministages = 2
  }
}
"""


def test_tied_copy_under_zorse_interleaved_update_matches_reference(rank_pool, tmp_path):
    """Zorse without clipping steps each ministage right after its reductions, but a ministage holding a tied
    copy waits for the sum with the other stage's (passes/lower/zero.py): the tied job without clipping."""
    (tmp_path / "job.het").write_text(demo_job(("  grad_clip = 1.0\n", ""), job="tied_job.het"))
    (tmp_path / "tied_zorse.het").write_text(TIED_ZORSE)
    plan_dir = compile_plans([tmp_path / "tied_zorse.het"], tmp_path / "plans")["tied_zorse"]
    _, checked = read_plan(plan_dir)
    assert not checked.spec.train.grad_clip
    reference = train_reference(checked.spec.model, checked.spec.train, base_dir=plan_dir, steps=REFERENCE_STEPS)
    reports = rank_pool.run(PlanJob(plan_dir, REFERENCE_STEPS, save_to=tmp_path / "ckpt"))
    assert_losses_close(agreed_losses(reports), reference.losses)
    assert_params_close(latest_checkpoint(tmp_path / "ckpt"), reference.params)

