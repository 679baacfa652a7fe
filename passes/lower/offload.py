"""Pass `offload`: host offload and prefetch of parameters and boundary activations.

Note [parameter residency]: a ministage whose shard says `param_offload`
lives on the host except during its *windows* — maximal stretches of the
program that touch its parameters (gathers, compute, frees, the step) with
no other ministage's compute in between. Each window's parameters are
prefetched `prefetch` windows ahead (any ministage's windows count, so with
depth 1 at most the current and the next ministage are resident, as in
Zorse — plus, under ZeRO-3, the shard of the one after, which the next
ministage's gather posted one run ahead needs) and offloaded right after the window; the offload is waited one
compute op later (the device copy is only released when it completes), or
before the same ministage is prefetched again if that comes first, or at
the end of the step.

Note [clean parameter offload]: the host copy of offloaded parameters is
current at the start of every step (the runtime sets them up there, and
each step ends with them there), and only the ministage's step changes
them on the device (the step on the device, or the host's step publishing
to the device copy, and ZeRO-1/2's gather after it). A window without a
step of its ministage offloads with `host_current`: the device copy is
released, not copied back. Per-microbatch schedules with several chunks
fetch a ministage's parameters around nearly every compute op, and each
window copied them back before (two copies a window on the rank's one copy
stream where one is needed: Megatron's 65B interleaved plan with its
parameters on the host simulated 233 s a step, now 120 s); only the window holding
the step copies now.

Note [activation offload]: with `act_offload` a ministage stashes only its
boundary input; it goes to the host right after the forward (waited one
compute op later) and comes back one compute op before its backward. A
backward that directly follows its own forward keeps the stash on device.
"""

from __future__ import annotations

from hetc.passes.lower.context import LowerContext, next_handle
from hetc.passes.lower.edits import Edits, Handles
from hetc.ir.program import (COMPUTE_TYPES, AllGather, Backward, BackwardInput, Forward, Free, Instr, Offload,
                          Prefetch, Program, RankProgram, Step, Tensor, Wait)

__all__ = ["insert_offload"]


def insert_offload(program: Program, ctx: LowerContext) -> Program:
    depth = max(1, ctx.pipeline.prefetch)
    return Program(tuple(_rank(rp, depth) for rp in program.ranks), program.groups)


def _rank(rp: RankProgram, depth: int) -> RankProgram:
    params = {s.ms for s in rp.shards if s.param_offload}
    acts = {s.ms for s in rp.shards if s.act_offload}
    if not params and not acts:
        return rp
    edits = Edits()
    handles = Handles(next_handle(rp.instrs))
    if params:
        _param_windows(rp.instrs, params, depth, edits, handles)
    if acts:
        _activations(rp.instrs, acts, edits, handles)
    return RankProgram(rp.rank, rp.stage, rp.lane, rp.tp_rank, rp.cp_rank, rp.shards, edits.apply(rp.instrs))


def _refs(instr: Instr, handles_of: dict[int, int]) -> int | None:
    """The ministage whose parameters `instr` needs on the device, if any."""
    if isinstance(instr, (COMPUTE_TYPES, Step)):
        return instr.ms
    if isinstance(instr, (AllGather, Free)) and instr.what is Tensor.PARAMS:
        return instr.ms
    if isinstance(instr, Wait):
        return handles_of.get(instr.handle)
    return None


def _residency_runs(instrs: tuple[Instr, ...], params: set[int]) -> list[list[int]]:
    """[ms, start, end] for each stretch an offloaded ministage must be on the device.

    A run is a maximal sequence of compute ops of one ministage; it starts at
    the gather posted for it (if any) and ends at its last later reference
    (free, step, the gather after the step) before the ministage's next run.
    """
    gathers = {i.handle: i.ms for i in instrs
               if isinstance(i, AllGather) and i.what is Tensor.PARAMS and i.handle is not None}
    runs: list[list[int]] = []
    last_ms = None
    for i, instr in enumerate(instrs):
        if isinstance(instr, COMPUTE_TYPES):
            if instr.ms != last_ms:
                runs.append([instr.ms, i, i])
            else:
                runs[-1][2] = i
            last_ms = instr.ms
    runs = [r for r in runs if r[0] in params]
    for k, run in enumerate(runs):
        ms, first, _ = run
        floor = max((r[2] for r in runs[:k] if r[0] == ms), default=-1)
        posted = [j for j in range(floor + 1, first)
                  if isinstance(g := instrs[j], AllGather) and g.what is Tensor.PARAMS and g.ms == ms]
        if posted:
            run[1] = posted[0]
    for k, run in enumerate(runs):
        ms = run[0]
        ceiling = min((r[1] for r in runs[k + 1:] if r[0] == ms), default=len(instrs))
        for j in range(run[2] + 1, ceiling):
            if _refs(instrs[j], gathers) == ms:
                run[2] = j
    return runs


def _param_windows(instrs: tuple[Instr, ...], params: set[int], depth: int, edits: Edits, handles: Handles) -> None:
    runs = _residency_runs(instrs, params)
    # a ministage needed again before its prefetch could be posted simply stays resident
    spans: list[list[int]] = []          # [ms, prefetch position, start, end]
    latest: dict[int, list[int]] = {}
    for k, (ms, first, last) in enumerate(runs):
        post_at = min(runs[k - depth][1], first) if k >= depth else 0
        prev = latest.get(ms)
        if prev is not None and post_at <= prev[3]:
            prev[3] = max(prev[3], last)
            continue
        span = [ms, post_at, first, last]
        spans.append(span)
        latest[ms] = span
    compute = [i for i, instr in enumerate(instrs) if isinstance(instr, COMPUTE_TYPES)]
    for k, (ms, post_at, first, last) in enumerate(spans):
        h = handles.take()
        edits.add_before(post_at, Prefetch(Tensor.PARAMS, ms, None, h))
        edits.add_before(first, Wait(h))
        h_off = handles.take()
        changed = any(isinstance(i, Step) and i.ms == ms for i in instrs[first:last + 1])
        edits.add_after(last, Offload(Tensor.PARAMS, ms, None, h_off, host_current=not changed))
        # the device copy is released when the offload completes: wait one compute op later
        after = [i for i in compute if i > last][1:2]
        next_post = [s[1] for s in spans[k + 1:] if s[0] == ms][:1]   # where its next prefetch is posted
        wait_at = min([*after, *next_post], default=None)
        if wait_at is None:
            edits.end.append(Wait(h_off))
        else:
            edits.add_before(wait_at, Wait(h_off))


def _activations(instrs: tuple[Instr, ...], acts: set[int], edits: Edits, handles: Handles) -> None:
    compute = [(i, op) for i, op in enumerate(instrs) if isinstance(op, COMPUTE_TYPES)]
    where = {(type(op), op.ms, op.mb): k for k, (_, op) in enumerate(compute)}
    for k, (pos, op) in enumerate(compute):
        if not isinstance(op, Forward) or op.ms not in acts:
            continue
        back = where.get((Backward, op.ms, op.mb), where.get((BackwardInput, op.ms, op.mb)))
        if back is None or back <= k + 2:
            continue  # needed again within two ops: keep it on the device
        h_off = handles.take()
        edits.add_after(pos, Offload(Tensor.ACT, op.ms, op.mb, h_off))
        edits.add_after(compute[k + 1][0], Wait(h_off))
        h_in = handles.take()
        edits.add_before(compute[back - 1][0], Prefetch(Tensor.ACT, op.ms, op.mb, h_in))
        edits.add_before(compute[back][0], Wait(h_in))
