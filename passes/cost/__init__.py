"""The cost model: memory, time and traffic of a resolved plan (DESIGN.md §3, docs/costmodel.md).

    from hetc.passes.cost import CostModel
    from hetc.passes.cost.sources import load_profiles
    cm = CostModel(plan, load_profiles(["../shared/data/sailor"]))
    cm.compute_time(rank, ms, Phase.FORWARD); cm.param_bytes(ms, rank); cm.estimate().step_time_s
"""

from hetc.passes.cost.compute import CostError
from hetc.passes.cost.estimate import Estimate, GroupTraffic, RankMemory
from hetc.passes.cost.model import PHASES, CostModel
from hetc.passes.cost.profiles import ComputeTable, NetworkFits, ProfileError, Profiles
from hetc.passes.cost.transfers import Borders, Engine

__all__ = [
    "PHASES",
    "Borders",
    "ComputeTable",
    "CostError",
    "CostModel",
    "Engine",
    "Estimate",
    "GroupTraffic",
    "NetworkFits",
    "ProfileError",
    "Profiles",
    "RankMemory",
]
