"""What `hetc plan` says about a plan: the text summary with the baselines table, and the JSON object."""

from __future__ import annotations

from dataclasses import replace

from hetc.commands.costreport import provenance_lines, utilization_text
from hetc.ir.units import counted, human_bytes, human_seconds
from hetc.passes.cost import CostModel, Profiles, RankMemory
from hetc.passes.cost.provenance import Provenance, provenance
from hetc.passes.cost.utilization import Utilization, utilization
from hetc.ir.errors import InternalError
from hetc.ir.jsontypes import JsonObject
from hetc.passes.plan.baselines import Baseline
from hetc.passes.plan.candidate_score import Score
from hetc.passes.plan.planner import Headroom, PlanResult
from hetc.passes.validate_fit import HEADROOM_PRICE, NEAR_CAPACITY
from hetc.passes.simulated_step import AGREEMENT
from hetc.ir.pipeline import Pipeline, Stage
from hetc.ir.spec import Checkpointing, ModelSpec, Objective, OffloadSpec, OffloadTarget, RankSlice, StageSpec

__all__ = ["plan_json", "plan_provenance", "plan_summary"]


def _known(score: Score | None) -> Score:
    """A planner's score a result must have: `score`, which a result without the cost model's estimate has,
    or `printed_score`, the score at the printed step (Note [one number] in passes/plan/final.py)."""
    if score is None:
        raise InternalError("a plan result with neither an estimate nor a score")
    return score


def _memory(result: PlanResult) -> list[RankMemory]:
    """One entry per rank, from the full estimate or the planner's classes of alike ranks."""
    if result.estimate is not None:
        return list(result.estimate.memory)
    plan, score = result.plan, _known(result.score)
    rank_of = {g.id: r for r, g in enumerate(plan.pipeline.world)}
    return sorted((replace(m, rank=rank_of[i], gpu=str(plan.topology.gpus[i]))
                   for m, ids in zip(score.memory, score.classes) for i in ids), key=lambda m: m.rank)


def plan_provenance(result: PlanResult, profiles: Profiles) -> Provenance:
    """Note [provenance] of the printed plan: the estimate's, or read off a cost model of it."""
    if result.estimate is not None:
        return result.estimate.provenance
    return provenance(CostModel(result.plan, profiles))


def plan_summary(path: str, result: PlanResult, prov: Provenance | None = None) -> str:
    """The summary; with `prov` (`plan_provenance`), where its numbers came from (Note [provenance])."""
    plan = result.plan
    p = plan.pipeline
    lines = []
    if result.planned:
        won = "" if result.chosen == "planner" else f"; the {result.chosen} baseline won"
        lines.append(f"planned {path} in {result.seconds:.2f} s ({result.structures} structures searched) "
                     f"for {result.goal.describe()}{won}")
    else:
        lines.append(f"{path}: the plan has no `auto`; nothing to plan")
    idle = ", ".join(s.group for s in plan.parallel.idle) or "none"
    lines.append(f"  schedule {p.schedule.value}, micro_batch {p.micro_batch}, "
                 f"{p.num_microbatches} microbatches, "
                 f"{counted(len(p.stages), 'stage')} on {counted(p.world_size, 'rank')} (idle: {idle})")
    lines += [f"    idle {reason.group}: {reason.text}" for reason in result.idle]
    width = max(4, *(len(st.name) for st in p.stages))
    layer_texts = [p.layers_text(plan.model, st.index) for st in p.stages]
    layer_width = max(18, *map(len, layer_texts))
    for st, sp, layers in zip(p.stages, plan.parallel.resolved_stages, layer_texts):
        counts = sorted({len(lane.microbatches) for lane in st.lanes})
        mbs = str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"
        lanes = counted(len(st.lanes), "lane")
        lines.append(f"    {st.name:{width}s} {_ranks(sp):28s} {layers:{layer_width}s} {lanes:>9s} × tp {st.tp}  "
                     f"ZeRO-{st.zero.level}  {counted(len(st.ministages), 'ministage')}  "
                     f"{mbs} microbatches/lane" + _offload(st.offload) + _recompute(st.checkpoint))
    memory = _memory(result)
    fullest = max(memory, key=lambda m: m.share)
    source = "the cost model's estimate" if result.estimate is not None else "the planner's score"
    if result.estimate is not None and result.estimate.closed_form_s is not None:   # Note [one step time]
        source = (f"the step of the compiled programs, simulated (closed form "
                  f"{human_seconds(result.estimate.closed_form_s)}), and their memory peaks")
    lines.append(f"  predicted {human_seconds(result.step_time_s)}/step, {result.tokens_per_s:,.0f} tokens/s; "
                 f"fullest GPU {fullest.gpu} at {fullest.share:.0%} of "
                 f"{human_bytes(fullest.capacity)} ({source})")
    lines.append(f"  {utilization_text(_utilization(result))}")
    if result.headroom is not None:
        lines.append(f"  {_headroom_text(result, result.headroom)}")
    if result.printed_score is not None and result.goal.kind is Objective.COST:
        score = result.printed_score   # at the printed step (Note [one number])
        lines.append(f"  cost {score.dollars_per_hour:,.2f} $/h, {score.dollars_per_token * 1e6:.4g} $ per "
                     "million tokens")
    if result.baselines:
        lines += ["", _table(result)]
    if prov is not None:
        lines += ["", *provenance_lines(p, prov)]
    return "\n".join(lines)


def _headroom_text(result: PlanResult, headroom: Headroom) -> str:
    """What the planner's memory headroom weighed (Note [planning headroom] in passes/plan/planner.py)."""
    other, mine = headroom.other, _known(result.score)
    compared = (f"{human_seconds(other.step_time_s)}/step against this plan's {human_seconds(mine.step_time_s)}"
                if result.goal.kind is not Objective.COST else
                f"{other.dollars_per_token * 1e6:.4g} $ per million tokens against this plan's "
                f"{mine.dollars_per_token * 1e6:.4g}")
    if not headroom.kept:
        return (f"headroom: none kept, this plan filling {_fullest_text(mine)} by the planner's estimate; the best "
                f"plan within {NEAR_CAPACITY:.0%} of each device's memory, {compared} by the closed form, costs "
                f"more than the {HEADROOM_PRICE:.0%} the planner pays for it")
    return (f"headroom: planned within {mine.fill:.0%} of each device's memory; the best plan for the whole "
            f"device, {compared} by the closed form, fills {_fullest_text(other)}")


def _fullest_text(score: Score) -> str:
    fullest = score.fullest
    return f"{fullest.share:.1%} of {fullest.gpu} ({fullest.device})"


def _ranks(stage_spec: StageSpec) -> str:
    value = ", ".join(_slice(r) for r in stage_spec.resolved_ranks)
    return value if len(value) <= 28 else value[:25] + "..."


def _slice(r: RankSlice) -> str:
    def part(start: int | None, stop: int | None, is_slice: bool) -> str:
        if not is_slice:
            return str(start)
        return f"{'' if start is None else start}:{'' if stop is None else stop}"

    node = part(r.node_start, r.node_stop, r.node_is_slice)
    gpu = part(r.gpu_start, r.gpu_stop, r.gpu_is_slice)
    if node == ":" and gpu == ":":
        return r.group
    return f"{r.group}[{node}]" if gpu == ":" else f"{r.group}[{node}, {gpu}]"


def _offload_targets(off: OffloadSpec) -> dict[str, OffloadTarget]:
    return {"params": off.params, "optimizer": off.optimizer, "activations": off.activations}


def _offload(off: OffloadSpec) -> str:
    parts = [n for n, target in _offload_targets(off).items() if target is not OffloadTarget.NONE]
    return f"  offload {'+'.join(parts)}" if parts else ""


def _recompute(level: Checkpointing) -> str:
    return "" if level is Checkpointing.NONE else f"  recompute {level.value}"


def _utilization(result: PlanResult) -> Utilization:
    """The estimate's, or (planned class by class) the same figures from the planner's step time."""
    if result.estimate is not None:
        return result.estimate.utilization
    plan = result.plan
    return utilization(plan.model, plan.pipeline, plan.topology, result.step_time_s)


def _table(result: PlanResult) -> str:
    cost = result.goal.kind is Objective.COST
    head = f"  {'baseline (same cost model)':62s} {'step (s)':>10s} {'tokens/s':>12s}"
    head += f" {'$/M tokens':>11s}" if cost else ""
    rows = [head + f" {'plan vs it':>11s}"]
    rows += [f"  {_title(b):62s} " + _cells(result, b, cost) for b in result.baselines]
    if any(_closed_form_only(result, b) for b in result.baselines):
        rows.append(f"  * the closed form: slower than the plan by more than the {AGREEMENT:.0%} it may differ from "
                    "the simulation, so not simulated")
    return "baselines\n" + "\n".join(rows)


def _closed_form_only(result: PlanResult, b: Baseline) -> bool:
    """Whether `b` fits and prints its closed form beside a plan that prints its simulated step (Note [one
    number] in passes/plan/final.py: it could not win)."""
    return result.simulated and b.allowed and b.score is not None and b.score.fits and b.closed_form_s is None


def _title(b: Baseline) -> str:
    return b.title if len(b.title) <= 62 else b.title[:59] + "..."


def _cells(result: PlanResult, b: Baseline, cost: bool) -> str:
    if b.score is None:
        blank = f"{'—':>10s} {'—':>12s}" + (f" {'—':>11s}" if cost else "")
        return f"{blank}   not built: {b.note}"
    mark = "*" if _closed_form_only(result, b) else " "
    cells = f"{b.score.step_time_s:9.4g}{mark} {b.score.tokens_per_s:12,.0f}"
    if cost:
        cells += f" {b.score.dollars_per_token * 1e6:11.4g}"
        ratio = b.score.dollars_per_token / _known(result.printed_score).dollars_per_token
    else:
        ratio = b.score.step_time_s / result.step_time_s
    oom = ("" if b.score.fits else "   does not fit in memory" if not b.score.fits_device
           else f"   fills more than {b.score.fill:.0%} of a device's memory")   # Note [planning headroom]
    fixed = "" if b.allowed else "   outside what the spec fixes"
    return f"{cells} {f'{ratio:.2f}×':>11s}{oom}{fixed}"


def plan_json(path: str, result: PlanResult, text: str, prov: Provenance) -> JsonObject:
    """`hetc plan --json`: the estimate's (or score's) figures, memory per rank, the plan, the baselines."""
    plan = result.plan
    p = plan.pipeline
    head = (result.estimate.to_json() if result.estimate is not None
            else _score_json(_known(result.score), result))
    memory: list[JsonObject] = [{"rank": m.rank, "gpu": m.gpu, "device": m.device, "stage": m.stage, "params": m.params,
               "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations, "buffers": m.buffers,
               "reserve": m.reserve, "host": m.host, "total": m.total, "capacity": m.capacity, "fits": m.fits}
              for m in _memory(result)]
    out: JsonObject = {"spec": path, **head, "memory": memory, "planned": result.planned, "chosen": result.chosen,
           "estimated_by": "cost model" if result.estimate is not None else "planner (class by class)",
           "objective": {"goal": result.goal.kind.value, "budget_per_hour": result.goal.budget,
                         "min_throughput": result.goal.min_throughput},
           "plan": {"schedule": p.schedule.value, "micro_batch": p.micro_batch,
                    "microbatches": p.num_microbatches,
                    "idle": [s.group for s in plan.parallel.idle],
                    "idle_reasons": [reason.to_json() for reason in result.idle],
                    "stages": [_stage_json(plan.model, p, st) for st in p.stages]},
           "baselines": [_baseline_json(b) for b in result.baselines],
           "planning": {"seconds": result.seconds, "structures": result.structures,
                        "memory_share": result.score.fill if result.score is not None else None,
                        "headroom": None if result.headroom is None else _headroom_json(result.headroom)},
           "text": text, **prov.to_json()}
    out.setdefault("memory_source", "estimate")     # the planner's classes: the closed form's
    if result.printed_score is not None:
        out["dollars_per_hour"] = result.printed_score.dollars_per_hour
        out["dollars_per_token"] = result.printed_score.dollars_per_token
    return out


def _headroom_json(headroom: Headroom) -> JsonObject:
    """What the headroom weighed: whether it was kept, and the other plan's closed form and fullest rank."""
    other = headroom.other
    return {"kept": headroom.kept, "other": {"step_time_s": other.step_time_s,
                                             "dollars_per_token": other.dollars_per_token, "gpu": other.fullest.gpu,
                                             "fullest": other.fullest.share}}


def _score_json(score: Score, result: PlanResult) -> JsonObject:
    """The headline numbers from the planner's score, where no full estimate was made."""
    return {"step_time_s": score.step_time_s, "tokens_per_step": score.tokens_per_step,
            "tokens_per_s": score.tokens_per_s, "fits": score.fits_device, **_utilization(result).to_json()}


def _stage_json(model: ModelSpec, p: Pipeline, st: Stage) -> JsonObject:
    runs = p.layer_runs(st.index)
    return {"name": st.name, "first_layer": model.layer_name(runs[0][0]),
            "last_layer": model.layer_name(runs[-1][1] - 1),
            "layers": [[model.layer_name(a), model.layer_name(b - 1)] for a, b in runs], "ranks": list(st.ranks),
            "lanes": len(st.lanes), "tp": st.tp, "zero": st.zero.resolved_level,
            "ministages": len(st.ministages),
            "microbatches": [len(lane.microbatches) for lane in st.lanes],
            "offload": {k: target.value for k, target in _offload_targets(st.offload).items()},
            "activation_checkpoint": st.checkpoint.value}


def _baseline_json(b: Baseline) -> JsonObject:
    if b.score is None:
        return {"name": b.name, "title": b.title, "built": False, "note": b.note}
    closed = b.score.step_time_s if b.closed_form_s is None else b.closed_form_s
    return {"name": b.name, "title": b.title, "built": True, "step_time_s": b.score.step_time_s,
            "step_source": "estimate" if b.closed_form_s is None else "simulated", "estimate_step_s": closed,
            "allowed": b.allowed,
            "tokens_per_s": b.score.tokens_per_s, "fits": b.score.fits_device, "within_memory_share": b.score.fits,
            "dollars_per_token": b.score.dollars_per_token}
