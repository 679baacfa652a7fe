"""The compiler's library entry: check a spec, compile a plan, write its plan directory.

`load_checked` is the front door every verb uses (parse, import, convert,
validate); `compile_spec` lowers, verifies and simulates an explicit plan
into a `Compiled`, and `write_compiled` writes it as the plan directory
(hetc/plandir.py). The CLI verbs (hetc/commands/), the tests and the
benchmarks all call these.
"""

from __future__ import annotations

from pathlib import Path

from hetc.errors import Diagnostic, SpecError
from hetc.frontend.load import LoadedSpec, load_spec
from hetc.passes.cost import CostError, CostModel
from hetc.passes.cost.provenance import provenance
from hetc.passes.export_torch import torch_pipelines
from hetc.passes.lower import lower
from hetc.passes.simulate import simulate
from hetc.passes.validate import Checked, check_spec
from hetc.passes.validate_fit import cost_error, estimate_overflows, peak_overflows
from hetc.passes.verify import VerifyError, verified_evaluation, verify
from hetc.passes.verify.memory import rank_peaks
from hetc.plandir import record_profiles, write_plan_dir
from hetc.program import Program

__all__ = ["Compiled", "compile_spec", "load_checked", "plan_facts", "predict", "write_compiled"]


def load_checked(path: str | Path, require_complete: bool = False,
                 require_fit: bool = False) -> tuple[LoadedSpec, Checked]:
    """Parse, import, convert and validate `path`; raise one SpecError with every problem.

    `require_fit` also asks the cost model whether an explicit plan fits in
    device memory (`hetc check`); explain leaves it out, to show the numbers
    of a plan that does not fit, and compile asks the verifier instead.
    """
    loaded = load_spec(path)
    checked = check_spec(loaded.spec, loaded.path.parent)
    if require_fit and checked.pipeline is not None and (overflows := estimate_overflows(checked)):
        raise SpecError(overflows)
    if require_complete and not loaded.spec.is_complete:
        missing = [k for k in ("model", "cluster", "train", "parallel") if getattr(loaded.spec, k) is None]
        raise SpecError.at(loaded.spec.span, f"the spec has no {', '.join(missing)} block"
                           f"{'s' if len(missing) > 1 else ''}; this command needs a whole spec")
    return loaded, checked


class Compiled:
    """Everything compile produced, for the CLI and for tests."""

    def __init__(self, loaded, checked, program: Program, costs, timeline, eval_timeline=None):
        self.loaded, self.checked, self.program = loaded, checked, program
        self.costs, self.timeline = costs, timeline
        self.eval_timeline = eval_timeline   # one validation batch, when the job evaluates

    @property
    def pipeline(self):
        return self.checked.pipeline


def compile_spec(spec_path: Path, dump_after: str | None = None, on_dump=None, profiles=None) -> Compiled:
    """Lower, verify and simulate `spec_path`'s plan, timed with `profiles` (a Profiles, or none)."""
    loaded, checked = load_checked(spec_path, require_complete=True)
    if checked.pipeline is None:  # `auto` left: plan first (`hetc plan SPEC -o OUT.het` shows the plan)
        from hetc.passes.plan.planner import plan_checked

        checked = plan_checked(loaded.spec, loaded.path.parent, profiles)
    # the schedule is timed with the cost model that predicts and verifies it (Note [in-flight limit])
    costs = CostModel(checked.spec, checked.pipeline, checked.topology, profiles)
    program = lower(checked.spec, checked.pipeline, dump_after, on_dump, costs)
    try:
        costs, timeline = predict(program, checked, profiles, costs)
        evaluation = verified_evaluation(program, checked.pipeline, checked.spec)
        eval_timeline = None if evaluation is None else simulate(evaluation, checked.pipeline, checked.spec, costs)
    except CostError as err:
        raise SpecError(cost_error(checked.spec, err)) from None
    except VerifyError as err:
        if err.check != "memory":
            raise
        raise SpecError(_memory_overflows(program, checked, costs, err)) from None
    return Compiled(loaded, checked, program, costs, timeline, eval_timeline)


def _memory_overflows(program: Program, checked, costs: CostModel, err: VerifyError) -> list[Diagnostic]:
    """The plan's fault, not lowering's: one located summary per stage (passes/validate_fit.py)."""
    peaks = rank_peaks(program, checked.pipeline, costs)
    return peak_overflows(checked.spec, checked.pipeline, peaks) or [
        Diagnostic(checked.spec.parallel.span, f"the plan does not fit in device memory:\n{err.render()}")]


def predict(program: Program, checked, profiles=None, costs: CostModel | None = None):
    """(the CostModel, the predicted Timeline) of verified-to-be `program`: `compile` and `viz --profile`."""
    costs = costs or CostModel(checked.spec, checked.pipeline, checked.topology, profiles)
    verify(program, checked.pipeline, checked.spec, costs)
    return costs, simulate(program, checked.pipeline, checked.spec, costs, plan_facts(checked))


def plan_facts(checked) -> list[tuple[str, str]]:
    """The plan at a glance, for the visualizer's side panel."""

    def count(n: int, noun: str) -> str:
        return f"{n} {noun}{'' if n == 1 else 's'}"

    spec, p = checked.spec, checked.pipeline
    facts = [("schedule", p.schedule.value), ("ranks", str(p.world_size)), ("stages", str(len(p.stages))),
             ("ministages", str(len(p.ministages))), ("microbatches", str(p.num_microbatches)),
             ("micro batch", str(p.micro_batch)),
             ("tokens_per_step", str(spec.train.global_batch * spec.model.seq))]
    for st in p.stages:
        first = p.ministages[st.ministages[0]]
        last = p.ministages[st.ministages[-1]]
        layers = f"{spec.model.layer_name(first.first_layer)}..{spec.model.layer_name(last.stop_layer - 1)}"
        facts.append((f"stage {st.name}", (f"{layers}, {count(len(st.lanes), 'lane')} × "
                                           f"{count(st.lane_size, 'rank')}, ZeRO-{st.zero.level}, "
                                           f"{count(len(st.ministages), 'ministage')}")))
    return facts


def write_compiled(compiled: Compiled, out: Path, profile_args: list[str] | None = None) -> dict:
    """Write the plan directory `out` of `compiled` (with the profiles `profile_args` named); return its
    summary."""
    pipeline, program = compiled.pipeline, compiled.program
    exports = {tp.name: tp.csv() for tp in torch_pipelines(program, pipeline)}
    summary = {"ranks": program.world_size, "stages": len(pipeline.stages),
               "ministages": len(pipeline.ministages), "microbatches": pipeline.num_microbatches,
               "schedule": pipeline.schedule.value,
               "instructions": sum(len(r.instrs) for r in program.ranks)}
    step = compiled.timeline.step_time
    tokens = compiled.checked.spec.train.global_batch * compiled.checked.spec.model.seq
    summary.update(step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0)
    if compiled.eval_timeline is not None:
        train = compiled.checked.spec.train
        summary.update(eval_time_s=compiled.eval_timeline.step_time * train.eval_batches,
                       eval_every=train.eval_every)
    prov = provenance(compiled.costs)
    write_plan_dir(out, compiled.checked.spec, compiled.loaded.path.parent, program, exports,
                   compiled.timeline.to_json(), summary, record_profiles(profile_args or [], prov.unused))
    return summary
