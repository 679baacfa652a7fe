"""Cost model of the block layouts on the demo plans: groups, held bytes, and traffic pinned to the survey.

Survey II.II per rank, per layer and microbatch: TP 4·δbSH (four all-reduces
of δbSH, each moving 2(n−1)/n of it); Ulysses 4(N_kv/N_q + 1)·δbSH/N_SP;
ring attention 6(N_kv/N_q)·δbSH; PP δbSH per border and direction, to each
of the receiving side's N_rep copies. The pipeline border bytes are also
checked against what the compiled programs actually send.
"""

from __future__ import annotations

import math

import pytest

from hetc.ir.layout import held_fraction
from hetc.passes.cost import CostModel, traffic
from hetc.ir.program import Collective, Phase, Send
from tests.conftest import DEMO
from tests.plans import compile_plan

B, S, H, DELTA, M = 2, 32, 64, 4, 4       # the demo job: micro_batch, seq, hidden, fp32, microbatches
BSH = DELTA * B * S * H
BLOCKS, KV, Q = 4, 2, 4


def _cost(plan: str) -> CostModel:
    lowered = compile_plan(DEMO / f"{plan}.het")
    return CostModel(lowered.plan)


def _traffic(plan: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for g in _cost(plan).estimate().traffic:
        out.setdefault(g.kind, []).append(g)
    return out


def test_the_zero_group_spans_lanes_and_cp_ranks():
    ring = _cost("ring2")                       # 2 lanes x cp 2: one ZeRO-2 group of 4
    assert ring.zero_group(0) == (0, 1, 2, 3)
    assert ring.shard(0).optimizer == pytest.approx(1 / 4)
    both = _cost("tp2_cp2")                      # one lane: tp rank 1 of both cp ranks
    assert both.zero_group(1) == (1, 3) and both.tp_group(1) == (0, 1) and both.cp_group(1) == (1, 3)
    assert _cost("tp2").zero_group(1) == (1, 3)  # lanes (0, 1) and (2, 3): tp rank 1 of each


@pytest.mark.parametrize("plan, fraction", [("single", 1), ("tp2", 1), ("ulysses2", 1 / 2), ("ring2", 1 / 2),
                                            ("tp2_cp2", 1 / 4), ("hetero_tp", 1 / 2)])
def test_a_rank_holds_its_share_of_each_boundary(plan, fraction):
    assert held_fraction(_cost(plan).pipeline.stages[0]) == fraction


def test_held_boundary_bytes():
    cm = _cost("hetero_tp")                     # its first stage ends at a border: half of δbSH per rank
    assert cm.held_boundary_bytes(0, cm.pipeline.stages[0]) == BSH / 2


def test_tp_traffic_is_four_all_reduces_of_the_activation_per_block():
    tp = _traffic("tp2")["tp"][0]
    assert tp.bytes_per_step == pytest.approx(BLOCKS * (M // 2) * 4 * 2 * (1 / 2) * BSH)   # 8δbSH·(n−1)/n


def test_ulysses_and_ring_traffic_follow_the_survey():
    ulysses = _traffic("ulysses2")["cp"][0]
    assert ulysses.bytes_per_step == pytest.approx(BLOCKS * (M // 2) * 4 * (KV / Q + 1) * BSH / 2 * (1 / 2))
    ring = _traffic("ring2")["cp"][0]
    assert ring.bytes_per_step == pytest.approx(BLOCKS * (M // 2) * 6 * KV / Q * BSH * (1 / 2))
    # with tp the attention runs on 1/tp of the heads: H/tp
    assert _traffic("tp2_cp2")["cp"][0].bytes_per_step == pytest.approx(BLOCKS * M * 6 * KV / Q * BSH / 2 / 2)


def test_dp_traffic_counts_cp_ranks_as_replicas():
    cm = _cost("ring2")
    dp = _traffic("ring2")["dp"][0]
    assert "over 2 lanes x cp 2" in dp.group
    phi = cm.numel(0, 0) * DELTA
    assert dp.bytes_per_step == pytest.approx(traffic.zero_bytes(2, cm.pipeline.schedule, phi, 4, M // 2,
                                                                cm.states))


@pytest.mark.parametrize("plan, replicas", [("pp", 2), ("tp_to_cp", 2), ("hetero_tp", 2), ("tp2_pp2", 2)])
def test_pipeline_borders_send_every_copy_the_receiving_side_holds(plan, replicas):
    # pp: 1 + 1; tp_to_cp: the ring side holds each token once, and the tp ranks receive the gradient in
    # halves that their tp group gathers (Note [scatter-gather borders]); hetero_tp: sequence parallelism
    # holds each token once on both sides; tp2_pp2: both sides gather halves
    border = _traffic(plan)["pp"][0]
    assert border.bytes_per_step == replicas * BSH * M
    lowered = compile_plan(DEMO / f"{plan}.het")
    first = lowered.pipeline.stages[0].ranks
    sent = sum(math.prod(i.shape) * DELTA for rp in lowered.program.ranks for i in rp.instrs
               if isinstance(i, Send) and (rp.rank in first) != (i.peer_to in first))
    assert sent == border.bytes_per_step, "the cost model and the programs disagree on the border bytes"


def test_a_lane_that_gathers_its_border_tensors_pays_the_gather_in_the_consuming_compute():
    """tp2_pp2 (Note [scatter-gather borders]): the second stage's forward gathers the activation it receives
    in halves, the first stage's input-gradient the gradient; the gather is its tp group's all-gather of the
    whole tensor, and nothing else gathers."""
    cm = _cost("tp2_pp2")
    gather = cm.collective_time(Collective.ALL_GATHER, (2, 3), cm.hidden_bytes)
    assert gather > 0 and cm.border_gather_time(2) == gather
    assert cm.border_gathers(2, 1, Phase.FORWARD) == gather and cm.border_gathers(2, 1, Phase.INPUT_GRAD) == 0
    assert cm.border_gathers(0, 0, Phase.INPUT_GRAD) == cm.border_gathers(0, 0, Phase.BACKWARD) == \
        cm.border_gather_time(0) > 0
    assert cm.border_gathers(0, 0, Phase.FORWARD) == cm.border_gathers(0, 0, Phase.WEIGHT_GRAD) == 0
    assert _cost("hetero_tp").border_gather_time(0) == 0      # sequence parallel: its share is what it holds


def test_the_planners_score_counts_the_border_gathers_as_the_estimate_does(tmp_path):
    """Two tp-2 stages whose layers the planner splits: its class-by-class score of the plan it chose and the
    cost model's estimate of that plan part by nothing (candidate_stage.py `crossings`, `border_gather`)."""
    from hetc.frontend.load import load_spec
    from hetc.passes.plan.planner import plan_spec

    (tmp_path / "auto.het").write_text(f'use "{DEMO / "job.het"}"\n\nparallel {{\n  schedule = 1f1b\n'
                                       "  stage first {\n    ranks = host[0]\n    layers = auto\n    tp = 2\n  }\n"
                                       "  stage second {\n    ranks = host[1]\n    layers = auto\n    tp = 2\n  }\n}\n")
    result = plan_spec(load_spec(tmp_path / "auto.het").spec)
    assert result.score is not None and result.estimate is not None and result.plan is not None
    assert any(s.tp == 2 for s in result.plan.pipeline.stages)
    assert result.estimate.closed_form_step_s == pytest.approx(result.score.step_time_s, rel=1e-6)
