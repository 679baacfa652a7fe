"""The CP-SAT calls the assignment model makes, on ortools' C++ model builder (`cp_model_helper`).

Note [CP-SAT without cp_model.py]: ortools' Python front (`ortools.sat.python.cp_model`)
imports pandas and, through it, pyarrow, for its Series helpers: about 1 s of
every `hetc plan`, more than the CP-SAT solves themselves (benchmarks/planner.py).
The model builder, the linear expressions (`x * 3 + y >= z`) and the solver
all live in the C++ extension `cp_model_helper` that cp_model.py wraps; this
module calls them directly for the few operations `assign_cpsat` needs. The
model it builds is the one cp_model.CpModel builds from the same calls
(tests/test_plan_assign.py compares the two protos), so CP-SAT, run with the
same parameters, gives the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from ortools.sat.python import cp_model_helper as cmh
from ortools.util.python.sorted_interval_list import Domain  # type: ignore[import-untyped]

__all__ = ["Model", "Solved", "solve"]

IntVar = cmh.IntVar
Constraint = cmh.Constraint


class Model(cmh.CpBaseModel):
    """A CP-SAT model with cp_model.CpModel's names for what the planner uses."""

    def __init__(self) -> None:
        cmh.CpBaseModel.__init__(self, None)

    def new_int_var(self, lb: int, ub: int, name: str) -> cmh.IntVar:
        return cmh.IntVar(self.model_proto).with_name(name).with_domain(Domain(lb, ub))

    def new_bool_var(self, name: str) -> cmh.IntVar:
        return cmh.IntVar(self.model_proto).with_name(name).with_domain(Domain(0, 1))

    # the builder's own methods are not in ortools' stubs: `Any` from here
    def add(self, ct: Any) -> cmh.Constraint:
        """A linear constraint (`x + 2 * y <= z`: the extension's bounded expression)."""
        added: cmh.Constraint = cast(Any, self)._add_bounded_linear_expression(ct)
        return added

    def add_exactly_one(self, literals: Iterable[cmh.IntVar]) -> cmh.Constraint:
        added: cmh.Constraint = cast(Any, self)._add_bool_argument_constraint(
            cmh.BoolArgumentConstraint.exactly_one, literals)
        return added

    def minimize(self, expr: cmh.LinearExpr) -> None:
        """An integer objective, `expr` flattened to one term per variable."""
        flat = cmh.FlatIntExpr(expr)
        objective = self.model_proto.objective
        objective.vars.extend(v.index for v in flat.vars)
        objective.coeffs.extend(flat.coeffs)
        objective.offset = flat.offset
        objective.scaling_factor = 1.0

    def add_hint(self, var: cmh.IntVar, value: int) -> None:
        assert var.index >= 0   # a variable, not a negated literal
        hint = self.model_proto.solution_hint
        hint.vars.append(var.index)
        hint.values.append(int(value))


class Solved:
    """CP-SAT's answer to a model: its status and the values it found."""

    def __init__(self, response: cmh.CpSolverResponse):
        self.response = response

    @property
    def found(self) -> bool:
        return self.response.status in (cmh.CpSolverStatus.OPTIMAL, cmh.CpSolverStatus.FEASIBLE)

    @property
    def status_name(self) -> str:
        return str(self.response.status.name)

    def value(self, var: cmh.IntVar) -> int:
        return int(cmh.ResponseHelper.value(self.response, var))


def solve(model: Model, work_limit: float) -> Solved:
    """One worker, seed 0, a deterministic-time limit: the same answer on a busy machine."""
    params = cmh.SatParameters()
    params.max_deterministic_time = work_limit
    params.num_workers = 1
    params.random_seed = 0
    wrapper = cmh.SolveWrapper()
    wrapper.set_parameters(params)
    return Solved(cast(Any, wrapper).solve(model.model_proto))
