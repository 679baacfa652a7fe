"""The text form of a cost estimate (`hetc explain`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from hetc.passes.cost.estimate import Estimate, RankMemory
from hetc.passes.cost.schedule import LaneTiming
from hetc.passes.cost.provenance import Provenance
from hetc.passes.cost.utilization import Utilization
from hetc.ir.pipeline import Pipeline
from hetc.ir.plan import Plan
from hetc.ir.spec import ModelSpec, storage_dtype
from hetc.ir.units import counted, human_bytes, human_rate, human_seconds

__all__ = ["provenance_lines", "report", "utilization_text"]

_T = TypeVar("_T")

_COLUMNS = ("params", "grads", "optimizer", "activations", "buffers", "reserve")


def report(path: str, plan: Plan, e: Estimate) -> str:
    pipeline = plan.pipeline
    lines = [
        (f"{path}: {counted(pipeline.world_size, 'rank')}, {counted(len(pipeline.stages), 'stage')}, "
         f"{counted(len(pipeline.ministages), 'ministage')}, "
         f"{counted(pipeline.num_microbatches, 'microbatch')} of {pipeline.micro_batch}, "
         f"schedule {e.schedule}"),
        f"step time   {human_seconds(e.step_time_s)}  {_step_source(e)}",
        f"throughput  {e.tokens_per_s:,.0f} tokens/s   {utilization_text(e.utilization)}",
        "",
        *_lane_rows(pipeline, e),
        "",
        "memory per rank" + _memory_source(e) + ("" if e.fits else "   ** DOES NOT FIT **"),
    ]
    lines += _memory_rows(e.memory) + _gradient_dtype(plan.model)
    lines += ["", "traffic per step (one rank)"]
    for g in e.traffic:
        note = f"  ({g.note})" if g.note else ""
        lines.append(f"  {g.kind:3s} {g.group:52s} {human_bytes(g.bytes_per_step):>11s}  "
                     f"{g.seconds_per_step:.4g} s{note}")
    if not e.traffic:
        lines.append("  none")
    lines += ["", *provenance_lines(pipeline, e.provenance)]
    return "\n".join(lines)


def _lane_rows(pipeline: Pipeline, e: Estimate) -> list[str]:
    """Each lane's seconds a microbatch and a step, by the closed form, lanes of a stage that time alike on one
    row; the lane that paces the pipeline (`PlanTime.bottleneck`) marked: where a heterogeneous plan's time
    goes, stage by stage."""
    head = (f"  {'stage':12s} {'lanes':>7s} {'microbatches':>12s} {'forward':>10s} {'backward':>10s} "
            f"{'waits p2p':>10s} {'busy':>10s}")
    rows = ["time per lane (closed form: a microbatch, and busy, its lane's step of them)", head]
    for t, last in _runs(e.time.lanes, _alike):
        which = f"{t.lane}" if last.lane == t.lane else f"{t.lane}-{last.lane}"
        paces = e.time.bottleneck is not None and e.time.bottleneck[0] == t.stage and \
            t.lane <= e.time.bottleneck[1] <= last.lane
        rows.append(f"  {pipeline.stages[t.stage].name:12s} {which:>7s} {t.microbatches:>12d} "
                    f"{human_seconds(t.forward):>10s} {human_seconds(t.backward):>10s} "
                    f"{human_seconds(t.p2p_wait):>10s} {human_seconds(t.work):>10s}"
                    + ("  <- paces the pipeline" if paces else ""))
    return rows


def _runs(items: Sequence[_T], same: Callable[[_T, _T], bool]) -> list[tuple[_T, _T]]:
    """(first, last) of each run of consecutive `items` that are `same` as the run's first: one table row each."""
    out: list[tuple[_T, _T]] = []
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or not same(items[i], items[start]):
            out.append((items[start], items[i - 1]))
            start = i
    return out


def _alike(a: LaneTiming, b: LaneTiming) -> bool:
    return a.stage == b.stage and a.microbatches == b.microbatches and \
        all(abs(x - y) <= 1e-12 for x, y in ((a.forward, b.forward), (a.backward, b.backward),
                                              (a.p2p_wait, b.p2p_wait), (a.work, b.work)))


def _gradient_dtype(model: ModelSpec) -> list[str]:
    """Where the gradients are wider than the parameters, a line saying so: the grads column counts them."""
    grads, kept = model.gradient_dtype, storage_dtype(model.dtype)
    if grads is kept:
        return []
    line = (f"  gradients in {grads.value}, parameters in {kept.value}: summed and reduced in {grads.value} "
            "(grad_dtype; Megatron-LM's main_grad)")
    return [line]


def _step_source(e: Estimate) -> str:
    """Where the step time comes from, and the closed form's parts (Note [one step time])."""
    t = e.time
    parts = (f"pipeline {human_seconds(t.pipeline)} incl. bubble {human_seconds(t.bubble)}; after the flush "
             f"{human_seconds(t.tail)}")
    if e.closed_form_s is None:
        return f"({parts})"
    return f"(the compiled programs, simulated; the closed-form estimate {human_seconds(e.closed_form_s)}: {parts})"


def _memory_source(e: Estimate) -> str:
    """Where the memory comes from: the compiled programs' peaks, with the closed form's beside them (Note [one
    step time])."""
    if e.closed_form_memory is None:
        return ""
    gaps = [closed.total / m.total - 1 for m, closed in zip(e.memory, e.closed_form_memory, strict=True)]
    worst = max(gaps, key=abs)
    return f"  (the compiled programs' peaks; the closed-form estimate's furthest rank {100 * worst:+.1f}%)"


def provenance_lines(pipeline: Pipeline, prov: Provenance) -> list[str]:
    """Note [provenance] as text: layer times per stage, link rates, profiles offered but not used."""
    lines = ["layer times from"]
    for stage, sources in prov.layers.items():
        lines.append(f"  stage {pipeline.stages[stage].name}:")
        lines += [f"    {source}" for source in sources]
    lines += ["link rates from"] + [f"  {link}" for link in prov.links]
    if not prov.links:
        lines.append("  no traffic between GPUs")
    if prov.unused:
        lines += ["profiles offered but not used"] + [f"  {u}" for u in prov.unused]
    return lines


def utilization_text(u: Utilization) -> str:
    """MFU and HFU over the used GPUs, the cluster-wide figures beside them (Note [utilization])."""
    used = (f"MFU {u.mfu:.1%}   HFU {u.hfu:.1%} over {counted(u.used_gpus, 'used GPU')} "
            f"({human_rate(u.used_peak_flops)})")
    if u.used_gpus == u.cluster_gpus:
        return used + "; the whole cluster"
    return (used + f";   cluster-wide MFU {u.cluster_mfu:.1%}   HFU {u.cluster_hfu:.1%} over "
            f"{counted(u.cluster_gpus, 'GPU')} ({human_rate(u.cluster_peak_flops)})")


def _memory_rows(memory: tuple[RankMemory, ...]) -> list[str]:
    head = "  ranks        device     " + "".join(f"{c:>12s}" for c in (*_COLUMNS, "total", "capacity"))
    rows = [head]
    for m, last in _runs(memory, _same):
        ranks = f"{m.rank}" if last is m else f"{m.rank}-{last.rank}"
        cells = "".join(f"{human_bytes(getattr(m, c)):>12s}" for c in _COLUMNS)
        flag = "" if m.fits else "  over"
        host = f"  (+{human_bytes(m.host)} on host)" if m.host else ""
        rows.append(f"  {ranks:12s} {m.device:10s}{cells}{human_bytes(m.total):>12s}"
                    f"{human_bytes(m.capacity):>12s}{flag}{host}{_after_backward(m)}")
    return rows


def _after_backward(m: RankMemory) -> str:
    """Why a rank's peak holds no activations: it comes after the last backward, where ZeRO-1's reduced shard
    (in grads) sits beside the full gradients; and what the step holds at most."""
    if m.activations_in_step is None:
        return ""
    return f"  (peak after the last backward; {human_bytes(m.activations_in_step)} of activations in the step)"


def _same(a: RankMemory, b: RankMemory) -> bool:
    return a.device == b.device and a.stage == b.stage and a.activations_in_step == b.activations_in_step and \
        all(abs(getattr(a, c) - getattr(b, c)) < 1 for c in (*_COLUMNS, "host"))
