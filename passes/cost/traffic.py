"""Bytes each rank sends per step, per kind of parallelism (survey II.II, DESIGN.md §3).

The survey states volumes for large groups; here every collective carries
its exact ring factor (n−1)/n, so a group of one sends nothing:

- ZeRO-0/1/2: 2δΦ per step (all-reduce, or reduce-scatter + all-gather).
  ZeRO-2 under gradient accumulation in a pipeline reduce-scatters every
  microbatch (DeepSpeed): m·δΦ + δΦ. Zorse reduces once per ministage: 2δΦ.
- ZeRO-3: 3δΦ (gather forward, gather backward, reduce-scatter); a plain
  pipeline gathers and reduces per microbatch: 3δΦ·m; Zorse once per ministage.
- PP: δ·b·S·H per border, per direction, per microbatch, times the N_rep of
  the receiving side (every tp rank without sequence parallelism holds the
  whole sequence, so each gets it; with Megatron-SP each gets its part).
- TP: an all-reduce of δbSH after attention and after the FFN, forward and
  backward: 4 all-reduces, 8δbSH per layer (4δbSH per sub-block).
- Ulysses: 4(N_kv/N_q + 1)·δbSH / N_SP per layer; ring attention
  6(N_kv/N_q)·δbSH; expert parallelism 4·K·δbSH per MoE layer.
"""

from __future__ import annotations

from hetc.ir.spec import ScheduleKind
from hetc.ir.program import Collective
from hetc.passes.cost.memory import StateBytes

__all__ = ["all_reduce_bytes", "ep_bytes", "gather_bytes", "pp_bytes", "ring_attention_bytes", "tp_bytes", "ulysses_bytes", "zero_bytes"]


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def zero_bytes(level: int, schedule: ScheduleKind, param_bytes: float, group: int,
               microbatches: int, states: StateBytes) -> float:
    """Per rank per step for a ZeRO group of `group` ranks over `param_bytes` (δΦ, this rank's TP shard):
    gathers move parameters, reductions gradients (`StateBytes.collective`)."""
    gather = _ring(group) * states.collective(Collective.ALL_GATHER, param_bytes)
    reduce = _ring(group) * states.collective(Collective.REDUCE_SCATTER, param_bytes)
    per_microbatch = microbatches if schedule is not ScheduleKind.ZORSE else 1
    if level <= 1:
        return reduce + gather
    if level == 2:
        return reduce * per_microbatch + gather
    return (2 * gather + reduce) * per_microbatch


def pp_bytes(micro_batch: int, seq: int, hidden: int, delta: int, microbatches: int,
             replicas: tuple[int, int] = (1, 1)) -> float:
    """Per border per step: one activation forward and one gradient back per microbatch, to each of
    `replicas` = (N_rep after the border, N_rep before it) copies (hetc.ir.layout.replication)."""
    return float(sum(replicas)) * delta * micro_batch * seq * hidden * microbatches


def gather_bytes(ranks: int, nbytes: float) -> float:
    """Per rank: an all-gather of a tensor of `nbytes` over `ranks` (a ring: (N−1)/N of it)."""
    return _ring(ranks) * nbytes


def all_reduce_bytes(ranks: int, nbytes: float) -> float:
    """Per rank: an all-reduce of a tensor of `nbytes` over `ranks` (a ring: a reduce-scatter and an all-gather,
    2(N−1)/N of it)."""
    return 2 * _ring(ranks) * nbytes


def tp_bytes(tp: int, micro_batch: int, seq: int, hidden: int, delta: int) -> float:
    """Per rank per transformer layer per microbatch: four all-reduces of δbSH."""
    return 4 * 2 * _ring(tp) * delta * micro_batch * seq * hidden


def ulysses_bytes(sp: int, kv_heads: int, heads: int, micro_batch: int, seq: int, hidden: int,
                  delta: int) -> float:
    """Per rank per layer per microbatch: q/k/v in and the output back, forward and backward."""
    return 4 * (kv_heads / heads + 1) * delta * micro_batch * seq * hidden / max(sp, 1) * _ring(sp)


def ring_attention_bytes(cp: int, kv_heads: int, heads: int, micro_batch: int, seq: int, hidden: int,
                         delta: int) -> float:
    return 6 * (kv_heads / heads) * delta * micro_batch * seq * hidden * _ring(cp)


def ep_bytes(ep: int, top_k: int, micro_batch: int, seq: int, hidden: int, delta: int) -> float:
    """Per rank per MoE layer per microbatch: dispatch and combine of the top-k copies, forward and backward."""
    return 4 * top_k * delta * micro_batch * seq * hidden * _ring(ep)
