"""Measured numbers the cost model prefers over datasheet arithmetic.

`Profiles` gathers what `hetc profile` measured and what Sailor and Zorse
published (see `load_profiles`): per-layer forward/backward times
(`ComputeTable`, one per device kind, model shape, dtype and sequence
length), link bandwidth models and host<->device copy rates.

Per-layer times are kept as a line in the micro-batch size, t(b) = c + k·b,
fitted to the measured points with relative weights (every point counts by
its relative error). Zorse publishes exactly such fits; for Sailor's raw
points the fit smooths measurement noise at small micro-batches, where the
GPU is launch-bound and single points are unreliable (a point slower than a
larger micro-batch is not physical).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hetc.passes.cost.cores import CoreWait
from hetc.passes.cost.network import Bandwidth
from hetc.ir.program import Phase
from hetc.ir.spec import DTYPE_BYTES, DType

__all__ = [
    "LAYER_SLOTS",
    "ComputeTable",
    "LinearFit",
    "NetworkFits",
    "ProfileError",
    "Profiles",
    "Rejected",
    "dtype_class",
    "fit_line",
]


LAYER_SLOTS = ("embed", "block", "head")
# Two models' blocks are "the same shape" for timing when their parameter counts agree this well.
SHAPE_TOLERANCE = 0.01


class ProfileError(ValueError):
    """A profile file or data directory that cannot be read.

    `file`: the file the problem is in, when it is one file's (the CLI
    locates the message there); `message` is then the message without it.
    """

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(message if file is None else f"{file}: {message}")
        self.message, self.file = message, file


def dtype_class(dtype: DType | str) -> str:
    """The speed class a measurement applies to: 16-bit formats (bf16, fp16) run at the same speed.

    Profiles keep the dtype they were measured in (`ComputeTable.dtype`) and
    are matched to a model by class, so a bf16 profile times a bf16, fp16 or
    fp8 model (fp8 runs as bf16: Note [Precision that runs] in hetc/ir/spec.py),
    never an fp32 one. fp32 and tf32 are apart: the runtime runs a tf32
    model's matmuls on TF32 tensor cores and an fp32 model's without them.
    """
    return DType(dtype).value if DTYPE_BYTES[DType(dtype)] == 4 else "fp16"


@dataclass(frozen=True, slots=True)
class LinearFit:
    """Seconds for micro-batch size b: intercept + slope·b (never negative)."""

    intercept: float
    slope: float

    def __call__(self, b: float) -> float:
        return max(self.intercept + self.slope * b, 0.0)


def fit_line(points: list[tuple[float, float]]) -> LinearFit:
    """Least squares in relative error over (micro_batch, seconds) points."""
    pts = [(float(b), float(t)) for b, t in points if t > 0]
    if not pts:
        return LinearFit(0.0, 0.0)
    if len({b for b, _ in pts}) == 1:
        b0, t0 = pts[0]
        return LinearFit(0.0, t0 / b0)  # one size measured: proportional in b
    b = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    w = 1.0 / t
    design = np.vstack([np.ones_like(b), b]).T * w[:, None]
    (c, k), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if k < 0:  # time cannot fall as work grows: fall back to the mean per-sample time
        return LinearFit(0.0, float(np.mean(t / b)))
    return LinearFit(float(c), float(k))


@dataclass(frozen=True)
class ComputeTable:
    """Per-layer times of one model shape on one device kind, at one dtype and sequence length.

    `fits[(slot, tp, phase)]` with slot in embed/block/head and phase F or B
    (the whole backward). `layers` is the number of blocks measured with, if
    known (Sailor profiles cover a whole model).
    """

    source: str
    device: str
    hidden: int
    block_params: int
    seq: int
    dtype: str          # a DType name: what it was measured in (compared by `dtype_class`)
    fits: dict[tuple[str, int, Phase], LinearFit]
    vocab: int | None = None
    layers: int | None = None
    model_name: str = ""

    @property
    def tps(self) -> tuple[int, ...]:
        return tuple(sorted({tp for _, tp, _ in self.fits}))

    def time(self, slot: str, tp: int, phase: Phase, micro_batch: float) -> float | None:
        fit = self.fits.get((slot, tp, phase))
        return None if fit is None else fit(micro_batch)

    def same_shape(self, hidden: int, block_params: int) -> bool:
        return self.hidden == hidden and abs(self.block_params - block_params) <= SHAPE_TOLERANCE * block_params

    def matches(self, hidden: int, block_params: int, dtype: DType | str) -> bool:
        return self.same_shape(hidden, block_params) and dtype_class(self.dtype) == dtype_class(dtype)


@dataclass(frozen=True)
class NetworkFits:
    """Link bandwidths by device kind, zone and number of GPUs per node that send at once.

    `intra[(device, ring_size)]`: one ring step between GPUs of a node.
    `inter[(zone, device, count, zone, device, count)]`: the aggregate rate
    of `count` GPUs of one node sending to a node of the other kind.
    """

    intra: dict[tuple[str, int], Bandwidth] = field(default_factory=dict)
    inter: dict[tuple[str, str, int, str, str, int], Bandwidth] = field(default_factory=dict)
    inter_any_zone: dict[tuple[str, int], Bandwidth] = field(default_factory=dict)

    def intra_rate(self, device: str, ring_size: int) -> Bandwidth | None:
        counts = sorted(c for d, c in self.intra if d == device)
        return self.intra[(device, _at_least(counts, ring_size))] if counts else None

    def inter_rate(self, zone_a: str, dev_a: str, zone_b: str, dev_b: str, count: int) -> Bandwidth | None:
        pairs = {(k[2], k[5]): v for k, v in self.inter.items()
                 if k[0] == zone_a and k[1] == dev_a and k[3] == zone_b and k[4] == dev_b}
        if pairs:
            c = _at_least(sorted({a for a, _ in pairs}), count)
            return pairs.get((c, c)) or next(v for (a, _), v in sorted(pairs.items()) if a == c)
        if dev_a == dev_b:
            counts = sorted(c for d, c in self.inter_any_zone if d == dev_a)
            if counts:
                return self.inter_any_zone[(dev_a, _at_least(counts, count))]
        return None

    def merged(self, other: NetworkFits) -> NetworkFits:
        return NetworkFits({**self.intra, **other.intra}, {**self.inter, **other.inter},
                           {**self.inter_any_zone, **other.inter_any_zone})


def _at_least(counts: list[int], want: int) -> int:
    """The smallest measured count that covers `want`, else the largest measured."""
    return next((c for c in counts if c >= want), counts[-1])


@dataclass(frozen=True, slots=True)
class Rejected:
    """A measurement a data folder holds for `model` that cannot be used at all, and why."""

    model: str
    where: str    # the file (and entry) it is in
    why: str


@dataclass(frozen=True)
class Profiles:
    """Everything measured, from every source given."""

    compute: tuple[ComputeTable, ...] = ()
    network: NetworkFits = field(default_factory=NetworkFits)
    copy: dict[str, float] = field(default_factory=dict)         # device kind -> host<->device bytes/s
    copy_sources: dict[str, str] = field(default_factory=dict)   # device kind -> where `copy` was measured
    # device kind -> seconds a stage spends per microbatch outside its layers (the engine's
    # dispatch, device synchronizations, loss glue): measured, never assumed
    overhead: dict[str, float] = field(default_factory=dict)
    rejected: tuple[Rejected, ...] = ()   # measurements read but unusable, each with why
    sources: tuple[str, ...] = ()
    # device kind -> (ranks timed at once, how many times slower each ran than alone): Note [shared cores]
    shared: dict[str, tuple[int, float]] = field(default_factory=dict)
    # device kind -> a blocking call's measured wait for a core where ranks outnumber cores: Note [core wait]
    core_wait: dict[str, CoreWait] = field(default_factory=dict)

    def rejected_for(self, model: str) -> tuple[Rejected, ...]:
        return tuple(r for r in self.rejected if r.model == model)

    def tables(self, device: str) -> list[ComputeTable]:
        return [t for t in self.compute if t.device == device]

    def merged(self, other: Profiles) -> Profiles:
        return Profiles(self.compute + other.compute, self.network.merged(other.network),
                        {**self.copy, **other.copy}, {**self.copy_sources, **other.copy_sources},
                        {**self.overhead, **other.overhead}, self.rejected + other.rejected,
                        self.sources + other.sources, {**self.shared, **other.shared},
                        {**self.core_wait, **other.core_wait})

    @property
    def empty(self) -> bool:
        return not (self.compute or self.network.intra or self.network.inter or self.copy or self.overhead)
