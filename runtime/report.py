"""What `hetc run` tells the user: a line per step, metrics, a measured trace.

Rank 0 prints `step 3/30  loss 4.9485  lr 3.00e-03  2,310 tokens/s  MFU 2.1%
41.2 ms/step` (with `val_loss 5.0012` after the loss on steps that evaluate)
and, with `--metrics FILE`, writes one JSON object per step (step, loss, lr,
step_time_s, tokens_per_s, mfu and hfu (Note [utilization] in
passes/cost/utilization.py: over the peak of the GPUs the plan uses, at the
model's dtype), peak_memory_bytes and peak_memory_reserved_bytes per rank
(`peak_memory`), class_times_s: per
rank, the step's seconds per TimeClass, Note [time classes], val_loss on
steps that evaluate, grad_norm where the step computes it (under clipping)
and `"skipped": true` on a step whose update was skipped, Note [non-finite
steps] in runtime/worker.py; fp16: the loss_scale the step ran at); docs/metrics.md is the schema. With
`--tensorboard DIR` and `--wandb PROJECT` the record's per-step numbers
(`step_scalars`) go to TensorBoard and Weights & Biases too
(runtime/scalars.py). Per-rank peak memory travels through the rendezvous
store, outside the program's collectives. Before step 1, `StartupProgress`
says which start-up phase is done and how long it took. With `--trace FILE` the last step is timed per instruction on
every rank and rank 0 writes a measured `Timeline` (the format of the
compiler's prediction, so `hetc viz` draws either).

Note [step numbers]: the interpreter counts steps from 0; everything the
user reads counts them from 1, as optimizer steps done: the console's
`step 3/30`, the metrics line `"step": 3` and the checkpoint `step-3`
written after it all name the same step.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
import torch.distributed as dist

from hetc.passes.cost.utilization import flop_counts, used_peak_flops
from hetc.ir.plan import Plan
from hetc.ir.program import Program, Recv, Send
from hetc.runtime.nn import collectives
from hetc.runtime.scalars import ScalarSink, TensorBoardSink, WandbSink
from hetc.runtime.interpreter import StepResult
from hetc.ir.timeline import Event, Flow, MemorySample, RankInfo, Timeline, class_times, classify
from hetc.ir.units import human_seconds

__all__ = ["Reporter", "StartupProgress", "peak_memory", "peak_memory_reserved", "step_scalars"]


def peak_memory(device: torch.device) -> float:
    """Peak bytes this process has used: CUDA allocations, or the CPU process's peak RSS."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return _peak_rss()


def peak_memory_reserved(device: torch.device) -> float:
    """Peak bytes the CUDA caching allocator has held (allocated plus its cached, free blocks: what
    `nvidia-smi` sees of the tensors, and what an out-of-memory runs into). On CPU there is no cache
    beside the allocations, so it is the process's peak RSS, equal to `peak_memory`: the field is
    present on every rank of every run."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_reserved(device))
    return _peak_rss()


def _peak_rss() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # Linux reports KiB


def _skip_note(results: list[StepResult]) -> str:
    """The step line's end: fp16's loss scale, as Megatron-LM's and DeepSpeed's logs give it (the last step's),
    and the updates skipped among the line's steps, with why."""
    last, skipped = results[-1], sum(r.skipped for r in results)
    why = "non-finite gradient norm" if last.loss_scale is None else "fp16 overflow"
    note = "" if last.loss_scale is None else f"  loss scale {last.loss_scale:g}"
    if skipped and len(results) == 1:
        return f"{note}  update skipped ({why})"
    return f"{note}  {skipped} of {len(results)} updates skipped ({why})" if skipped else note


def step_scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics record that TensorBoard and W&B plot, under the record's names: each
    scalar field, and the per-rank peak memories as their maximum over ranks (the rank that runs out)."""
    scalars = {name: float(value) for name, value in record.items()
               if isinstance(value, int | float) and not isinstance(value, bool) and name != "step"}
    for name in ("peak_memory_bytes", "peak_memory_reserved_bytes"):
        if record.get(name):
            scalars[name] = max(record[name])
    return scalars


class StartupProgress:
    """Rank 0's line per start-up phase done before step 1 (`hetc run: model built (1.2 s)`), with
    the phase's own time, so that the seconds between launching and the first step line are accounted
    for; silent on other ranks and under `-q`."""

    def __init__(self, shows: bool, since: float | None = None) -> None:
        self.shows = shows
        self.last = time.perf_counter() if since is None else since

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        if self.shows:
            print(f"hetc run: {phase} ({human_seconds(now - self.last)})", file=sys.stderr, flush=True)
        self.last = now


class Reporter:
    def __init__(self, rank: int, plan: Plan, program: Program, opts, device, append: bool = False):
        """`append`: a resumed run adds its steps to the metrics file instead of starting it afresh."""
        self.rank, self.plan, self.program = rank, plan, program
        self.opts, self.device = opts, device
        self.tokens_per_step = plan.train.global_batch * plan.model.seq
        self.flops = flop_counts(plan.model, plan.pipeline)
        self.peak_flops = used_peak_flops(plan.model, plan.pipeline)
        self.store = dist.distributed_c10d._get_default_store()
        writes = opts.metrics is not None and rank == 0
        # open for the whole run, closed by finish()
        self.metrics = open(opts.metrics, "a" if append else "w") if writes else None  # noqa: SIM115
        self.sinks = self._sinks() if rank == 0 else []
        # every rank takes part in gathering the peak memories that a record holds
        self.records = opts.metrics is not None or opts.tensorboard is not None or opts.wandb is not None
        self.traced: list | None = None
        self.step_time = 0.0
        # rank 0's steps since its last step line (--log-every), the last one's (done, total), and the last
        # evaluation among them
        self._unprinted: list[StepResult] = []
        self._line_end = (0, 0)
        self._val_loss: float | None = None

    def step(self, step: int, total: int, result, val_loss: float | None = None) -> None:
        """Report a finished step; `val_loss` when the step was followed by an evaluation."""
        if result.events:
            self.traced, self.step_time = result.events, result.seconds
        peaks = [peak_memory(self.device), peak_memory_reserved(self.device)] if self.records else []
        memories = self._gathered("mem", step, peaks) if self.records else None
        classes = self._gathered("classes", step, result.classes) if self.opts.metrics is not None else None
        if self.rank != 0:
            return
        tps = self.tokens_per_step / result.seconds if result.seconds > 0 else 0.0
        mfu, hfu = self._utilization(result.seconds)
        lr = result.lr      # the rate of this step's update: Note [skipped updates] in runtime/optim.py
        done = step + 1   # Note [step numbers]
        if not self.opts.quiet:
            self._unprinted.append(result)
            self._line_end = (done, total)
            self._val_loss = val_loss if val_loss is not None else self._val_loss
            if done % self.opts.log_every == 0 or done == total:
                self.flush_line()
        if not self.records:
            return
        memories = memories or []
        record = {"step": done, "loss": result.loss, "lr": lr, "step_time_s": result.seconds,
                  "tokens_per_s": tps, "mfu": mfu, "hfu": hfu,
                  "peak_memory_bytes": [allocated for allocated, _ in memories],
                  "peak_memory_reserved_bytes": [reserved for _, reserved in memories], "class_times_s": classes}
        if val_loss is not None:
            record["val_loss"] = val_loss
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        if result.skipped:
            record["skipped"] = True
        if result.loss_scale is not None:
            record["loss_scale"] = result.loss_scale
        for kind, value in result.aux_losses.items():     # Megatron-LM's load_balancing_loss and z_loss
            record[kind.value] = value
        self.event(record)
        for sink in self.sinks:
            sink.add(done, step_scalars(record))

    def flush_line(self) -> None:
        """Rank 0's step line for the steps since the last one (`--log-every`, Megatron-LM's log interval):
        their mean loss and step time, and the last step's learning rate, norm and loss scale; the worker
        calls it too before a stop's message."""
        results = self._unprinted
        if not results:
            return
        (done, total), last = self._line_end, results[-1]
        seconds = sum(r.seconds for r in results) / len(results)
        tps = self.tokens_per_step / seconds if seconds > 0 else 0.0
        mfu, _ = self._utilization(seconds)
        loss = sum(r.loss for r in results) / len(results)
        val = "" if self._val_loss is None else f"  val_loss {self._val_loss:.4f}"
        # the global norm before clipping, where the step computes it (grad_clip), as Megatron-LM's log line
        norm = "" if last.grad_norm is None else f"  grad norm {last.grad_norm:.4g}"
        for kind, value in last.aux_losses.items():       # Megatron-LM's load_balancing_loss and z_loss
            norm += f"  {kind.label} {value:.4f}"
        print(f"step {done}/{total}  loss {loss:.4f}{val}  lr {last.lr:.2e}{norm}  {tps:,.0f} tokens/s  "
              f"MFU {mfu:.1%}  {human_seconds(seconds)}/step{_skip_note(results)}", flush=True)
        self._unprinted, self._val_loss = [], None

    def event(self, record: dict) -> None:
        """A --metrics record on rank 0: a step's, or live rebalancing's detections and changes."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def _sinks(self) -> list[ScalarSink]:
        sinks: list[ScalarSink] = []
        if self.opts.tensorboard is not None:
            sinks.append(TensorBoardSink(self.opts.tensorboard))
        if self.opts.wandb is not None:
            config = {"world_size": self.program.world_size, "global_batch": self.plan.train.global_batch,
                      "seq": self.plan.model.seq, "lr": self.plan.train.lr}
            sinks.append(WandbSink(self.opts.wandb, config))
        return sinks

    def _utilization(self, seconds: float) -> tuple[float, float]:
        """(MFU, HFU) of a step that took `seconds`; 0 where the devices declare no peak."""
        if seconds <= 0 or self.peak_flops <= 0:
            return 0.0, 0.0
        return self.flops.model / (seconds * self.peak_flops), self.flops.hardware / (seconds * self.peak_flops)

    def _gathered(self, kind: str, step: int, mine: list | dict) -> list | None:
        """Every rank's `mine` of `step` (its peak memories, its class times), on rank 0."""
        self.store.set(f"hetc/{kind}/{step}/{self.rank}", json.dumps(mine))
        if self.rank != 0:
            return None
        keys = [f"hetc/{kind}/{step}/{r}" for r in range(self.program.world_size)]
        return [json.loads(v) for v in self.store.multi_get(keys)]   # one round trip, not one per rank

    def finish(self) -> None:
        if self.opts.trace is not None:
            self._write_trace()
        if self.metrics is not None:
            self.metrics.close()
        for sink in self.sinks:
            sink.close()

    def _write_trace(self) -> None:
        mine = (self.traced or [], peak_memory(self.device), self.step_time)
        gathered: list = [None] * self.program.world_size
        collectives.all_gather_object(gathered, mine)
        if self.rank != 0:
            return
        timeline = build_measured_timeline(self.program, self.plan.pipeline, gathered)
        self.opts.trace.write_text(timeline.to_json())
        print(f"trace of the last step: {self.opts.trace}", file=sys.stderr)


def build_measured_timeline(program, pipeline, per_rank: list) -> Timeline:
    """A Timeline from each rank's (events, peak memory, step seconds)."""
    ranks, events, memory, sends, recvs, classes = [], [], [], {}, {}, []
    for r, (evs, peak, _) in enumerate(per_rank):
        rp = program.ranks[r]
        split = class_times(rp.instrs, [start for _, start, _ in evs], max((end for *_, end in evs), default=0.0))
        classes.append({c.value: s for c, s in split.items()})
        gpu = pipeline.world[r]
        ranks.append(RankInfo(r, rp.stage, rp.lane, gpu.device.name, str(gpu), gpu.device.memory))
        for index, start, end in evs:
            instr = rp.instrs[index]
            kind, stream = classify(instr)
            events.append(Event(r, index, str(instr), kind, stream, start, end))
            if isinstance(instr, Send):
                sends[(r, instr.peer_to, instr.what, instr.ms, instr.mb)] = index
            elif isinstance(instr, Recv):
                recvs[(instr.peer_from, r, instr.what, instr.ms, instr.mb)] = index
        memory.append(MemorySample(r, 0.0, peak))
    flows = [Flow(key[0], s_index, key[1], recvs[key], 0.0) for key, s_index in sends.items() if key in recvs]
    step_time = max((t for _, _, t in per_rank), default=0.0)
    plan = (("schedule", pipeline.schedule.value), ("ranks", str(program.world_size)),
            ("stages", str(len(pipeline.stages))), ("microbatches", str(pipeline.num_microbatches)),
            ("measured step time", f"{step_time:.4f} s"))
    return Timeline("measured", tuple(ranks), tuple(events), tuple(flows), tuple(memory), step_time, plan,
                    tuple(classes))
