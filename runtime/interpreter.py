"""The interpreter: one handler per instruction kind, over torch.distributed.

It runs one rank's `RankProgram` once per training step and does exactly
what the program says, checking the protocol as it goes (Note [runtime
invariants]): a compute op whose input has not arrived, a message received
twice, a handle waited twice or never, a stash left over at the end of the
step are errors that name the rank, the step and the instruction.

Every ministage is an autograd island: its forward input is a detached
tensor that requires grad, so its backward yields the gradient to send (or
to hand to the previous ministage on this rank) without one graph spanning
ministages. A ministage split into ZeRO-3 units (Note [units] in
hetc/ir/program.py) is an island per unit the same way: each unit's forward
takes the previous unit's output detached, and its backward hands the
gradient of its input to the unit before it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from hetc.ir.program import (COMPUTE_TYPES, AllGather, AllReduce, AllToAll, Backward, BackwardInput, BackwardWeight,
                          ComputeInstr, Forward, Free, Instr, Load, Offload, Prefetch, RankProgram, Recv, ReduceScatter,
                          Send, Step, Unit, Wait)
from hetc.ir.program import Tensor as Kind
from hetc.runtime.buffers import MinistageBuffers
from hetc.runtime.comm import Comm, Waitable
from hetc.runtime.data import DataSource
from hetc.runtime.host_copy import host_buffer, upload
from hetc.runtime.inject import Injection, compute_factor, link_factor, stretch, synchronize
from hetc.runtime.lane import LanePlace, take_tokens
from hetc.runtime.links import MessageLog
from hetc.runtime.loss_scale import LossScaler
from hetc.runtime.nn.moe import AuxLoss, aux_loss_mean, clear_aux_tallies, moe_layers, reported_aux_losses
from hetc.runtime.optim import clip_coefficient, grad_sq_sum, lr_at, optimizer_step
from hetc.runtime.nn.dropout import RngState, replaying, rng_state, seed_step
from hetc.runtime.flat import fold_main_grads
from hetc.runtime.nn.split_backward import DeferredWeightGrad, backward_input, backward_weight
from hetc.runtime.step_clock import StepClock
from hetc.runtime.tied import put_tied_sum, tied_copy, tied_share
from hetc.runtime.unit_buffers import Buffers, UnitBuffers
from hetc.ir.plan import Plan
from hetc.ir.spec import DType
from hetc.ir.timeline import class_times

__all__ = ["Interpreter", "ProtocolError", "StepResult"]

log = logging.getLogger("hetc.runtime")


class ProtocolError(RuntimeError):
    """The program broke a runtime invariant (it should have failed verification)."""


@dataclass
class StepResult:
    loss: float
    seconds: float
    events: list[tuple[int, float, float]] = field(default_factory=list)   # (instr index, start, end)
    classes: dict[str, float] = field(default_factory=dict)   # seconds per TimeClass (Note [time classes])
    grad_norm: float | None = None     # the global gradient norm before clipping, where the step computes it
    skipped: bool = False              # the update was skipped: a non-finite gradient norm (Note [non-finite steps])
    loss_scale: float | None = None    # fp16: the scale this step's backward ran at (Note [dynamic loss scale])
    lr: float = 0.0                    # the learning rate of this step's update (Note [skipped updates])
    aux_losses: dict[AuxLoss, float] = field(default_factory=dict)   # MoE's reported ones (`reported_aux_losses`)


@dataclass
class _Pending:
    instr: Instr
    work: Waitable | None                    # a torch Work, or None when already complete
    on_done: Callable[[], None] | None

    def complete(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.on_done is not None:
            self.on_done()


class Interpreter:
    injected: tuple[Injection, ...] = ()    # `hetc run --inject`: this run's slowdowns (runtime/inject.py)
    # the plan's time of a message (src, dst, bytes): what a slowed link stretches (Note [a slowed link])
    message_time: Callable[[int, int, float], float] | None = None
    messages: MessageLog | None = None      # `--rebalance`: when each message was posted and arrived

    def __init__(self, program: RankProgram, plan: Plan, buffers: dict[int, Buffers], comm: Comm,
                 data: DataSource, device: torch.device, place: LanePlace):
        self.spec, self.program, self.buffers, self.comm = plan.spec, program, buffers, comm
        self.data, self.m, self.device, self.place = data, plan.pipeline.num_microbatches, device, place
        self.model, self.train = plan.model, plan.train
        self.world = plan.pipeline.world_size
        ministages = plan.pipeline.ministages
        self.first_layer = {m.index: m.first_layer for m in ministages}
        self.stop_layer = {m.index: m.stop_layer for m in ministages}
        self.starts = {ms: self.first_layer[ms] == 0 for ms in buffers}
        self.ends = {ms: self.stop_layer[ms] == plan.model.num_model_layers for ms in buffers}
        self.counts_loss = place.counts_loss
        self.training = True
        # Note [dropout streams]: the tp ranks of a lane position draw from one stream, named by their first rank
        self.dropout = plan.model.hidden_dropout > 0 or plan.model.attention_dropout > 0
        self.dropout_stream = program.rank if place.tp_group is None else \
            dist.get_process_group_ranks(cast(dist.ProcessGroup, place.tp_group))[0]
        self.skip_nonfinite = False    # set by `hetc run --on-nonfinite skip`: Note [non-finite steps]
        self.updates = 0    # optimizer updates applied, skipped steps not counted (Note [skipped updates])
        self.scaler = LossScaler.start(plan.train.loss_scale) if plan.model.dtype is DType.FP16 else None
        self.moe_layers = moe_layers(part.module for buf in buffers.values() for part in buf.parts())
        # the host buffers of the rank's offloads: its stage's `offload { pin_memory }`
        self.pin_memory = pin_memory = plan.pipeline.stage_of_rank[program.rank].offload.pin_memory
        for buf in buffers.values():
            for part in buf.parts():
                part.pin_host_copy(pin_memory)
        # one handler per instruction class, each taking its own class (so the table's value type is loose)
        self._handlers: dict[type[Instr], Callable[..., None]] = {
            Load: self._load, Forward: self._forward, Backward: self._backward,
            BackwardInput: self._backward_input, BackwardWeight: self._backward_weight, Send: self._send,
            Recv: self._recv, AllGather: self._all_gather, ReduceScatter: self._reduce_scatter,
            AllReduce: self._all_reduce, AllToAll: self._all_to_all, Offload: self._offload,
            Prefetch: self._prefetch, Free: self._free, Step: self._step, Wait: self._wait,
        }

    # ------------------------------------------------------------ the step

    def run_step(self, step: int, trace: bool = False, classes: bool = False) -> StepResult:
        """One step; `trace` times each instruction, `classes` the step's time per TimeClass.

        On a GPU both time the compute stream by CUDA events, read once at the step's end (Note [timing
        with CUDA events] in runtime/step_clock.py): measuring adds no host wait inside the step.
        """
        self.training = True
        return self._run(step, trace, classes)

    def evaluate(self, batch: int, program: RankProgram, data: DataSource) -> float:
        """The mean loss of validation batch `batch`, by `program`, this rank's evaluation program
        (Note [Evaluation programs] in passes/lower/forward_only.py): no graph, no stash, no update."""
        saved = self.program, self.data
        self.program, self.data, self.training = program, data, False
        self._train_modules(False)     # no dropout
        try:
            with torch.no_grad():
                return self._run(batch, trace=False).loss
        finally:
            self.program, self.data = saved
            self._train_modules(True)

    def _train_modules(self, training: bool) -> None:
        for buf in self.buffers.values():
            for part in buf.parts():
                part.module.train(training)

    def _run(self, step: int, trace: bool, classes: bool = False) -> StepResult:
        self._begin(step)
        t0 = time.perf_counter()
        clock = StepClock(self.device) if trace or classes else None
        slower = compute_factor(self.injected, self.program.rank, step, self.world) if self.training else 1.0
        for index, instr in enumerate(self.program.instrs):
            if clock is not None:
                clock.mark()
            try:
                if slower > 1 and isinstance(instr, COMPUTE_TYPES):
                    self._slowed(instr, slower)
                else:
                    self._handlers[type(instr)](instr)
            except Exception as err:
                # a note, not a new exception of type(err): not every exception's constructor takes a message
                err.add_note(f"[rank {self.program.rank}] step {step}: instruction {index} `{instr}`")
                raise
        if clock is not None:
            clock.mark()
        self._end(step)
        marks = clock.seconds() if clock is not None else []   # marks[i]: instruction i reached; last: loop end
        events = [(i, marks[i], marks[i + 1]) for i in range(len(marks) - 1)] if trace else []
        split = {c.value: s for c, s in class_times(self.program.instrs, marks[:-1], marks[-1]).items()} \
            if classes else {}
        return StepResult(self.loss_total, time.perf_counter() - t0, events, split, self.grad_norm, self.skip_update,
                          self.scale_used, self.lr, self.aux_totals)

    def _slowed(self, instr: Instr, factor: float) -> None:
        """A compute instruction of an injected slow rank: run, then wait (factor - 1) times its time."""
        synchronize(self.device)
        start = time.perf_counter()
        self._handlers[type(instr)](instr)
        synchronize(self.device)
        stretch(time.perf_counter() - start, factor)

    def _begin(self, step: int) -> None:
        self.step_idx = step
        self.tokens: dict[int, tuple[Tensor, Tensor]] = {}
        self.inputs: dict[tuple[int, int], Tensor] = {}      # (ms, mb) -> forward input (stash)
        self.outputs: dict[tuple[int, int], Tensor] = {}     # (ms, mb) -> forward output / loss
        self.in_grads: dict[tuple[int, int], Tensor] = {}    # (ms, mb) -> gradient of the forward input
        self.arrived = self.place.arrivals()
        self.param_groups: dict[tuple[int, int], DeferredWeightGrad] = {}  # zero-bubble: saved for bwd_w
        self.on_host: dict[tuple[int, int], Tensor] = {}     # offloaded stashes
        # ZeRO-3 units (Note [units]): (ms, mb, unit) -> (input, output with graph); (ms, mb, layer) -> the
        # output of the unit ending there (forward) / the gradient of the input of the unit starting there
        self.unit_graphs: dict[tuple[int, int, Unit], tuple[Tensor, Tensor]] = {}
        self.unit_outs: dict[tuple[int, int, int], Tensor] = {}
        self.unit_grads: dict[tuple[int, int, int], Tensor] = {}
        self.pending: dict[int, _Pending] = {}
        self.loss_sum: Tensor | None = None                  # Note [the loss on the device]
        self.staged: list[Tensor] = []                       # page-locked token copies in flight (`upload`)
        self.loss_total = float("nan")
        self.aux_totals: dict[AuxLoss, float] = {}
        self.clip = 1.0
        self.grad_norm: float | None = None
        self.skip_update = False
        self.lr = lr_at(self.train, self.updates)
        self.scale_used = None if self.scaler is None or not self.training else self.scaler.scale
        for moe in self.moe_layers:     # Note [load-balancing loss]: the seed of the loss, 1/m (times the scale)
            moe.aux_seed = (1.0 if self.scale_used is None else self.scale_used) / self.m
        clear_aux_tallies(self.moe_layers)
        self.replay: dict[tuple[int, int], RngState] = {}   # activation offload's recomputations
        if self.training:
            if self.dropout:
                seed_step(self.train.seed, step, self.dropout_stream)
            for buf in self.buffers.values():
                buf.zero_grads()
            if self.messages is not None:
                self.messages.clear()

    def _end(self, step: int) -> None:
        if self.device.type == "cuda":
            # the step's one host wait besides the loss and the norm: the compute stream has waited for every
            # copy, so host memory they wrote is whole for whatever reads it next (checkpoints); Note
            # [stream-ordered copies] in runtime/host_copy.py
            torch.cuda.current_stream(self.device).synchronize()
        if self.pending:
            h, p = next(iter(self.pending.items()))
            raise ProtocolError(f"[rank {self.program.rank}] step {step}: handle {h} of `{p.instr}` is never waited")
        leftover = [k for k in self.inputs if k not in self.in_grads]
        if leftover:
            raise ProtocolError(f"[rank {self.program.rank}] step {step}: forward stashes {leftover[:3]} never "
                                "ran backward")
        if self.training and not self.skip_update:
            self.updates += 1

    # ------------------------------------------------------------ async plumbing

    def _post(self, instr: Instr, work: Waitable | None, on_done: Callable[[], None] | None = None) -> None:
        handle = getattr(instr, "handle", None)
        if handle is None:
            _Pending(instr, work, on_done).complete()
            return
        if handle in self.pending:
            raise ProtocolError(f"handle {handle} is already in flight")
        self.pending[handle] = _Pending(instr, work, on_done)

    def _wait(self, instr: Wait) -> None:
        p = self.pending.pop(instr.handle, None)
        if p is None:
            raise ProtocolError(f"handle {instr.handle} is not in flight")
        p.complete()

    # ------------------------------------------------------------ data and compute

    def _load(self, instr: Load) -> None:
        tokens, labels = self.data.get_microbatch(self.step_idx, instr.mb)
        self.tokens[instr.mb] = (upload(take_tokens(tokens, self.place), self.device, self.staged),
                                 upload(take_tokens(labels, self.place), self.device, self.staged))

    def _input_of(self, ms: int, mb: int) -> Tensor:
        if self.starts[ms]:
            if mb not in self.tokens:
                raise ProtocolError(f"microbatch {mb} is not loaded")
            return self.tokens[mb][0]
        local = self.outputs.get((ms - 1, mb))
        if local is not None and (ms - 1) in self.buffers:
            return local.detach().requires_grad_(True)
        got = self.arrived.take((Kind.ACT, ms - 1, mb))
        if got is None:
            raise ProtocolError(f"the input act ms={ms - 1} mb={mb} has not arrived")
        return got.requires_grad_(True)

    def _opens(self, instr: ComputeInstr) -> bool:
        """Whether the op starts at its ministage's first layer (a whole ministage, or its first unit)."""
        return instr.unit is None or instr.unit.first == self.first_layer[instr.ms]

    def _closes(self, instr: ComputeInstr) -> bool:
        """Whether the op ends at its ministage's stop (a whole ministage, or its last unit)."""
        return instr.unit is None or instr.unit.stop == self.stop_layer[instr.ms]

    def _unit_forward(self, instr: Forward) -> None:
        ms, mb, unit = instr.ms, instr.mb, instr.unit
        assert unit is not None   # the caller's test
        if self._opens(instr):
            x = self._input_of(ms, mb)
        else:
            before = self.unit_outs.pop((ms, mb, unit.first), None)
            if before is None:
                raise ProtocolError(f"the unit of ministage {ms} ending at layer {unit.first} has not run forward "
                                    f"on microbatch {mb}")
            x = before.detach().requires_grad_(True)
        closes = self._closes(instr)
        out = self._buffer(ms, unit).module(x, self.tokens[mb][1] if closes and self.ends[ms] else None)
        if self.training:
            self.unit_graphs[(ms, mb, unit)] = (x, out)
            if self._opens(instr):
                self.inputs[(ms, mb)] = x
        if not closes:
            self.unit_outs[(ms, mb, unit.stop)] = out
            return
        self.outputs[(ms, mb)] = out
        if self.ends[ms]:
            self._add_loss(out)

    def _forward(self, instr: Forward) -> None:
        if instr.unit is not None:
            self._unit_forward(instr)
            return
        ms, mb = instr.ms, instr.mb
        buf = self._buffer(ms, None)
        x = self._input_of(ms, mb)
        labels = self.tokens[mb][1] if self.ends[ms] else None
        # under activation offload, stash only the boundary input and recompute in backward
        if buf.shard.act_offload and self.training and self.dropout:
            self.replay[(ms, mb)] = rng_state(self.device)
        with torch.no_grad() if buf.shard.act_offload else contextlib.nullcontext():
            out = buf.module(x, labels)
        if self.training:
            self.inputs[(ms, mb)] = x
        self.outputs[(ms, mb)] = out
        if self.ends[ms]:
            self._add_loss(out)

    # Note [the loss on the device]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Reading each microbatch's loss on the host (`.item()`) would make the host wait for the GPU after
    # every last-stage forward. The losses are summed on the device instead, in float64 and in microbatch
    # order, and read once, where the program waits for the loss's all-reduce: the same IEEE float64 adds, in
    # the same order, as the Python sum of floats that the runtime and the 1-rank reference (runtime/
    # reference.py) make, so the loss is bitwise what it was (a loss widened to float64 is exact).

    def _add_loss(self, out: Tensor) -> None:
        loss = out.detach().to(torch.float64)
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def _graph_of(self, ms: int, mb: int) -> tuple[Tensor, Tensor]:
        """(input, output-with-graph) of a forward, recomputing it if only the input was stashed."""
        key = (ms, mb)
        if key in self.on_host:
            raise ProtocolError(f"the stash of ms={ms} mb={mb} is still on the host")
        x, out = self.inputs[key], self.outputs[key]
        buf = self._buffer(ms, None)
        if buf.shard.act_offload:
            labels = self.tokens[mb][1] if self.ends[ms] else None
            state = self.replay.pop(key, None)
            with torch.enable_grad(), replaying(state, self.device) if state else contextlib.nullcontext():
                out = buf.module(x, labels)
        return x, out

    def _output_grad(self, ms: int, mb: int) -> Tensor | None:
        if self.ends[ms]:
            return None
        local = self.in_grads.get((ms + 1, mb))
        if local is not None and (ms + 1) in self.buffers:
            return local
        got = self.arrived.take((Kind.GRAD, ms + 1, mb))
        if got is None:
            raise ProtocolError(f"the output gradient grad ms={ms + 1} mb={mb} has not arrived")
        return got

    def _seed(self, ms: int, mb: int) -> tuple[Tensor, Tensor, Tensor | None]:
        x, out = self._graph_of(ms, mb)
        grad = self._output_grad(ms, mb)
        return x, (self._seeded(out) if grad is None else out), grad

    def _unit_seed(self, instr: ComputeInstr) -> tuple[Tensor, Tensor, Tensor | None]:
        ms, mb, unit = instr.ms, instr.mb, instr.unit
        assert unit is not None   # the caller's test
        graph = self.unit_graphs.pop((ms, mb, unit), None)
        if graph is None:
            raise ProtocolError(f"backward of unit {unit} of ministage {ms} before its forward on microbatch {mb}")
        x, out = graph
        if not self._closes(instr):
            after = self.unit_grads.pop((ms, mb, unit.stop), None)
            if after is None:
                raise ProtocolError(f"the unit of ministage {ms} starting at layer {unit.stop} has not run "
                                    f"backward on microbatch {mb}")
            return x, out, after
        grad = self._output_grad(ms, mb)
        return x, (self._seeded(out) if grad is None else out), grad

    def _seeded(self, loss: Tensor) -> Tensor:
        """What a microbatch's loss backward starts from: loss / m (Note [Loss normalisation]), times the
        loss scale under fp16 (Note [dynamic loss scale] in runtime/loss_scale.py)."""
        return loss / self.m if self.scale_used is None else loss * (self.scale_used / self.m)

    def _backward(self, instr: Backward) -> None:
        self._ready_grads(self._buffer(instr.ms, instr.unit))
        if instr.unit is None:
            x, out, grad = self._seed(instr.ms, instr.mb)
        else:
            x, out, grad = self._unit_seed(instr)
        torch.autograd.backward(out, grad)
        if self._opens(instr):
            self._done_backward(instr.ms, instr.mb, x)
        else:
            assert instr.unit is not None and x.grad is not None   # a unit after the first takes a grad input
            self.unit_grads[(instr.ms, instr.mb, instr.unit.first)] = x.grad

    def _backward_input(self, instr: BackwardInput) -> None:
        buf = self._buffer(instr.ms, None)   # no gradient buffer yet: `bwd_w` fills it (Note [gradient buffer release])
        x, out, grad = self._seed(instr.ms, instr.mb)
        self.param_groups[(instr.ms, instr.mb)] = backward_input(out, grad, x, buf.module)
        self._done_backward(instr.ms, instr.mb, x)

    def _backward_weight(self, instr: BackwardWeight) -> None:
        groups = self.param_groups.pop((instr.ms, instr.mb), None)
        if groups is None:
            raise ProtocolError(f"bwd_w before bwd_i for ms={instr.ms} mb={instr.mb}")
        buf = self._buffer(instr.ms, None)
        self._ready_grads(buf)
        backward_weight(buf.module, groups)
        fold_main_grads(buf.module)      # torch assigned `.grad` itself (Note [main gradients] in runtime/flat.py)

    @staticmethod
    def _ready_grads(buf: MinistageBuffers) -> None:
        for part in buf.parts():    # the dense and the expert parameters' gradients
            part.ready_grads()

    def _done_backward(self, ms: int, mb: int, x: Tensor) -> None:
        self.in_grads[(ms, mb)] = x.grad if x.grad is not None else torch.zeros(0)
        self.outputs.pop((ms, mb), None)

    def _buffers(self, ms: int) -> Buffers:
        buf = self.buffers.get(ms)
        if buf is None:
            raise ProtocolError(f"ministage {ms} is not on this rank")
        return buf

    def _buffer(self, ms: int, unit: Unit | None) -> MinistageBuffers:
        """The buffers an instruction naming `unit` (or none) acts on (Note [units])."""
        buf = self._buffers(ms)
        if isinstance(buf, UnitBuffers):
            if unit is None:
                raise ProtocolError(f"ministage {ms} is split into units {', '.join(map(str, buf.shard.units))}: "
                                    "the instruction must name one")
            try:
                return buf.unit(unit)
            except KeyError as err:
                raise ProtocolError(str(err)) from None
        if unit is not None:
            raise ProtocolError(f"ministage {ms} is not split into units, but the instruction names unit {unit}")
        return buf

    # ------------------------------------------------------------ point to point

    def _send(self, instr: Send) -> None:
        tensor = (self.outputs if instr.what is Kind.ACT else self.in_grads).get((instr.ms, instr.mb))
        if tensor is None:
            raise ProtocolError(f"nothing to send: {instr.what.value} ms={instr.ms} mb={instr.mb} is not computed")
        payload = self.arrived.local(tensor.detach(), instr.seq).contiguous()
        tag = self.comm.tag(instr)
        if self.messages is not None and self.training:
            self.messages.posted_send(instr.peer_to, tag)
        self._post(instr, self.comm.isend(payload, instr.peer_to, tag, str(instr)))

    def _recv(self, instr: Recv) -> None:
        key = (instr.what, instr.ms, instr.mb)
        if instr.seq is None and key in self.arrived:
            raise ProtocolError(f"{instr.what.value} ms={instr.ms} mb={instr.mb} is received twice")
        buf = torch.empty(instr.shape, dtype=self.comm.act_dtype, device=self.device)
        tag = self.comm.tag(instr)
        posted = time.time()
        work = self.comm.irecv(buf, instr.peer_from, tag, str(instr))

        def arrived() -> None:
            self._late_on_slow_link(instr.peer_from, buf)
            self.arrived.put(key, buf, instr.seq)
            if self.messages is not None and self.training:
                self.messages.arrived(instr.peer_from, tag, posted, buf.numel() * buf.element_size())
        self._post(instr, work, arrived)

    def _late_on_slow_link(self, peer: int, buf: Tensor) -> None:
        """A message from `peer` over an injected slow link arrives (factor - 1) x its planned time late
        (Note [a slowed link] in runtime/inject.py)."""
        factor = link_factor(self.injected, peer, self.program.rank, self.step_idx, self.world) if self.training else 1.0
        if factor > 1:
            assert self.message_time is not None, "a slowed link needs the plan's message times"
            stretch(self.message_time(peer, self.program.rank, buf.numel() * buf.element_size()), factor)

    # ------------------------------------------------------------ collectives

    def _all_gather(self, instr: AllGather) -> None:
        buf = self._buffer(instr.ms, instr.unit).part(instr.group)
        group = self.comm.group(instr.group)
        if instr.group == buf.shard.outer:
            target = buf.own_params if buf.level == 3 else buf.compute[buf.inner_range]
            mine = target[buf.opt_range_in_inner()].clone()
            self._post(instr, self.comm.all_gather(target, mine, group))
            return
        if buf.level == 3:
            buf.holders += 1
            buf.materialize()
            self._post(instr, self.comm.all_gather(buf.compute, buf.own_params, group))
            return
        mine = buf.compute[buf.inner_range].clone()
        self._post(instr, self.comm.all_gather(buf.compute, mine, group))

    def _free(self, instr: Free) -> None:
        buf = self._buffer(instr.ms, instr.unit)
        if buf.holders <= 0:
            raise ProtocolError(f"ministage {instr.ms}'s parameters are not gathered")
        buf.holders -= 1
        if buf.holders == 0:
            buf.release()

    def _reduce_scatter(self, instr: ReduceScatter) -> None:
        buf = self._buffer(instr.ms, instr.unit).part(instr.group)
        group = self.comm.group(instr.group)
        if instr.group == buf.shard.outer:
            self._post(instr, self.comm.reduce_scatter(buf.across_grad, buf.inner_grad, group))
            return
        out = torch.empty(buf.inner_numel, dtype=buf.grad.dtype, device=self.device)

        def done() -> None:
            buf.accumulate(out)
            buf.reduced()   # the next microbatch accumulates afresh
        self._post(instr, self.comm.reduce_scatter(out, buf.grad, group), done)

    def _all_reduce(self, instr: AllReduce) -> None:
        group = self.comm.group(instr.group)
        if instr.what is Kind.LOSS:
            self._reduce_loss(instr, group)
        elif instr.what is Kind.NORM:
            self._reduce_norm(instr, group)
        elif instr.ms is None:
            raise ProtocolError(f"`{instr}` reduces gradients but names no ministage")
        elif instr.what is Kind.TIED:
            self._reduce_tied(instr.ms, instr, group)
        else:
            buf = self._buffer(instr.ms, instr.unit).part(instr.group)
            target = buf.inner_grad if instr.group == buf.shard.outer else buf.grad
            self._post(instr, self.comm.all_reduce(target, group))

    def _reduce_tied(self, ms: int, instr: AllReduce, group) -> None:
        """Sum the tied embedding's copies' gradients into ministage `ms`'s copy (runtime/tied.py)."""
        copy = tied_copy(self._buffers(ms))
        total = tied_share(copy)
        self._post(instr, self.comm.all_reduce(total, group), lambda: put_tied_sum(copy, total))

    def _reduce_loss(self, instr: AllReduce, group) -> None:
        """All-reduce the mean of this rank's microbatch losses, and beside it, where the model's MoE layers
        add auxiliary losses, their tallies (the same on every rank: the model's); its wait is where the host
        reads them all."""
        reported = reported_aux_losses(self.model.moe) if self.training else ()
        total = torch.zeros(1 + len(reported), dtype=torch.float64, device=self.device)
        if self.counts_loss and self.loss_sum is not None:
            total[0] = self.loss_sum / self.m      # Note [the loss on the device]
        for i, kind in enumerate(reported, 1):
            tallied = [loss for moe in self.moe_layers for loss in moe.tallied[kind]]
            if self.counts_loss and tallied:
                total[i] = torch.stack(tallied).sum()
        self._post(instr, self.comm.all_reduce(total, group), lambda: self._read_losses(total, reported))

    def _read_losses(self, total: Tensor, reported: tuple[AuxLoss, ...]) -> None:
        """The host's one read of the step's reduced losses (Note [load-balancing loss])."""
        values = total.tolist()
        self.loss_total = values[0]
        self.aux_totals = {kind: aux_loss_mean(kind, value, self.model, self.m)
                           for kind, value in zip(reported, values[1:], strict=True)}

    def _reduce_norm(self, instr: AllReduce, group) -> None:
        """All-reduce the sum of squares of this rank's unique gradients, added on the device in part order;
        its wait is where the host reads the norm, once."""
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for buf in self.buffers.values():
            for part in buf.parts():
                total += grad_sq_sum(part.unique_grad())

        def done() -> None:
            total_sq = float(total.item())
            if self.scale_used is not None:
                self._unscale(total_sq, self.scale_used)
                return
            self.grad_norm = math.sqrt(total_sq)
            self.skip_update = self.skip_nonfinite and not math.isfinite(self.grad_norm)
            self.clip = 1.0 if self.skip_update else clip_coefficient(total_sq, self.train.grad_clip)
        self._post(instr, self.comm.all_reduce(total, group), done)

    def _unscale(self, scaled_sq: float, scale: float) -> None:
        """fp16: the norm of gradients `scale` times the true ones. Non-finite: an overflow on some rank, so
        every rank skips the update; else the step's factor unscales and clips at once (Note [dynamic loss
        scale] in runtime/loss_scale.py)."""
        assert self.scaler is not None    # `scale_used` is set from it
        overflow = not math.isfinite(scaled_sq)
        self.grad_norm = math.sqrt(scaled_sq) / scale
        self.skip_update = overflow
        self.clip = 1.0 if overflow else clip_coefficient(scaled_sq / scale ** 2, self.train.grad_clip) / scale
        self.scaler.update(overflow)

    def _all_to_all(self, instr: AllToAll) -> None:
        raise ProtocolError("all_to_all of boundary tensors has no runtime: hetc lowers layout transforms "
                            "to point-to-point pieces (send/recv seq=a:b), and Ulysses' all-to-alls run "
                            "inside the compute of its ministages")

    # ------------------------------------------------------------ optimizer

    def _step(self, instr: Step) -> None:
        for buf in self._buffers(instr.ms).parts():
            grad = buf.step_grad()
            if self.clip != 1.0:
                grad = grad * self.clip
            if not self.skip_update:
                optimizer_step(self.model.optimizer, buf.master, grad, buf.opt_state,
                               lr=self.lr, step=self.updates, decayed=buf.decayed)
            buf.publish()
            buf.drop_reduced()

    # ------------------------------------------------------------ host offload

    def _offload(self, instr: Offload) -> None:
        if instr.what is Kind.PARAMS:
            parts = self._buffers(instr.ms).parts()

            def to_host() -> None:
                if instr.host_current:   # Note [clean parameter offload] in passes/lower/offload.py
                    return
                for p in parts:
                    p.to_host()

            def drop() -> None:
                for p in parts:
                    p.drop_device_copy()
            self._post(instr, *self.comm.copy(to_host, drop, [p.resident() for p in parts]))
            return
        key = _stash_key(instr)
        x = self.inputs[key]
        host = host_buffer(x, self.pin_memory, x.device)

        def move() -> None:
            host.copy_(x.detach(), non_blocking=x.device.type == "cuda")

        def done() -> None:
            self.on_host[key] = host
            self.inputs[key] = x.detach().new_empty(0)   # the device copy is gone
        self._post(instr, *self.comm.copy(move, done, [x]))

    def _prefetch(self, instr: Prefetch) -> None:
        if instr.what is Kind.PARAMS:
            parts = self._buffers(instr.ms).parts()
            for p in parts:    # on the compute stream, which uses them (Note [stream-ordered copies])
                p.allocate_device_copy()

            def to_device() -> None:
                for p in parts:
                    p.to_device()
            self._post(instr, *self.comm.copy(to_device, None, [p.resident() for p in parts]))
            return
        key = _stash_key(instr)
        host = self.on_host.pop(key, None)
        if host is None:
            raise ProtocolError(f"the stash of ms={instr.ms} mb={instr.mb} is not on the host")
        back = torch.empty(host.shape, dtype=host.dtype, device=self.device)

        def move() -> None:
            back.copy_(host, non_blocking=self.device.type == "cuda")

        def done() -> None:
            self.inputs[key] = back.requires_grad_(not self.starts[instr.ms])
        self._post(instr, *self.comm.copy(move, done, [back]))


def _stash_key(instr: Offload | Prefetch) -> tuple[int, int]:
    """(ms, mb) of an activation offload or prefetch: those name their microbatch."""
    if instr.mb is None:
        raise ProtocolError(f"`{instr}` moves an activation but names no microbatch")
    return instr.ms, instr.mb
