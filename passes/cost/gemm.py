"""Compute time of a layer by its matrix shapes, for a device kind without a profile (Note [GEMM curve]).

`layer_seconds` is what `compute.ComputeModel` times a layer with on the
analytic path of a device kind that declares its SM count (`DeviceSpec.sms`);
profiles override it there, and a kind without an SM count keeps the flat
FLOPs / (peak × efficiency). Nothing else times compute: explain, the planner
(through `passes/plan/primitives.py`'s Hardware) and the simulator all read `CostModel`'s layer
times, which come from `ComputeModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetc.passes.cost.shapes import LOGIT_BYTES, MASK_BYTES, LayerKind, layer_flops
from hetc.ir.spec import DTYPE_BYTES, Arch, AttentionKind, DeviceSpec, ModelSpec

__all__ = ["DeviceFacts", "Gemm", "attention_efficiency", "block_gemms", "dropout_bytes", "gemm_efficiency",
           "gemm_seconds", "head_gemms", "hidden_dropout_bytes", "layer_seconds"]

# Note [GEMM curve]
# A matrix multiply C[m, n] += A[m, k] · B[k, n] on a GPU runs as output tiles, one thread block each, in waves
# of one tile per SM (cuBLAS and CUTLASS kernels; NVIDIA's "Matrix Multiplication Background" guide names
# both effects). Its fraction of the dtype's peak is the product of
#   - the device's asymptote (`DeviceSpec.efficiency`): what the best-shaped large GEMMs reach, read from
#     public GEMM benchmarks (docs/costmodel.md "Compute time by shape" cites them);
#   - tile quantisation: m·n over the area of the ⌈m/tm⌉·⌈n/tn⌉ tiles that cover it;
#   - wave quantisation: tiles over ⌈tiles / SMs⌉·SMs, the last wave's idle SMs;
#   - the tile's own rate: smaller tiles reuse each loaded element less (TILES' third column).
# cuBLAS picks the tile per shape, so the curve takes the best of TILES. The result is capped by the
# roofline: a GEMM whose operands take longer to stream from HBM than its FLOPs take is memory-bound
# (small m: a micro-batch of a few tokens, or high TP). Attention's core (`ModelSpec.attention`) runs as flash
# attention, whose rate rises with the sequence (more key blocks per query block to amortise each block's
# softmax bookkeeping) and the head size (more FLOPs per element loaded): FlashAttention-2's published A100
# curves (Dao 2023, fig. 4-5) give the constants below; or unfused, as batched multiplies through the curve
# above and a softmax whose S² scores go through HBM. Norms, residual adds, RoPE, the FFN's activation and
# dropout (ModelSpec.hidden_dropout on the embedding's and each block's attention and MLP outputs; the unfused
# core's attention dropout on its probabilities) are memory-bound: their bytes at the streaming bandwidth
# (Note [streaming bandwidth] in compute.py), as are the roofline's. Flash attention's dropout runs inside
# its kernel, whose time here does not count it. The constants here are physics
# or read off public benchmarks, none fitted to a training run: docs/costmodel.md says which is which, and what
# the published runs (benchmarks/published_runs.py) showed.

# (tm, tn, rate relative to the largest tile): CUTLASS's SM80/SM90 tensor-op tile sizes, down to the skinny
# tiles cuBLAS takes for a few rows; the rate of a tile falls with its arithmetic intensity, tm·tn / (tm + tn)
# per k step (256×128: 85, 128×128: 64, 128×64: 43, 64×64: 32, 32×128: 26, 16×128: 14), taken as the square
# root of its ratio to the largest tile's (a tile's loads overlap its math in part).
TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.87), (128, 64, 0.71), (64, 128, 0.71), (64, 64, 0.61),
    (32, 128, 0.55), (128, 32, 0.55), (16, 128, 0.41), (128, 16, 0.41))
# Flash attention: its best fraction of the device's GEMM asymptote (FA2 forward, A100, head 128, long
# sequence: ~230 of 312 TFLOP/s against cuBLAS's ~268), the sequence and head size at which it reaches half of
# that, and its backward's rate relative to its forward (FA2: ~0.8).
FLASH_FRACTION = 0.86
FLASH_SEQ_HALF = 128
FLASH_HEAD_HALF = 16
FLASH_BACKWARD = 0.8
# A causal mask: flash attention skips the key blocks above the diagonal, about half the QKᵀ and AV FLOPs
# (shapes.layer_flops counts them unmasked).
CAUSAL_WORK = 0.5


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What the curve needs of a device kind for one dtype."""

    peak: float              # FLOP/s of the dtype that runs (PeakSpec.for_dtype)
    asymptote: float         # fraction of `peak` the best-shaped large GEMMs reach
    sms: int                 # streaming multiprocessors: one tile each per wave
    memory_bandwidth: float  # bytes/s memory-bound work streams at (compute.streaming_bandwidth)
    dtype_bytes: int

    @classmethod
    def of(cls, device: DeviceSpec, model: ModelSpec, memory_bandwidth: float) -> DeviceFacts:
        return cls(device.peak.for_dtype(model.dtype), device.efficiency, device.sms, memory_bandwidth,
                   DTYPE_BYTES[model.dtype])


@dataclass(frozen=True, slots=True)
class Gemm:
    """`count` alike multiplies of an [m, k] by a [k, n] matrix, in one batched (or grouped) kernel."""

    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def backward(self) -> tuple[Gemm, Gemm]:
        """(input-gradient, weight-gradient) multiplies: dA = dC·Bᵀ [m, k] over n, dB = Aᵀ·dC [k, n] over m."""
        return Gemm(self.m, self.k, self.n, self.count), Gemm(self.k, self.n, self.m, self.count)


def _tiled_fraction(m: int, n: int, sms: int, count: int) -> float:
    """The best tile's useful fraction of the SMs' time: tile and wave quantisation times the tile's rate. The
    `count` multiplies of a batched (or grouped) kernel share its waves."""
    best = 0.0
    for tm, tn, rate in TILES:
        waves = math.ceil(math.ceil(m / tm) * math.ceil(n / tn) * count / sms)
        best = max(best, rate * (m * n * count) / (waves * sms * tm * tn))   # useful area over the waves' area
    return best


def gemm_seconds(gemm: Gemm, facts: DeviceFacts) -> float:
    """The tiled compute time of `gemm`'s multiplies, or the memory roofline's where streaming their matrices
    takes longer (Note [GEMM curve])."""
    if gemm.flops == 0:
        return 0.0
    compute = gemm.flops / (facts.peak * facts.asymptote * _tiled_fraction(gemm.m, gemm.n, facts.sms, gemm.count))
    moved = (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n) * gemm.count * facts.dtype_bytes
    return max(compute, moved / facts.memory_bandwidth)


def gemm_efficiency(m: int, n: int, k: int, facts: DeviceFacts, count: int = 1) -> float:
    """Fraction of the peak `count` [m, k]·[k, n] multiplies in one kernel reach."""
    gemm = Gemm(m, n, k, count)
    return gemm.flops / facts.peak / gemm_seconds(gemm, facts)


def attention_efficiency(seq: int, head_dim: int, facts: DeviceFacts, backward: bool = False) -> float:
    """Fraction of the peak flash attention's forward (or backward) reaches at this sequence and head size."""
    rate = facts.asymptote * FLASH_FRACTION * seq / (seq + FLASH_SEQ_HALF) * head_dim / (head_dim + FLASH_HEAD_HALF)
    return rate * (FLASH_BACKWARD if backward else 1.0)


def block_gemms(model: ModelSpec, tokens: int, tp: int) -> list[Gemm]:
    """The forward multiplies of one block on one rank of a TP group of `tp` (Megatron's sharding: q/k/v and
    FFN-in by columns, out-proj and FFN-out by rows). MoE: each expert's share of the tokens' top-K visits."""
    h, d = model.hidden, model.head_size
    qkv = (model.heads + 2 * model.num_kv_heads) * d // tp
    ffn = model.ffn // tp
    ffn_in = 2 * ffn if model.arch is Arch.LLAMA else ffn    # SwiGLU's gate and up, fused
    attention = [Gemm(tokens, qkv, h), Gemm(tokens, h, model.heads * d // tp)]
    if model.moe is None:
        return attention + [Gemm(tokens, ffn_in, h), Gemm(tokens, h, ffn)]
    experts = model.moe.experts
    routed = max(1, round(tokens * model.moe.top_k / experts))
    return attention + [Gemm(tokens, experts, h), Gemm(routed, ffn_in, h, experts), Gemm(routed, h, ffn, experts)]


def head_gemms(model: ModelSpec, tokens: int, tp: int) -> list[Gemm]:
    """The output projection, vocabulary-parallel."""
    return [Gemm(tokens, math.ceil(model.vocab / tp), model.hidden)]


def _block_bytes(model: ModelSpec, tokens: int, tp: int) -> float:
    """Bytes a block's memory-bound work moves forward on one rank: two norms (in, out) and two residual adds
    (two in, one out) over the whole hidden state, RoPE on q and k (llama), the FFN's activation (SwiGLU: two
    in, one out; GELU: one in, one out) on this rank's slice."""
    h, ffn = model.hidden, model.ffn / tp
    elements = float(2 * 2 * h + 2 * 3 * h)
    if model.arch is Arch.LLAMA:
        elements += 2 * (model.heads + model.num_kv_heads) * model.head_size / tp + 3 * ffn
    else:
        elements += 2 * ffn
    return tokens * elements * DTYPE_BYTES[model.dtype]


def dropout_bytes(elements: float, dtype_bytes: int) -> float:
    """Bytes a dropout over `elements` values moves in each of its forward and backward (torch's native_dropout):
    forward reads the input and writes the output and the bool mask, backward reads the gradient and the mask and
    writes the input's gradient."""
    return elements * (2 * dtype_bytes + MASK_BYTES)


def hidden_dropout_bytes(model: ModelSpec, elements: float) -> float:
    """`dropout_bytes` of the model's hidden dropout over `elements` of the hidden state; none at 0 (no dropout
    runs)."""
    return dropout_bytes(elements, DTYPE_BYTES[model.dtype]) if model.hidden_dropout > 0 else 0.0


def _gemm_phases(gemms: list[Gemm], facts: DeviceFacts) -> tuple[float, float]:
    forward = sum(gemm_seconds(g, facts) for g in gemms)
    backward = sum(gemm_seconds(part, facts) for g in gemms for part in g.backward())
    return forward, backward


def layer_seconds(model: ModelSpec, kind: LayerKind, micro_batch: int, tp: int,
                  facts: DeviceFacts) -> tuple[float, float]:
    """(forward, backward) seconds of a block or the head on one rank of a TP group of `tp`, one microbatch."""
    tokens = micro_batch * model.seq
    if kind == LayerKind.HEAD:
        forward, backward = _gemm_phases(head_gemms(model, tokens, tp), facts)
        # the vocab-parallel cross-entropy over fp32 logits: written and read forward, read and its gradient
        # written backward
        logits = tokens * math.ceil(model.vocab / tp)
        forward += 2 * logits * LOGIT_BYTES / facts.memory_bandwidth
        backward += logits * (LOGIT_BYTES + facts.dtype_bytes) / facts.memory_bandwidth
        return forward, backward
    forward, backward = _gemm_phases(block_gemms(model, tokens, tp), facts)
    core_f, core_b = _attention_core(model, micro_batch, tp, facts)
    moved = _block_bytes(model, tokens, tp) / facts.memory_bandwidth
    # the dropouts on the attention and MLP outputs, over the whole hidden state as `_block_bytes` counts it; a
    # dropout's backward moves as many bytes as its forward
    dropped = hidden_dropout_bytes(model, 2 * tokens * model.hidden) / facts.memory_bandwidth
    return forward + core_f + moved + dropped, backward + core_b + 2 * moved + dropped


def _attention_core(model: ModelSpec, micro_batch: int, tp: int, facts: DeviceFacts) -> tuple[float, float]:
    """(forward, backward) seconds of QKᵀ, softmax and AV on one rank (its heads / tp)."""
    s, d = model.seq, model.head_size
    if model.attention is AttentionKind.UNFUSED:
        # QKᵀ [s, s] over d and AV [s, d] over s per head, all s² scores (no causal skip); the scaled, masked
        # softmax reads and writes the scores forward, and its backward reads P and dP and writes dS
        heads = micro_batch * model.heads // tp
        forward, backward = _gemm_phases([Gemm(s, s, d, heads), Gemm(s, d, s, heads)], facts)
        scores = heads * s * s
        moved = scores * facts.dtype_bytes / facts.memory_bandwidth
        # attention dropout on the probabilities before AV
        dropped = dropout_bytes(scores, facts.dtype_bytes) / facts.memory_bandwidth \
            if model.attention_dropout > 0 else 0.0
        return forward + 2 * moved + dropped, backward + 3 * moved + dropped
    # flash attention's dropout (SDPA's dropout_p) runs inside the kernel, its mask redrawn in backward from the
    # RNG seed: what it costs there is not counted
    core = layer_flops(model, 1, micro_batch).attention / tp * CAUSAL_WORK
    return (core / (facts.peak * attention_efficiency(s, d, facts)),
            2 * core / (facts.peak * attention_efficiency(s, d, facts, backward=True)))
