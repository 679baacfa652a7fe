"""Per-layer compute time: measured where a profile covers it, arithmetic otherwise.

For one layer kind (embed, block, head) on one device kind, in order:

1. a profile of this model shape on this device (same dtype speed class, `dtype_class`; the nearest
   sequence length, scaled by the FLOPs ratio). A missing TP degree comes
   from tp = 1 divided by tp (the caller adds the TP all-reduces). A layer
   kind the profile lacks (Zorse measures blocks only) is timed at the
   FLOP rate the profile's block reached.
2. a profile of this model on another device kind, scaled by the speed
   ratio of the two devices measured on a reference model profiled on both
   (same dtype, sequence, micro-batch and TP); the other device is the one
   whose datasheet peak is closest to this device's.
3. arithmetic from the DeviceSpec: by each matrix multiply's shape where it gives its SM count (gemm.py,
   Note [GEMM curve]), else FLOPs / (peak(dtype) × efficiency).

Times are for one microbatch on one rank of a lane of tp × cp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from hetc.passes.cost.gemm import DeviceFacts, hidden_dropout_bytes, layer_seconds
from hetc.passes.cost.profiles import ComputeTable, Profiles, dtype_class
from hetc.passes.cost.shapes import LayerKind, layer_flops
from hetc.passes.cost.params import block_params
from hetc.ir.program import Phase
from hetc.ir.spec import DTYPE_BYTES, DeviceSpec, ModelSpec

__all__ = ["ComputeModel", "CostError", "LayerCost", "LayerTime", "dtype_class", "streaming_bandwidth"]

# Bandwidth assumed for memory-bound work when a device declares none (a mid-range GPU's datasheet).
DEFAULT_MEMORY_BANDWIDTH = 500e9

# Note [streaming bandwidth]
# `DeviceSpec.memory_bandwidth` is the datasheet's HBM rate, which no kernel reaches: the best streaming
# kernels move 0.88-0.92 of it (A100-80GB SXM: 1.80 of 2.04 TB/s under Nsight Compute, about 90 % the most
# any kernel reached in NVIDIA's own GTC measurements; H100 SXM: STREAM triad 3.08 of 3.35 TB/s). Every
# memory-bound part of a step (norms, activations, dropout, residual adds, the unfused softmax, the
# embedding's gather and scatter, small GEMMs on the roofline, the optimizer step) streams at
# STREAM_FRACTION of the datasheet: the middle of those measurements, read from them, not fitted to a run.
STREAM_FRACTION = 0.9


def streaming_bandwidth(device: DeviceSpec) -> float:
    """Bytes/s the memory-bound work of a step moves on `device` (Note [streaming bandwidth])."""
    return STREAM_FRACTION * (device.memory_bandwidth or DEFAULT_MEMORY_BANDWIDTH)


class CostError(ValueError):
    """The plan cannot be costed (a device kind with neither a peak nor a profile)."""

    def __init__(self, message: str, device: str | None = None):
        super().__init__(message)
        self.device = device   # the device kind to blame, for a located error


@dataclass(frozen=True, slots=True)
class LayerTime:
    forward: float
    backward: float     # input-grad + weight-grad
    needs_tp_comm: bool  # True when the TP all-reduces are not inside the measured time
    source: str


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer on one rank for one microbatch: forward, input-grad, weight-grad seconds, its
    communication and recomputation included (`CostModel.layer_cost`); `forward_comm` and
    `input_grad_comm` are the communication inside forward and input-grad (the weight-grad has none)."""

    forward: float
    input_grad: float
    weight_grad: float
    forward_comm: float = 0.0
    input_grad_comm: float = 0.0

    def phase(self, phase: Phase, slowdown: float = 1.0) -> float:
        """F, I, W, or B = I + W, on a rank that computes `slowdown` times slower for sharing its cores
        (Note [shared cores]): the work stretches; the communication, timed at the link's rate and with its
        wait for a core already under that load (Note [core wait]), does not."""
        whole = self.input_grad + self.weight_grad if phase == Phase.BACKWARD else \
            {Phase.FORWARD: self.forward, Phase.INPUT_GRAD: self.input_grad, Phase.WEIGHT_GRAD: self.weight_grad}[phase]
        if slowdown == 1.0:
            return whole
        comm = {Phase.FORWARD: self.forward_comm, Phase.INPUT_GRAD: self.input_grad_comm,
                Phase.WEIGHT_GRAD: 0.0, Phase.BACKWARD: self.input_grad_comm}[phase]
        return (whole - comm) * slowdown + comm


class ComputeModel:
    """Times layers of `model` on device kinds, from `profiles` where they apply."""

    def __init__(self, model: ModelSpec, profiles: Profiles, devices: dict[str, DeviceSpec]):
        self.model = model
        self.profiles = profiles
        self.devices = devices
        self._dtype = model.dtype
        self._block_params = block_params(model)
        self.layer = lru_cache(maxsize=None)(self._layer)

    # ------------------------------------------------------------ lookup

    def _layer(self, device: str, kind: LayerKind, micro_batch: int, tp: int) -> LayerTime:
        for table in self._tables_of(device):
            got = self._from_table(table, kind, micro_batch, tp)
            if got is not None:
                return got
        got = self._transferred(device, kind, micro_batch, tp)
        if got is not None:
            return got
        return self._analytic(device, kind, micro_batch, tp)

    def _tables_of(self, device: str) -> list[ComputeTable]:
        """Tables of this model's shape on `device`, nearest sequence length first."""
        tables = [t for t in self.profiles.tables(device)
                  if t.matches(self.model.hidden, self._block_params, self._dtype)]
        return sorted(tables, key=lambda t: (abs(math.log(t.seq / self.model.seq)), t.source))

    def _seq_scale(self, table: ComputeTable, kind: LayerKind) -> float:
        if table.seq == self.model.seq:
            return 1.0
        idx = _index_of(self.model, kind)
        there = layer_flops(self.model, idx, 1, table.seq).forward
        return layer_flops(self.model, idx, 1).forward / there if there else 1.0

    def _from_table(self, table: ComputeTable, kind: LayerKind, micro_batch: int, tp: int) -> LayerTime | None:
        has_kind = any(k[0] == kind for k in table.fits)
        if kind != LayerKind.BLOCK and (not has_kind or table.vocab not in (None, self.model.vocab)):
            return self._at_block_rate(table, kind, micro_batch, tp)
        if not has_kind:
            return None
        scale = self._seq_scale(table, kind)
        if tp in table.tps:
            f, b = table.time(kind, tp, Phase.FORWARD, micro_batch), table.time(kind, tp, Phase.BACKWARD, micro_batch)
            if f is not None and b is not None:
                return LayerTime(f * scale, b * scale, False, table.source)
        # tp = 1 divided by tp, the caller adding the all-reduces; else the nearest measured degree,
        # whose time already holds all-reduces of about the same size
        base = 1 if 1 in table.tps else min(table.tps, key=lambda t: (abs(math.log(t / tp)), t))
        f, b = table.time(kind, base, Phase.FORWARD, micro_batch), table.time(kind, base, Phase.BACKWARD, micro_batch)
        if f is None or b is None:
            return None
        ratio = scale * base / tp
        return LayerTime(f * ratio, b * ratio, kind == LayerKind.BLOCK and base == 1 and tp > 1,
                         f"{table.source} (tp {base} scaled to {tp})")

    def _at_block_rate(self, table: ComputeTable, kind: LayerKind, micro_batch: int, tp: int) -> LayerTime | None:
        """Time a layer the table lacks at the FLOP rate its block reached."""
        block = self._from_table(table, LayerKind.BLOCK, micro_batch, 1)
        if block is None:
            return None
        flops = layer_flops(self.model, 1, micro_batch)
        rate_f = flops.forward / block.forward if block.forward else None
        rate_b = flops.backward / block.backward if block.backward else None
        own = layer_flops(self.model, _index_of(self.model, kind), micro_batch)
        if not rate_f or not rate_b or own.forward == 0:
            return None
        # the head is vocabulary-parallel: each TP rank does 1/tp of it
        return LayerTime(own.forward / rate_f / tp, own.backward / rate_b / tp, False,
                         f"{table.source} (block FLOP rate)")

    def _transferred(self, device: str, kind: LayerKind, micro_batch: int, tp: int) -> LayerTime | None:
        target = self.devices.get(device)
        if target is None:
            return None
        others = {t.device for t in self.profiles.compute if t.device != device
                  and t.matches(self.model.hidden, self._block_params, self._dtype)}
        for other in sorted(others, key=lambda d: (self._peak_distance(target, d), d)):
            found = (self._from_table(t, kind, micro_batch, tp) for t in self._tables_of(other))
            theirs = next((x for x in found if x is not None), None)
            ratio = self._speed_ratio(device, other, micro_batch, tp)
            if theirs is not None and ratio is not None and not theirs.needs_tp_comm:
                return LayerTime(theirs.forward * ratio[0], theirs.backward * ratio[1], False,
                                 f"{theirs.source} × {device}/{other} speed ratio")
        return None


    def _peak_distance(self, target: DeviceSpec, other: str) -> float:
        spec = self.devices.get(other) or _catalog().get(other)
        if spec is None:
            return math.inf
        a, b = target.peak.for_dtype(self.model.dtype), spec.peak.for_dtype(self.model.dtype)
        return abs(math.log(a / b)) if a > 0 and b > 0 else math.inf

    def _speed_ratio(self, device: str, other: str, micro_batch: int, tp: int) -> tuple[float, float] | None:
        """(forward, backward) time ratio device/other on a reference model profiled on both."""
        for mine in self.profiles.tables(device):
            if dtype_class(mine.dtype) != dtype_class(self._dtype) or tp not in mine.tps:
                continue
            for theirs in self.profiles.tables(other):
                if (theirs.hidden, theirs.block_params, theirs.seq, dtype_class(theirs.dtype)) != \
                        (mine.hidden, mine.block_params, mine.seq, dtype_class(mine.dtype)) or tp not in theirs.tps:
                    continue
                fa, ba = (mine.time(LayerKind.BLOCK, tp, p, micro_batch) for p in (Phase.FORWARD, Phase.BACKWARD))
                fb, bb = (theirs.time(LayerKind.BLOCK, tp, p, micro_batch) for p in (Phase.FORWARD, Phase.BACKWARD))
                if fa and ba and fb and bb:
                    return fa / fb, ba / bb
        return None

    def _analytic(self, device: str, kind: LayerKind, micro_batch: int, tp: int) -> LayerTime:
        spec = self.devices[device]
        rate = spec.peak.for_dtype(self.model.dtype) * spec.efficiency
        if kind == LayerKind.EMBED:
            # gather rows forward, scatter-add gradients backward, and the hidden dropout on the output (as many
            # bytes each pass): memory-bound, whether or not the kind names its SMs
            hidden = micro_batch * self.model.seq * self.model.hidden
            moved = 2.0 * hidden * DTYPE_BYTES[self.model.dtype] + hidden_dropout_bytes(self.model, hidden)
            bw = streaming_bandwidth(spec)
            return LayerTime(moved / bw, moved / bw, False, "arithmetic")
        if rate <= 0:
            # a peak for other dtypes does not time this one (Note [Precision that runs] in hetc/ir/spec.py)
            others = " (a dtype it does not list runs at its fp32 peak, which it lacks too)" \
                if spec.peak.listed() else ""
            raise CostError(f"device kind '{device}' declares no peak FLOP/s for {self.model.dtype.value}{others} "
                            "and no profile times it; add a peak { ... } block or a profile (hetc profile)", device)
        tp_comm = kind == LayerKind.BLOCK and tp > 1
        if spec.sms > 0:
            # by each matrix multiply's shape on this many SMs (Note [GEMM curve] in gemm.py)
            facts = DeviceFacts.of(spec, self.model, streaming_bandwidth(spec))
            forward, backward = layer_seconds(self.model, kind, micro_batch, tp, facts)
            return LayerTime(forward, backward, tp_comm, "arithmetic")
        flops = layer_flops(self.model, _index_of(self.model, kind), micro_batch)
        share = tp  # blocks are sharded, the head vocabulary-parallel
        return LayerTime(flops.forward / rate / share, flops.backward / rate / share, tp_comm, "arithmetic")


@lru_cache(maxsize=1)
def _catalog() -> dict[str, DeviceSpec]:
    """The bundled catalog's device kinds: datasheet peaks of devices a spec does not declare."""
    from hetc.frontend.load import BUNDLED_SPECS, load_spec

    return {d.name: d for d in load_spec(BUNDLED_SPECS / "catalog.het").spec.devices}


def _index_of(model: ModelSpec, kind: LayerKind) -> int:
    return {LayerKind.EMBED: 0, LayerKind.BLOCK: 1, LayerKind.HEAD: model.layers + 1}[kind]

