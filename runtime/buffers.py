"""The buffers of one ministage on one rank, laid out for its ZeRO shard.

Note [flat shards] — with an inner group of n_in lanes (this rank is i_in)
and, for hierarchical ZeRO, an outer group of n_out (this rank is i_out):
the flat buffer is padded to n_in · n_out parts when the optimizer state is
sharded across (outer level 1), else to n_in parts. The *inner shard* is
part i_in of n_in; the *optimizer shard* is the part this rank steps: the
whole buffer at level 0, the inner shard at levels 1-3, and its i_out-th
sub-slice when sharded across.

    compute      full parameters in the compute dtype; module parameters are
                 views into it. ZeRO-3 releases it between uses and keeps
                 `param_shard` (the inner shard) instead.
    grad         full gradient buffer (fp32 for a bf16 model: Note [main
                 gradients] in runtime/flat.py); backward accumulates here.
                 ZeRO-2 and 3 allocate it before a backward (`ready_grads`) and release
                 it once reduce-scattered (`reduced`), so a rank holds only
                 its shards outside the backward of its ministage (its unit).
    acc          the reduced gradients of the inner shard (levels 1-3, the
                 gradients' dtype), from the step's first reduction to its
                 optimizer step (Note [reduced shard]).
    opt_grad     gradients of the optimizer shard when sharded across (in
                 `acc`'s dtype), from their reduction to the step.
    master       fp32 master weights of the optimizer shard, and its
                 optimizer state. An fp32 model's master is a view of its
                 parameters (`_master`): no copy, as the memory model counts
                 (with parameter offload too: Note [optimizer offload]).

Note [reduced shard]: a reduction's output is the rank's shard of the
summed gradients. The first of a step becomes `acc` as it is; a buffer
reduced again in the step (ZeRO-2/3 under per-microbatch schedules: one
reduce-scatter per microbatch) adds the others to it. The shard stays in the
gradients' dtype, as the full buffer of ZeRO-0/1 sums its microbatches and
as the memory model counts it (Φ/N gradients); the optimizer reads it in
fp32 (a cast for the step where the gradients are not fp32). The step drops
it (`drop_reduced`), so it is held from the step's first reduction to its
step only: what the verifier counts (passes/verify/memory.py, Note [memory
timeline]).

All sums are plain sums: the loss of each microbatch is already divided by
the number of microbatches (Note [Loss normalisation] in reference.py).

Under tensor parallelism the module holds one tp rank's slices (`infos`);
parameters every tp rank holds whole (norms, embedding, head) are counted
in the gradient norm and written to checkpoints by tp rank 0 only.

Under expert parallelism a ministage's expert parameters live in a buffer
of their own, `experts` (sharded over the shard line's `expert_group`,
hetc/ir/program.py), and the ministage's buffer holds the rest; `parts` lists
both for whatever acts on all of a ministage's state.

Note [optimizer offload]
A shard with `opt_offload` keeps its master weights and optimizer state in
host memory and steps there, as ZeRO-Offload and FSDP2's CPUOffloadPolicy
do: at its `step` the reduced gradient shard comes down in the gradients'
dtype (4 bytes a parameter for bf16: Note [gradient dtype]), torch's
foreach Adam updates the host master, and the master goes back up cast to
the compute dtype (δ bytes a parameter) into the parameters the next
gathers read. That is what the cost model charges
(`optimizer_step_time`: the host step plus both copies, not overlapped with
compute) and what the memory verifier leaves off the device (the
optimizer part). The step's two copies are host synchronisations the
program names: the host cannot update what has not arrived.

An fp32 model's master is its parameters, also when they are offloaded
(`param_offload`): a view of the resident parameters, which the program
brings to the device for the step (a step is inside its ministage's
residency window, Note [parameter residency] in passes/lower/offload.py);
between steps the host copy holds the same values (`master_values`). With
the optimizer on the host as well, the master is a host tensor of its own.

Note [Ranks that load their weights]
A rank whose initial weights come from a file (Hugging Face safetensors,
runtime/hf_load.py, or a checkpoint it resumes from, runtime/checkpoint.py)
builds its ministages with `initialise=False`: the parameters stay on the
meta device, and the buffers allocate only what the rank keeps — the
master and optimizer state of its optimizer shard and its `param_range`
(under ZeRO-3 the inner shard; at levels 0-2 the compute buffer, the whole
ministage, is the rank's own); under ZeRO-3 the full compute and grad
buffers are bound and released at once, as a random start releases them.
Nothing the rank does not own is ever given values, so its peak host
memory is its own state plus what the loader holds at once (the range it
fills and one tensor read). The loader must then fill `param_range`
(`load_params`); until it does, the parameters are zero. A random start
(`init = random`, or no weights) initialises the module as before and
flattens it, so its numerics do not change.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from hetc.ir.errors import InternalError
from hetc.ir.program import Shard
from hetc.runtime.flat import FlatLayout, bind_grads, bind_params
from hetc.runtime.host_copy import host_buffer
from hetc.runtime.nn.model import TIED_COPY, TIED_WEIGHT, Ministage
from hetc.runtime.optim import OptimizerState, decayed_spans, init_state
from hetc.runtime.nn.tensor_parallel import NO_SHARD, ShardInfo, TPShard, shard_infos
from hetc.ir.spec import OptimizerSpec

__all__ = ["GroupPos", "MinistageBuffers"]


@dataclass(frozen=True, slots=True)
class GroupPos:
    """This rank's place in a group: its index and the group's size."""

    index: int = 0
    size: int = 1


class MinistageBuffers:
    pin_host = True     # the host copy of offloaded parameters is page-locked on a GPU (`pin_host_copy`)

    def __init__(self, module: Ministage, shard: Shard, inner: GroupPos, outer: GroupPos,
                 optimizer: OptimizerSpec, dtype: torch.dtype, device: torch.device,
                 names: Collection[str] | None = None, *, tp: TPShard = NO_SHARD,
                 grad_dtype: torch.dtype | None = None):
        """`names`: the parameters of `module` this buffer holds (default all); `tp`: the rank's
        tensor-parallel slice (tp rank 0 writes the parameters every tp rank holds whole); `grad_dtype`: the
        gradients' (default `dtype`: Note [main gradients] in runtime/flat.py)."""
        self.module, self.shard, self.inner, self.outer = module, shard, inner, outer
        self.level = shard.level if shard.group is not None else 0
        across = outer.size if shard.outer_level == 1 else 1
        self.layout = FlatLayout.of(module, inner.size * across, names)
        self.experts: MinistageBuffers | None = None     # the expert parameters' own buffer, if any
        self.device, self.dtype = device, dtype
        full = self._initial_values(module)
        if self.level == 3:      # compute and grad: allocated, bound, then released below
            self.compute = torch.empty(self.layout.padded_numel, dtype=dtype, device=device)
            self.param_shard: Tensor | None = full[self.inner_range].to(dtype, copy=True) if full is not None else \
                self._zeros(self.inner_range, dtype)
        else:
            self.compute = full.to(dtype) if full is not None else self._zeros(slice(0, self.layout.padded_numel),
                                                                               dtype)
            self.param_shard = None
        self.master = self._master(full)     # on the host under optimizer offload (Note [optimizer offload])
        self.opt_state: OptimizerState = init_state(optimizer, self.master)
        self.decayed = decayed_spans(optimizer, self.layout, self.opt_range)   # of `master`; None: all of it
        del full
        grad_dtype = grad_dtype or dtype
        self.grad = torch.empty_like(self.compute, dtype=grad_dtype) if self.level == 3 else \
            torch.zeros_like(self.compute, dtype=grad_dtype)
        self.across = across
        self.acc: Tensor | None = None         # Note [reduced shard]
        self.opt_grad: Tensor | None = None
        self.holders = 0           # ZeRO-3: gathers not yet freed
        self.infos: dict[str, ShardInfo] = shard_infos(module)
        # from the rank's place, not the module's split parameters: a ZeRO-3 unit of the embedding or the
        # head has none, and would have every tp rank write them (Note [units] in hetc/ir/program.py)
        self.writes_replicated = tp.rank == 0
        # the head's copy of a tied embedding: summed with the embedding's each step, never counted or saved
        # as a parameter of its own (Note [tied copies] in runtime/nn/model.py)
        self.tied_copy = TIED_COPY if module.tied_copy and TIED_COPY in self.infos else None
        self.host: Tensor | None = None
        bind_params(module, self.layout, self.compute)
        bind_grads(module, self.layout, self.grad)
        if self.level == 3:
            self.release()
        if self.level >= 2:
            self.grad.untyped_storage().resize_(0)      # until a backward: see `ready_grads`
        if shard.param_offload:     # offloaded parameters start (and end) every step on the host
            self.to_host()
            if device.type == "cuda":   # set up, not a step: the host copy is whole before a loader writes it
                torch.cuda.current_stream(device).synchronize()
            self.drop_device_copy()

    def _initial_values(self, module: Ministage) -> Tensor | None:
        """The fp32 flat buffer of `module`'s initialised parameters; None for a module without values
        (built on the meta device: a loader fills the buffers, Note [Ranks that load their weights])."""
        params = {n: p for n, p in module.named_parameters() if n in {e.name for e in self.layout.entries}}
        meta = [p.is_meta for p in params.values()]
        if any(meta) != all(meta):
            raise InternalError("a ministage with some parameters on the meta device and some not")
        return None if all(meta) else self.layout.flatten(params, torch.float32, self.device)

    def _master(self, full: Tensor | None) -> Tensor:
        """The fp32 master weights of the optimizer shard: a view of the parameters where `master_is_params`,
        else a copy, on the host under optimizer offload."""
        if self.master_is_params:
            return self.resident()[self._opt_range_in_resident()]
        if full is None:
            return self._zeros(self.opt_range, device=self.state_device)
        return full[self.opt_range].to(self.state_device, copy=True)

    @property
    def state_device(self) -> torch.device:
        """Where the master weights and optimizer state live and the step runs (Note [optimizer offload])."""
        return torch.device("cpu") if self.shard.opt_offload else self.device

    @property
    def master_is_params(self) -> bool:
        """Whether the master weights are the parameters themselves: an fp32 model's, as the memory model
        counts (no master copy when the compute dtype is the optimizer's), unless the optimizer steps on
        the host (Note [optimizer offload])."""
        return self.dtype == torch.float32 and not self.shard.opt_offload

    def master_values(self) -> Tensor:
        """The master weights between steps (checkpoints): offloaded parameters that are their own master
        are then on the host only."""
        if self.master_is_params and self.shard.param_offload:
            return self.host_params[self._opt_range_in_resident()]
        return self.master

    def _opt_range_in_resident(self) -> slice:
        return self.opt_range_in_inner() if self.level == 3 else self.opt_range

    def _zeros(self, rng: slice, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Tensor:
        return torch.zeros(rng.stop - rng.start, dtype=dtype, device=device or self.device)

    # ------------------------------------------------------------ the buffers a level has

    @property
    def inner_grad(self) -> Tensor:
        """`acc`: the reduced gradients of the inner shard (ZeRO levels 1-3; zeros before the step's first
        reduction: Note [reduced shard])."""
        if not self.level:
            raise InternalError("this ministage buffer has no reduced gradient shard (ZeRO 1-3)")
        if self.acc is None:
            self.acc = torch.zeros(self.inner_numel, dtype=self.grad.dtype, device=self.device)
        return self.acc

    def accumulate(self, reduced: Tensor) -> None:
        """Add one reduction's output (the inner shard, the gradients' dtype) to `acc` (Note [reduced shard])."""
        self.acc = reduced if self.acc is None else self.acc.add_(reduced)

    @property
    def across_grad(self) -> Tensor:
        """`opt_grad`: the optimizer shard's gradients reduced across shard groups (outer ZeRO-1), allocated
        for that reduction to write."""
        if self.across <= 1:
            raise InternalError("this ministage buffer has no gradients reduced across shard groups")
        if self.opt_grad is None:
            self.opt_grad = torch.zeros(self.master.numel(), dtype=self.inner_grad.dtype, device=self.device)
        return self.opt_grad

    @property
    def own_params(self) -> Tensor:
        """`param_shard`: the inner shard of the parameters a ZeRO-3 rank keeps between gathers."""
        return _present(self.param_shard, "a parameter shard (ZeRO-3)")

    @property
    def host_params(self) -> Tensor:
        """`host`: the host copy of offloaded parameters (made by the first `to_host`)."""
        return _present(self.host, "a host copy of its parameters")

    def stored_name(self, name: str) -> str:
        """The name parameter `name` of this buffer is saved and loaded under (checkpoints, Hugging Face
        weights): the tied copy's is the embedding's (`stored_name` in runtime/nn/model.py)."""
        return TIED_WEIGHT if name == self.tied_copy else name

    def parts(self) -> tuple[MinistageBuffers, ...]:
        """This buffer and, under expert parallelism, the experts' buffer."""
        return (self,) if self.experts is None else (self, self.experts)

    def part(self, group: str) -> MinistageBuffers:
        """The buffer a collective on `group` acts on (Shard.part)."""
        return self.experts if self.experts is not None and self.shard.part(group) != self.shard else self

    # ------------------------------------------------------------ ranges

    @property
    def inner_numel(self) -> int:
        return self.layout.padded_numel // self.inner.size

    @property
    def inner_range(self) -> slice:
        n = self.inner_numel
        return slice(self.inner.index * n, (self.inner.index + 1) * n)

    @property
    def opt_range(self) -> slice:
        """The elements this rank steps, as a slice of the full flat buffer."""
        if self.level == 0:
            return slice(0, self.layout.padded_numel)
        return self._outer_part() if self.shard.outer_level == 1 else self.inner_range

    def _outer_part(self) -> slice:
        """Part `outer.index` of `outer.size` of the inner shard."""
        n = self.inner_numel // self.outer.size
        start = self.inner_range.start + self.outer.index * n
        return slice(start, start + n)

    def opt_range_in_inner(self) -> slice:
        rng, inner = self.opt_range, self.inner_range
        return slice(rng.start - inner.start, rng.stop - inner.start)

    # ------------------------------------------------------------ step

    def reduced_grad(self) -> Tensor:
        """The fully reduced gradients of the optimizer shard (`opt_range`), in the dtype they were reduced in:
        what the step reads."""
        if self.level == 0:
            return self.grad
        return self.across_grad if self.across > 1 else self.inner_grad

    def step_grad(self) -> Tensor:
        """fp32 gradients of the optimizer shard, fully reduced, where the step runs (brought to the host in
        the gradients' dtype under optimizer offload: Note [optimizer offload])."""
        return self.reduced_grad().to(self.state_device).float()

    def drop_reduced(self) -> None:
        """The step is done: the reduced shards go until the next step's reductions (Note [reduced shard])."""
        self.acc = self.opt_grad = None

    @property
    def unique_range(self) -> slice:
        """The elements only this rank counts (global grad norm) and writes (checkpoints).

        Replicas hold equal copies of a shard; they split it so that each
        element belongs to exactly one of them. Always inside `opt_range`.
        """
        if self.level == 0 or self.outer.size == 1:
            return self.inner_range
        return self._outer_part()      # sharded across, or inner shards replicated across nodes

    def unique_grad(self) -> Tensor:
        """The reduced gradient of `unique_range` (tp replicas of whole parameters and a tied copy zeroed: the
        embedding's counts it), in the dtype it was reduced in: a view where nothing is zeroed, for
        `grad_sq_sum`, which widens a chunk at a time (no fp32 copy of the shard)."""
        rng = self.unique_range
        if self.level == 0:
            grad = self.grad[rng]
        elif self.across > 1:
            grad = self.across_grad
        else:
            base = self.inner_range.start
            grad = self.inner_grad[rng.start - base:rng.stop - base]
        if self.writes_replicated and self.tied_copy is None:
            return grad
        grad = grad.clone()
        for e, start, stop in self.layout.overlaps(rng):
            replica = self.infos[e.name].dim is None and not self.writes_replicated
            if replica or e.name == self.tied_copy:
                grad[start - rng.start:stop - rng.start] = 0
        return grad

    def publish(self) -> None:
        """Put the stepped master weights where the next gathers read them (already there when they are the
        parameters themselves)."""
        if not self.master_is_params:
            target = self.resident()[self._opt_range_in_resident()]
            # cast where the master is, so that δ bytes a parameter cross to the device (Note [optimizer offload])
            target.copy_(self.master if self.master.device == target.device else self.master.to(self.dtype))

    @property
    def param_range(self) -> slice:
        """The elements whose parameters this rank keeps: its inner shard at ZeRO-3, else all of them.

        What a loader must provide (`load_params`): it covers `opt_range`.
        """
        return self.inner_range if self.level == 3 else slice(0, self.layout.padded_numel)

    def load_params(self, values: Tensor, rng: slice | None = None) -> None:
        """Set the parameters from `values`, elements `rng` (default all) of the fp32 flat buffer, which
        cover `param_range` (a checkpoint or Hugging Face weights being loaded).

        The master takes its slice; the compute copy (or, under ZeRO-3, the
        inner shard; with parameter offload, the host copy) takes the rest,
        so no gather is needed before the next step.
        """
        rng = slice(0, self.layout.padded_numel) if rng is None else rng
        keep, opt = self.param_range, self.opt_range
        if not (rng.start <= keep.start and keep.stop <= rng.stop):
            raise InternalError(f"{rng} does not cover {keep}")
        kept = values[keep.start - rng.start:keep.stop - rng.start].to(self.dtype)
        target = self.host_params if self.shard.param_offload else self.resident()
        target.copy_(kept)
        if not self.master_is_params:
            self.master.copy_(values[opt.start - rng.start:opt.stop - rng.start])

    def zero_grads(self) -> None:
        if self.experts is not None:
            self.experts.zero_grads()
        if self.grad.untyped_storage().size():       # ZeRO-3 before its first gather has none
            self.grad.zero_()
        self.drop_reduced()

    # ------------------------------------------------------------ ZeRO-3 residency

    def release(self) -> None:
        self.compute.untyped_storage().resize_(0)

    def materialize(self) -> None:
        """Allocate the released compute buffer (a gather fills it)."""
        storage = self.compute.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.compute.numel() * self.compute.element_size())

    def ready_grads(self) -> None:
        """ZeRO-2/3: allocate the released grad buffer, zeroed, before a backward accumulates into it."""
        grad = self.grad.untyped_storage()
        if grad.size() == 0:
            grad.resize_(self.grad.numel() * self.grad.element_size())
            self.grad.zero_()

    def reduced(self) -> None:
        """The gradients were reduced into `acc`: start the next accumulation afresh. ZeRO-2 and 3 release the
        full grad buffer (the shard lives on in `acc`) until the next backward (`ready_grads`), as DeepSpeed's
        ZeRO-2 keeps only its partition: what the memory model counts (docs/costmodel.md)."""
        if self.level >= 2:
            self.grad.untyped_storage().resize_(0)
        else:
            self.grad.zero_()

    # ------------------------------------------------------------ host offload

    def resident(self) -> Tensor:
        """The parameter storage that offload moves: the inner shard at ZeRO-3, else everything."""
        return self.own_params if self.level == 3 else self.compute

    def pin_host_copy(self, pinned: bool) -> None:
        """Keep the host copy of offloaded parameters page-locked or pageable (the spec's `offload {
        pin_memory }`; it matters on a GPU only: Note [stream-ordered copies] in runtime/host_copy.py)."""
        self.pin_host = pinned
        if self.host is None or self.host.is_pinned() == (pinned and self.device.type == "cuda"):
            return
        if self.device.type == "cuda":    # set up, not in a step: the first `to_host` may be in flight
            torch.cuda.current_stream(self.device).synchronize()
        self.host = host_buffer(self.host, pinned, self.device).copy_(self.host)

    def to_host(self) -> None:
        src = self.resident()
        if self.host is None:
            self.host = host_buffer(src, self.pin_host, src.device)
        self.host.copy_(src, non_blocking=src.device.type == "cuda")

    def drop_device_copy(self) -> None:
        self.resident().untyped_storage().resize_(0)

    def allocate_device_copy(self) -> None:
        """Give the dropped parameters device memory again, on the current stream: the compute stream's, which
        uses them (Note [stream-ordered copies]); `to_device` fills it."""
        dst = self.resident()
        storage = dst.untyped_storage()
        if storage.size() == 0:
            storage.resize_(dst.numel() * dst.element_size())

    def to_device(self) -> None:
        self.allocate_device_copy()
        dst = self.resident()
        dst.copy_(self.host_params, non_blocking=dst.device.type == "cuda")


def _present(tensor: Tensor | None, what: str) -> Tensor:
    if tensor is None:
        raise InternalError(f"this ministage buffer has no {what}")
    return tensor
