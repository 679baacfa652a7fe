"""The model's dtype against the device kinds of its cluster: Note [Precision that runs] in hetc/ir/spec.py.

A dtype a kind does not list in its peak block is costed at that kind's
fp32 rate (the planner can still mix kinds), except fp8: a spec asking for
fp8 on a kind without fp8 units (an A100) is refused, since no fp8 path
could ever run there.
"""

from __future__ import annotations

from hetc.ir.errors import Diagnostic
from hetc.ir.spec import DType, NodeSpec, Spec

__all__ = ["check_precision"]


def check_precision(spec: Spec, errors: list[Diagnostic]) -> None:
    """One located error (at the model's dtype) per device kind of the cluster that cannot run an fp8 model."""
    model, cluster = spec.model, spec.cluster
    if model is None or cluster is None or model.dtype is not DType.FP8:
        return
    for kind, group in _first_group_of_each_kind(cluster.nodes).items():
        device = spec.device(kind)
        if device is None or device.runs(DType.FP8):   # an unknown kind is reported by the cluster check
            continue
        runs = ", ".join(dtype.value for dtype in device.peak.listed())
        errors.append(Diagnostic(
            model.span_of("dtype"),
            f"dtype = fp8, but device kind '{kind}' has no fp8 units (its peak lists {runs}); "
            f"use dtype = {_suggestion(device.peak.listed())}",
            notes=((group.span_of("device"), f"node group '{group.name}' is made of {kind}"),)))


def _first_group_of_each_kind(groups: tuple[NodeSpec, ...]) -> dict[str, NodeSpec]:
    first: dict[str, NodeSpec] = {}
    for group in groups:
        first.setdefault(group.device, group)
    return first


def _suggestion(listed: tuple[DType, ...]) -> str:
    """bf16 where the kind has it (what hetc runs an fp8 model in today), else fp32."""
    return DType.BF16.value if DType.BF16 in listed else DType.FP32.value
