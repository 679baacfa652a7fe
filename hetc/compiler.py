"""The compiler's library entry: check a spec, compile a plan, write its plan directory.

`load_checked` is the front door every verb uses (parse, import, convert,
validate); `compile_spec` lowers, verifies and simulates an explicit plan
into a `Compiled`, and `write_compiled` writes it as the plan directory
(hetc/plandir.py). The CLI verbs (hetc/commands/), the tests and the
benchmarks all call these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetc.ir.errors import Diagnostic, SpecError
from hetc.frontend.load import LoadedSpec, load_spec, with_plan_to_fill
from hetc.ir.jsontypes import JsonObject
from hetc.passes.cost import CostError, CostModel, Profiles
from hetc.passes.cost.provenance import provenance
from hetc.passes.build import Lowered, build
from hetc.passes.lower.by_class import lower_by_class
from hetc.passes.export_torch import torch_pipelines
from hetc.passes.plan.deadline import DEFAULT_TIME_LIMIT_S
from hetc.passes.validate import Checked, check_spec
from hetc.ir.plan import Plan
from hetc.passes.validate_fit import cost_error, estimate_overflows, peak_overflows
from hetc.passes.verify import VerifyError
from hetc.passes.verify.memory import rank_peaks
from hetc.ir.pipeline import Pipeline
from hetc.plandir import record_profiles, write_plan_dir
from hetc.ir.program import Program
from hetc.ir.timeline import Timeline
from hetc.ir.units import counted

__all__ = ["Compiled", "compile_spec", "load_checked", "plan_facts", "predict", "spec_inputs", "write_compiled"]


def load_checked(path: str | Path, require_complete: bool = False,
                 require_fit: bool = False, plan_missing: bool = False) -> tuple[LoadedSpec, Checked]:
    """Parse, import, convert and validate `path`; raise one SpecError with every problem.

    `require_fit` also asks the cost model whether an explicit plan fits in
    device memory (`hetc check`); explain leaves it out, to show the numbers
    of a plan that does not fit, and compile asks the verifier instead.
    `plan_missing`: a spec without a parallel block is planned (`with_plan_to_fill`: plan and compile).
    """
    loaded = with_plan_to_fill(load_spec(path)) if plan_missing else load_spec(path)
    checked = check_spec(loaded.spec, loaded.path.parent)
    if require_fit and (plan := checked.explicit()) is not None and (overflows := estimate_overflows(plan)):
        raise SpecError(overflows)
    if require_complete and not loaded.spec.is_complete:
        needed = ("model", "cluster", "train") + (() if plan_missing else ("parallel",))   # else planned
        missing = [k for k in needed if getattr(loaded.spec, k) is None]
        raise SpecError.at(loaded.spec.span, f"the spec has no {', '.join(missing)} block"
                           f"{'s' if len(missing) > 1 else ''}; this command needs a whole spec"
                           f"{' (without a parallel block it plans one)' if plan_missing else ''}")
    return loaded, checked


def spec_inputs(target: Path) -> list[tuple[Path, str]]:
    """What the spec TARGET names reads, or a plan directory's plan.het (`LoadedSpec.inputs`): the files a
    one-file output must not replace (Note [output files]); none where TARGET holds neither (the command says
    so)."""
    from hetc.ir.outdir import PLAN_FILE

    path = target if target.is_file() else target / PLAN_FILE
    return load_checked(path)[0].inputs() if path.is_file() else []


@dataclass(frozen=True)
class Compiled:
    """Everything compile produced, for the CLI and for tests."""

    loaded: LoadedSpec
    plan: Plan               # the plan compiled (planned first where the spec had `auto`)
    program: Program
    costs: CostModel
    timeline: Timeline               # the predicted step
    eval_timeline: Timeline | None = None   # one validation batch, when the job evaluates
    evaluation: Program | None = None       # the evaluation programs (verified), when the job evaluates

    @property
    def pipeline(self) -> Pipeline:
        return self.plan.pipeline


def compile_spec(spec_path: Path, dump_after: str | None = None,
                 on_dump: Callable[[str, Program], None] | None = None,
                 profiles: Profiles | None = None, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
                 progress: Callable[[str], None] | None = None) -> Compiled:
    """Lower, verify and simulate `spec_path`'s plan, timed with `profiles` (a Profiles, or none); a plan with
    `auto` is planned first, its search held to `time_limit_s` (Note [an anytime search]); `progress(line)`
    hears each phase done."""
    say = progress or (lambda _: None)
    loaded, checked = load_checked(spec_path, require_complete=True, plan_missing=True)
    explicit = checked.explicit()
    plan, planned = (explicit, None) if explicit is not None else _planned(loaded, profiles, time_limit_s)
    say(f"{'checked' if explicit is not None else 'planned'}: {plan.pipeline.world_size:,} ranks, "
        f"{len(plan.pipeline.stages)} stages, {plan.pipeline.num_microbatches} microbatches")
    # the schedule is timed with the cost model that predicts and verifies it (Note [in-flight limit])
    costs = CostModel(plan, profiles)
    reuse = planned if dump_after is None else None   # the planner lowered it, from the same inputs
    try:
        got = build(plan, costs=costs, lowered=reuse, evaluation=True, facts=plan_facts(plan),
                    dump_after=dump_after, on_dump=on_dump, progress=progress)
    except CostError as err:
        raise SpecError(cost_error(plan, err)) from None
    except VerifyError as err:
        if err.check != "memory":
            raise
        program = reuse.program if reuse is not None else lower_by_class(plan, costs).program
        raise SpecError(_memory_overflows(program, plan, costs, err)) from None
    assert got.timeline is not None   # simulated
    return Compiled(loaded, plan, got.program, costs, got.timeline, got.eval_timeline, got.evaluation)


def _planned(loaded: LoadedSpec, profiles: Profiles | None,
             time_limit_s: float | None) -> tuple[Plan, Lowered | None]:
    """`auto` left: plan first (`hetc plan SPEC -o OUT.het` shows the plan); with its programs as the planner
    lowered, ran and checked them (Note [the planner checks its winner]), where it did."""
    from hetc.passes.plan.planner import plan_checked

    result = plan_checked(loaded.spec, loaded.path.parent, profiles, time_limit_s)
    return result.plan, result.lowered


def _memory_overflows(program: Program, plan: Plan, costs: CostModel,
                      err: VerifyError) -> list[Diagnostic]:
    """The plan's fault, not lowering's: one located summary per stage (passes/validate_fit.py)."""
    peaks = rank_peaks(program, plan.pipeline, costs)
    return peak_overflows(plan, peaks) or [
        Diagnostic(plan.parallel.span, f"the plan does not fit in device memory:\n{err.render()}")]


def predict(program: Program, plan: Plan, profiles: Profiles | None = None) -> tuple[CostModel, Timeline]:
    """(the CostModel, the predicted Timeline) of verified-to-be `program`: `compile` and `viz --profile`."""
    got = build(plan, profiles, lowered=Lowered(program), facts=plan_facts(plan))
    assert got.timeline is not None   # simulated
    return got.costs, got.timeline


def plan_facts(plan: Plan) -> list[tuple[str, str]]:
    """The plan at a glance, for the visualizer's side panel."""

    model, p = plan.model, plan.pipeline
    facts = [("schedule", p.schedule.value), ("ranks", str(p.world_size)), ("stages", str(len(p.stages))),
             ("ministages", str(len(p.ministages))), ("microbatches", str(p.num_microbatches)),
             ("micro batch", str(p.micro_batch)),
             ("tokens_per_step", str(plan.train.global_batch * model.seq))]
    for st in p.stages:
        facts.append((f"stage {st.name}", (f"{p.layers_text(model, st.index)}, {counted(len(st.lanes), 'lane')} × "
                                           f"{counted(st.lane_size, 'rank')}, ZeRO-{st.zero.level}, "
                                           f"{counted(len(st.ministages), 'ministage')}")))
    return facts


def write_compiled(compiled: Compiled, out: Path, profile_args: list[str] | None = None) -> JsonObject:
    """Write the plan directory `out` of `compiled` (with the profiles `profile_args` named); return its
    summary."""
    pipeline, program = compiled.pipeline, compiled.program
    exports = {tp.name: tp.csv() for tp in torch_pipelines(program, pipeline)}
    step = compiled.timeline.step_time
    train = compiled.plan.train
    tokens = train.global_batch * compiled.plan.model.seq
    summary: JsonObject = {"ranks": program.world_size, "stages": len(pipeline.stages),
                           "ministages": len(pipeline.ministages), "microbatches": pipeline.num_microbatches,
                           "schedule": pipeline.schedule.value,
                           "instructions": sum(len(r.instrs) for r in program.ranks),
                           "step_time_s": step, "tokens_per_s": tokens / step if step > 0 else 0.0}
    if compiled.eval_timeline is not None:
        summary.update(eval_time_s=compiled.eval_timeline.step_time * train.eval_batches,
                       eval_every=train.eval_every)
    unused = provenance(compiled.costs).unused
    write_plan_dir(out, compiled.plan.spec, compiled.loaded.path.parent, program, exports,
                   compiled.timeline.to_json(), summary, record_profiles(profile_args or [], unused),
                   compiled.evaluation)
    return summary
