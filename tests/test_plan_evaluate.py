"""The planner's class-by-class score equals the cost model's estimate (passes/plan/evaluate.py).

Random plans over two mixed clusters (every schedule, ZeRO level, offload,
ministage count, TP degree, uneven microbatch routing) are scored by the
planner and, written back into a Spec, by `CostModel.estimate()`; step time
and every rank's memory must agree. A change to passes/cost that the planner
does not mirror fails here.
"""

from __future__ import annotations

import random

import pytest

from hetc.importers.sailor import import_sailor
from hetc.load import load_spec
from hetc.passes.cost import CostModel, Profiles, load_profiles
from hetc.passes.plan.candidate import Candidate, GpuBlock, Knobs, Offload, StageGpus, split_evenly
from hetc.passes.plan.costs import Primitives
from hetc.passes.plan.emit import emit_spec
from hetc.passes.plan.evaluate import evaluate
from hetc.passes.plan.views import Resolver, view_of
from hetc.passes.validate import check_spec
from hetc.spec import ScheduleKind, ZeroSpec
from hetc.topology import Topology

CLUSTERS = {
    "zones": """
cluster c {
  node a {
    device = A100-40
    count = 2
    gpus = 2
    intra {
      bandwidth = 300 GB/s
    }
  }
  node v {
    device = V100-16
    count = 1
    gpus = 4
    zone = z2
  }
  link "default" <-> z2 {
    bandwidth = 5 GB/s
    egress = 0.01 $/GB
  }
}
""",
    "three kinds": """
cluster c {
  node h {
    device = H100
    count = 1
    gpus = 2
  }
  node t {
    device = T4
    count = 2
    gpus = 2
  }
  node l {
    device = L4
    count = 1
    gpus = 2
  }
  inter_bandwidth = 25 Gb/s
}
""",
}

MODEL = """use "catalog.het"
model m {
  layers = 6
  hidden = 512
  heads = 8
  kv_heads = 4
  ffn = 1408
  vocab = 4000
  seq = 256
  dtype = bf16
  activation_checkpoint = selective
}
train {
  global_batch = 16
}
parallel {
  schedule = auto
}
"""


def _spec(tmp_path, name: str):
    path = tmp_path / "spec.het"
    path.write_text(MODEL + CLUSTERS[name])
    return load_spec(path).spec


def _stages(topo: Topology, rng: random.Random) -> list[StageGpus]:
    """Each node group as one or two stages, in a random order."""
    out = []
    for name, g in topo.groups.items():
        parts = rng.choice([1, 2])
        if g.count >= parts:
            cuts = split_evenly(g.count, parts)
            starts = [sum(cuts[:i]) for i in range(parts)]
            out += [StageGpus((GpuBlock(name, s, s + n, 0, g.gpus),)) for s, n in zip(starts, cuts)]
        else:
            cuts = split_evenly(g.gpus, parts)
            starts = [sum(cuts[:i]) for i in range(parts)]
            out += [StageGpus((GpuBlock(name, 0, 1, s, s + n),)) for s, n in zip(starts, cuts)]
    rng.shuffle(out)
    tp = rng.choice([1, 2])
    if tp == 2 and all(b.gpu_start % 2 == 0 and (b.gpu_stop - b.gpu_start) % 2 == 0
                       for st in out for b in st.blocks):
        out = [StageGpus(st.blocks, 2) for st in out]
    return out


def _candidate(spec, topo: Topology, rng: random.Random) -> Candidate | None:
    stages = _stages(topo, rng)
    units = spec.model.num_model_layers
    schedule = rng.choice(list(ScheduleKind))
    micro_batch = rng.choice([1, 2])
    m = spec.train.global_batch // micro_batch
    chunks = 2 if schedule is ScheduleKind.INTERLEAVED else 0
    if len(stages) * max(chunks, 1) > units or any(st.num_lanes > m for st in stages):
        return None
    cuts = sorted(rng.sample(range(1, units), len(stages) - 1))
    layers = tuple(b - a for a, b in zip([0, *cuts], [*cuts, units]))
    if chunks and min(layers) < chunks:
        return None
    knobs = tuple(Knobs(rng.choice([0, 1, 2, 3]),
                        Offload(rng.random() < 0.3, rng.random() < 0.3,
                                schedule is ScheduleKind.ZORSE and rng.random() < 0.5),
                        chunks or rng.choice([1, min(2, n)])) for n in layers)
    counts = []
    for st, k in zip(stages, knobs):
        if schedule is not ScheduleKind.ZORSE and k.zero >= 2 and st.num_lanes > 1:
            # lanes in lockstep serve alike (passes/plan/routing.py; validation refuses anything else)
            if m % st.num_lanes:
                return None
            counts.append((m // st.num_lanes,) * st.num_lanes)
            continue
        row = [1] * st.num_lanes
        for _ in range(m - st.num_lanes):
            row[rng.randrange(st.num_lanes)] += 1
        counts.append(tuple(row))
    return Candidate(tuple(stages), layers, knobs, tuple(counts), schedule, micro_batch)


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
def test_planner_scores_plans_as_the_cost_model_does(tmp_path, cluster):
    _compare(_spec(tmp_path, cluster), None, plans=24)


def test_with_an_engine_overhead_per_device_kind(tmp_path):
    """Measured per-microbatch engine costs, a different one per kind (lanes take their slowest)."""
    spec = _spec(tmp_path, "zones")
    kinds = sorted({d.name for d in spec.devices})
    _compare(spec, Profiles(overhead={k: 1e-3 * (i + 1) for i, k in enumerate(kinds)}), plans=16)


def test_with_measured_layer_times_and_network_fits(tmp_path, shared_data):
    """Sailor's OPT-350 profiles and network fits (measured rates by message size and sender count)."""
    quotas = tmp_path / "quotas.json"
    quotas.write_text('{"A100-40": {"us-central1-a": 8}, "V100-16": {"us-central1-a": 8}}')
    path = tmp_path / "opt.het"
    path.write_text(import_sailor(str(shared_data / "sailor"), "OPT-350", None, str(quotas)))
    _compare(load_spec(path).spec, load_profiles([shared_data / "sailor"]), plans=8)


def _compare(spec, profiles, plans: int) -> None:
    topo = Topology(spec)
    rng = random.Random(7)
    resolve = Resolver(topo)
    compared = 0
    while compared < plans:
        c = _candidate(spec, topo, rng)
        if c is None:
            continue
        score = evaluate(Primitives(spec, topo, profiles, c.micro_batch), view_of(
            c, resolve, tuple(ZeroSpec(level=k.zero) for k in c.knobs)))
        checked = check_spec(emit_spec(spec, c, topo))
        estimate = CostModel(checked.spec, checked.pipeline, checked.topology, profiles).estimate()
        assert score.step_time_s == pytest.approx(estimate.step_time_s, rel=1e-9), c
        rank_of = {g.id: r for r, g in enumerate(checked.pipeline.world)}
        full = {m.rank: m for m in estimate.memory}
        for mem, ids in zip(score.memory, score.classes):
            for gpu in ids:
                assert mem.total == pytest.approx(full[rank_of[gpu]].total, rel=1e-9), (c, gpu)
                assert mem.fits == full[rank_of[gpu]].fits
        compared += 1
