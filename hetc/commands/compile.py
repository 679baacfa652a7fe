"""`hetc compile SPEC -o DIR`: lower an explicit plan to per-rank programs, verify, write DIR."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from hetc.errors import Diagnostic, SpecError
from hetc.frontend import load_checked
from hetc.passes.cost import CostError, CostModel
from hetc.passes.cost.provenance import provenance
from hetc.passes.export_torch import torch_pipelines, why_not_exported
from hetc.passes.lower import PASS_NAMES, PASSES, lower
from hetc.passes.simulate import simulate
from hetc.passes.validate_fit import cost_error, peak_overflows
from hetc.passes.verify import VerifyError, verified_evaluation, verify
from hetc.passes.verify.memory import rank_peaks
from hetc.plandir import write_plan_dir
from hetc.profileargs import PROFILE_ENV, add_profile_option, load_profile_args, record_profiles
from hetc.program import Program

__all__ = ["Compiled", "compile_spec", "predict", "register", "write_compiled"]

log = logging.getLogger("hetc.compile")


class Compiled:
    """Everything compile produced, for the CLI and for tests."""

    def __init__(self, loaded, checked, program: Program, costs, timeline, eval_timeline=None):
        self.loaded, self.checked, self.program = loaded, checked, program
        self.costs, self.timeline = costs, timeline
        self.eval_timeline = eval_timeline   # one validation batch, when the job evaluates

    @property
    def pipeline(self):
        return self.checked.pipeline


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile", help="lower a plan to per-rank programs and verify them",
        description="Lower SPEC's explicit plan to one instruction program per rank, prove the programs "
                    "deadlock-free and complete (the verifier), and write the plan directory DIR: plan.het, "
                    "programs/rank-NNNN.txt (+ .json), groups.txt, summary.json, profiles.json, and torch/*.csv "
                    "(each lane's pipeline in torch.distributed.pipelining's action format) for plans whose lanes "
                    "line up across stages; for many-to-many pipelines (e.g. Zorse's) torch's format has no "
                    "equivalent, and compile says that it skipped torch/. "
                    f"Measured profiles come from --profile and ${PROFILE_ENV}.",
        epilog="passes: " + "; ".join(f"{n} ({d})" for n, d, _ in PASSES),
    )
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="the plan directory to write")
    p.add_argument("--dump-after", choices=PASS_NAMES + ["all"], metavar="PASS",
                   help=f"print every rank's program after PASS ({', '.join(PASS_NAMES)} or all)")
    add_profile_option(p)
    p.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()

    def dump(name: str, program: Program) -> None:
        sys.stdout.write(f"# after pass {name}\n")
        for rp in program.ranks:
            sys.stdout.write(rp.to_text() + "\n")

    profiles = load_profile_args(args.profile)
    try:
        compiled = compile_spec(Path(args.spec), args.dump_after, dump if args.dump_after else None, profiles)
    except VerifyError as err:
        print(f"hetc compile: the lowered programs are unsafe (a bug in hetc's lowering):\n{err.render()}",
              file=sys.stderr)
        return 1
    summary = write_compiled(compiled, args.out, args.profile)
    program, step = compiled.program, compiled.timeline.step_time
    took = time.perf_counter() - start
    if (why := why_not_exported(compiled.pipeline)) is not None:
        print(f"torch/*.csv not written: {why}")
    print(f"compiled {args.spec}: {program.world_size} ranks, {summary['instructions']} instructions, "
          f"verified; predicted {step * 1e3:.2f} ms/step ({summary['tokens_per_s']:,.0f} tokens/s) "
          f"[{took:.2f}s] -> {args.out}/")
    print_profile_use(provenance(compiled.costs), bool(compiled.costs.profiles.sources))
    return 0


def print_profile_use(prov, offered: bool, file=None) -> None:
    """What timed the plan's layers and which profiles offered are unused, and why (Note [provenance])."""
    if offered:
        print("layer times from: " + "; ".join(sorted({s for stage in prov.layers.values() for s in stage})),
              file=file)
    for u in prov.unused:
        print(f"unused profile {u}", file=file)
