"""The timeline simulator agrees with the cost model's estimate (what the planner optimises).

Two independent models of the same plan: the simulator runs the compiled
programs instruction by instruction against the cost model's durations; the
estimate is the closed form the planner evaluates thousands of times. They
differ where the programs overlap more (asynchronous p2p) or less than the
closed form assumes, so they agree within a band, not exactly; the band is
pinned here for every example with an explicit plan.
"""

from __future__ import annotations

import pytest

from hetc.frontend import load_checked
from hetc.passes.cost import CostModel
from hetc.passes.lower import lower
from hetc.passes.simulate import simulate
from tests.conftest import all_spec_files

TOLERANCE = 0.20

EXAMPLES = []
for _path in all_spec_files():
    if _path.name in ("job.het", "catalog.het") or _path.parent.name == "zorse" and "cluster" in _path.name:
        continue
    EXAMPLES.append(_path)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(p.parents[1]).as_posix())
def test_simulated_step_time_agrees_with_the_estimate(path):
    _, checked = load_checked(path)
    if checked.pipeline is None:
        pytest.skip("the plan has auto in it (the planner's tests cover it)")
    program = lower(checked.spec, checked.pipeline)
    costs = CostModel(checked.spec, checked.pipeline, checked.topology)
    simulated = simulate(program, checked.pipeline, checked.spec, costs).step_time
    estimated = costs.estimate().step_time_s
    assert simulated == pytest.approx(estimated, rel=TOLERANCE), \
        f"simulated {simulated:.4g} s vs estimated {estimated:.4g} s"
