"""fp16's dynamic loss scale: the loss is multiplied by S before backward, so that small gradients stay above
fp16's smallest normal number, and S follows the overflows (Note [dynamic loss scale]).

Note [dynamic loss scale]
~~~~~~~~~~~~~~~~~~~~~~~~~
fp16 holds magnitudes from 6e-5 (normal; 6e-8 subnormal) to 65504: a gradient below that flushes to zero,
one above overflows to infinity. As Megatron-LM's DynamicGradScaler and DeepSpeed's fp16 loss scaler do,
each backward is seeded with S times the loss, every gradient (the boundary gradients between stages, the
reduced gradients of every rank) is then S times the true one, and the optimizer step unscales by 1/S
together with the clipping coefficient. An overflow anywhere shows as a non-finite global gradient norm,
which every rank reads from the same all-reduce (the norm's, lowered under clipping: hence fp16 needs
grad_clip); then every rank skips the update and the scaler backs off, the same on every rank. That rests
on an all-reduce delivering the same bits to every member, as NCCL's and gloo's do (each piece of the
result is reduced once, then copied to every rank), so no rank can decide otherwise and leave the others
waiting in a collective. The rule (`LossScaler.update`) is Megatron-LM's: an overflow resets the count of good steps and spends one of
`hysteresis`; once none is left each overflow halves S (never below `min`); `window` good steps in a row
double S and restore the hysteresis. With hysteresis 1 it is torch.amp.GradScaler's rule.

The state (S, the good steps, the hysteresis left) is saved in every checkpoint (runtime/checkpoint.py), so
a resumed run scales its next step as the uninterrupted one would. A skipped step is not an update: the
learning-rate schedule and Adam's step count stay where they were, as Megatron-LM's and DeepSpeed's do (Note
[skipped updates] in runtime/optim.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetc.ir.spec import LossScaleSpec

__all__ = ["LossScaler"]


@dataclass
class LossScaler:
    """The scale and its counters; `update` after every step's overflow check."""

    spec: LossScaleSpec
    scale: float
    good_steps: int = 0         # steps without overflow since the last overflow or growth
    hysteresis_left: int = 0

    @classmethod
    def start(cls, spec: LossScaleSpec) -> LossScaler:
        return cls(spec, spec.initial, 0, spec.hysteresis)

    def update(self, overflow: bool) -> None:
        """Megatron-LM's DynamicGradScaler rule (Note [dynamic loss scale])."""
        if overflow:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2, self.spec.min)
            return
        self.good_steps += 1
        if self.good_steps == self.spec.window:
            self.good_steps = 0
            self.hysteresis_left = self.spec.hysteresis
            self.scale *= 2

    def state(self) -> tuple[float, int, int]:
        """What a checkpoint keeps."""
        return self.scale, self.good_steps, self.hysteresis_left

    def restore(self, state: tuple[float, int, int]) -> None:
        self.scale, self.good_steps, self.hysteresis_left = float(state[0]), int(state[1]), int(state[2])
