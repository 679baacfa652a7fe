"""Flat parameter buffers: the unit ZeRO shards, gathers and steps.

One flat buffer per ministage (two under expert parallelism: its dense
and its expert parameters, each laid out alone). Parameters are laid out in `named_parameters`
order (fixed by the model code, independent of the plan), then padded to a
multiple of the shard-group size so every shard is the same contiguous
slice `[i * shard_numel, (i + 1) * shard_numel)`. The module's parameters
and gradients become views into the buffers, so an all-gather into the
compute buffer updates the module and backward accumulates straight into
the grad buffer (ready for all-reduce / reduce-scatter without a copy).

Padding is zero in parameters and gradients; AdamW and SGD keep it zero.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hetc.ir.errors import InternalError

__all__ = ["FlatEntry", "FlatLayout", "FlatParams", "bind_grads", "bind_params", "fold_main_grads"]


@dataclass(frozen=True, slots=True)
class FlatEntry:
    """Where one parameter lives in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    def overlap(self, rng: slice) -> tuple[int, int]:
        """The flat elements [a, b) of this parameter inside `rng` (a >= b: none)."""
        return max(self.offset, rng.start), min(self.offset + self.numel, rng.stop)


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """The flat layout of one module's parameters, padded for `num_shards` equal shards."""

    entries: tuple[FlatEntry, ...]
    numel: int          # sum of the parameters' sizes
    padded_numel: int   # numel rounded up to a multiple of num_shards
    num_shards: int

    @classmethod
    def of(cls, module: nn.Module, num_shards: int = 1, names: Collection[str] | None = None) -> FlatLayout:
        """The layout of `module`'s parameters (shared ones once, under their first name); with `names`,
        of those parameters only (a ministage whose expert parameters have a buffer of their own)."""
        if num_shards < 1:
            raise InternalError(f"a layout needs a shard, not {num_shards}")
        entries, offset = [], 0
        for name, p in module.named_parameters():
            if names is not None and name not in names:
                continue
            entries.append(FlatEntry(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        padded = -(-offset // num_shards) * num_shards
        return cls(tuple(entries), offset, padded, num_shards)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def shard_range(self, shard: int) -> slice:
        """The elements of shard `shard` in the flat buffer."""
        if not 0 <= shard < self.num_shards:
            raise InternalError(f"shard {shard} of {self.num_shards}")
        return slice(shard * self.shard_numel, (shard + 1) * self.shard_numel)

    def overlaps(self, rng: slice) -> Iterator[tuple[FlatEntry, int, int]]:
        """Each parameter with elements inside `rng`, and those elements [start, stop) of the flat buffer."""
        for e in self.entries:
            start, stop = e.overlap(rng)
            if start < stop:
                yield e, start, stop

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """Each parameter's view into a full flat buffer, by name."""
        if flat.numel() != self.padded_numel:
            raise InternalError(f"buffer of {flat.numel()} for layout of {self.padded_numel}")
        return {e.name: flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries}

    def matrix_spans(self, rng: slice) -> tuple[slice, ...]:
        """The elements of `rng` (as slices of it) that belong to parameters of two or more dimensions: what
        Megatron-LM and Hugging Face's Trainer decay, leaving norms' weights, biases (and padding) alone."""
        return tuple(slice(start - rng.start, stop - rng.start)
                     for e, start, stop in self.overlaps(rng) if len(e.shape) >= 2)

    def pieces(self, shard: int) -> list[tuple[str, int, int, int]]:
        """The parameter pieces inside shard `shard`: (name, start, stop, offset in the shard).

        start/stop index the parameter flattened; this is how a checkpoint
        written under one sharding is read back under another.
        """
        rng = self.shard_range(shard)
        return [(e.name, start - e.offset, stop - e.offset, start - rng.start)
                for e, start, stop in self.overlaps(rng)]

    def flatten(self, tensors: Mapping[str, Tensor], dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> Tensor:
        """A new padded flat buffer holding `tensors` (by name), zero padding."""
        first = next(iter(tensors.values()))
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device or first.device)
        for e in self.entries:
            flat[e.offset:e.offset + e.numel].copy_(tensors[e.name].detach().reshape(-1))
        return flat


def bind_params(module: nn.Module, layout: FlatLayout, flat: Tensor) -> None:
    """Make every parameter of `layout` a view into `flat` (values are not copied).

    A parameter on the meta device (a module built without values) cannot
    take a real tensor as `.data`: it is first replaced, wherever the module
    holds it, by an empty parameter on `flat`'s device. Binding through
    `.data` (not `nn.Parameter(view)`) keeps each parameter's own version
    counter: a view shares its buffer's, so a ZeRO-3 gather into the buffer
    between forward and backward would look to autograd like a modified input.
    """
    params = dict(module.named_parameters())
    for name, view in layout.views(flat).items():
        param = params[name]
        if param.is_meta:
            param = _replace_param(module, param, nn.Parameter(flat.new_empty(0), param.requires_grad))
        param.data = view


def _replace_param(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """Put `new` wherever `module` (or a submodule) holds `old` (a shared parameter has several places)."""
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is old:
                sub._parameters[key] = new
    return new


def bind_grads(module: nn.Module, layout: FlatLayout, flat_grad: Tensor) -> None:
    """Make every parameter of `layout` accumulate its gradient into its view of `flat_grad`: as its
    `.grad` (backward adds into it in place) where `flat_grad` has the parameters' dtype, else as its
    `main_grad` (Note [main gradients]).

    Never call `module.zero_grad()` afterwards (it sets grads to None and
    unbinds them): zero `flat_grad` instead.
    """
    params = dict(module.named_parameters())
    for name, view in layout.views(flat_grad).items():
        param = params[name]
        if param.dtype == view.dtype:
            param.grad = view
            continue
        param.main_grad = view      # type: ignore[attr-defined]
        if not getattr(param, "folds_into_main_grad", False):
            param.register_post_accumulate_grad_hook(_fold)
            param.folds_into_main_grad = True    # type: ignore[attr-defined]


# Note [main gradients]
# A bf16 model accumulates and reduces its gradients in fp32 (Note [gradient dtype] in hetc/ir/spec.py). torch
# keeps a parameter's `.grad` in the parameter's dtype, so the fp32 buffer cannot be `.grad`: as Megatron-LM's
# `main_grad`, each parameter's view of the fp32 buffer is its `main_grad`, and a post-accumulate-grad hook
# adds each bf16 gradient autograd produces into it and drops it, so that a bf16 gradient lives only from its
# computation to its addition. A zero-bubble W step assigns `.grad` itself (torch's `stage_backward_weight`,
# no hook runs): `fold_main_grads` adds those after it.

def _fold(param: Tensor) -> None:
    param.main_grad.add_(param.grad)       # type: ignore[attr-defined]
    param.grad = None


def fold_main_grads(module: nn.Module) -> None:
    """Add every gradient left in a parameter's `.grad` into its `main_grad` (Note [main gradients])."""
    for param in module.parameters():
        if param.grad is not None and getattr(param, "folds_into_main_grad", False):
            _fold(param)


class FlatParams:
    """The flat buffers of one ministage on one rank.

    - `compute`: the full padded buffer in the compute dtype; the module's
      parameters are views into it. ZeRO-3 frees it between uses
      (`release`) and all-gathers into it again (`materialize` first).
    - `grad`: the full padded gradient buffer (`grad_dtype`, default the compute dtype); `.grad` views,
      or `main_grad` ones (Note [main gradients]).
    - `master`: fp32 master weights of shard `shard_index` only — what the
      optimizer steps. When the compute dtype is fp32 and the master need
      not outlive `compute`, it is a view of `compute` (no master copy).
    """

    def __init__(self, module: nn.Module, *, num_shards: int = 1, shard_index: int = 0,
                 dtype: torch.dtype = torch.float32, keep_master_apart: bool = False,
                 grad_dtype: torch.dtype | None = None) -> None:
        """`module` holds fp32 initial values; `keep_master_apart` for ZeRO-3 (compute is freed)."""
        self.module = module
        self.layout = FlatLayout.of(module, num_shards)
        self.shard_index = shard_index
        full = self.layout.flatten(dict(module.named_parameters()), torch.float32)
        self.compute = full if dtype == torch.float32 else full.to(dtype)
        shard = full[self.layout.shard_range(shard_index)]
        shares = dtype == torch.float32 and not keep_master_apart
        self.master = shard if shares else shard.clone()
        self.grad = torch.zeros_like(self.compute, dtype=grad_dtype or dtype)
        bind_params(module, self.layout, self.compute)
        bind_grads(module, self.layout, self.grad)

    @property
    def master_is_compute(self) -> bool:
        """True when stepping the master already updated the compute buffer."""
        return self.master.data_ptr() == self.compute_shard.data_ptr() and \
            self.master.dtype == self.compute.dtype

    @property
    def compute_shard(self) -> Tensor:
        return self.compute[self.layout.shard_range(self.shard_index)]

    @property
    def grad_shard(self) -> Tensor:
        """This rank's slice of the full grad buffer (after an all-reduce it is the reduced shard)."""
        return self.grad[self.layout.shard_range(self.shard_index)]

    def publish_master(self) -> None:
        """Copy the stepped master shard into this rank's slice of the compute buffer (cast)."""
        if not self.master_is_compute:
            self.compute_shard.copy_(self.master)

    def load(self, full: Tensor) -> None:
        """Set every parameter from `full`, the whole fp32 flat buffer (initial weights from a file)."""
        self.compute.copy_(full.to(self.compute.dtype))
        if not self.master_is_compute:
            self.master.copy_(full[self.layout.shard_range(self.shard_index)])

    def zero_grad(self) -> None:
        self.grad.zero_()

    def release(self) -> None:
        """Free the compute buffer's memory; the parameter views stay bound (ZeRO-3)."""
        self.compute.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Re-allocate a released compute buffer (contents undefined until gathered into)."""
        self.compute.untyped_storage().resize_(self.compute.numel() * self.compute.element_size())

    def named_master(self) -> dict[str, Tensor]:
        """Full-precision parameters by name; needs num_shards == 1 (else gather first)."""
        if self.layout.num_shards != 1:
            raise InternalError("the master holds one shard; gather it to name parameters")
        return {n: t.float().clone() for n, t in self.layout.views(self.master).items()}
