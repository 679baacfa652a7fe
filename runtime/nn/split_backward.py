"""Zero-bubble backward: the input gradient now (I), the weight gradient later (W).

torch.distributed.pipelining already splits an autograd graph this way
(`stage_backward_input` keeps the intermediates the weight gradient needs,
`stage_backward_weight` finishes it), so we use it rather than re-derive it.
A ministage that starts at the embedding has no input gradient: its I does
nothing and its W runs the whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["DeferredWeightGrad", "backward_input", "backward_weight"]


@dataclass
class DeferredWeightGrad:
    """What W needs: torch's saved parameter groups, or the whole graph when I had nothing to do."""

    param_groups: list | None = None
    output: Tensor | None = None
    output_grad: Tensor | None = None


def backward_input(out: Tensor, grad: Tensor | None, x: Tensor, module: nn.Module) -> DeferredWeightGrad:
    """Fill `x.grad` (when x requires grad); return what `backward_weight` needs."""
    if not x.requires_grad:
        return DeferredWeightGrad(output=out, output_grad=grad)
    # imported here: torch.distributed.pipelining costs every rank about a second to import, and only
    # zero-bubble schedules split a backward
    from torch.distributed.pipelining._backward import stage_backward_input

    grads, param_groups = stage_backward_input([out], None if grad is None else [grad], [x],
                                               iter(module.parameters()))
    x.grad = grads[0]
    return DeferredWeightGrad(param_groups=param_groups)


def backward_weight(module: nn.Module, deferred: DeferredWeightGrad) -> None:
    """Accumulate the weight gradients into the parameters' (flat-buffer) `.grad` (where the buffer is in
    another dtype, `.grad` of their own, for `fold_main_grads` to add: Note [main gradients] in runtime/flat.py).

    Runs with grad mode on: torch finds each weight's gradient accumulator
    through a view, which no-grad mode would not record.
    """
    if deferred.param_groups is None:
        assert deferred.output is not None   # backward_input kept the graph when it saved no groups
        torch.autograd.backward(deferred.output, deferred.output_grad)
        return
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(iter(module.parameters()), deferred.param_groups)
