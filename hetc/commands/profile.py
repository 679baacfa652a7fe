"""`hetc profile`: measure this machine into a profile file the cost model reads.

Per-layer forward/backward times of a model (from SPEC, or from flags) over
a few micro-batch sizes and sequence lengths, collective and point-to-point
rates between local processes, host<->device copy rates, and (CPU ranks
that run several at once) the wait of a blocking call for a core while the
others compute (Note [core wait] in passes/cost/cores.py). The format is
hetc.passes.cost.sources.hetc_profile; `hetc explain SPEC --profile FILE` uses it
for GPUs of the measured device kind. On a machine with fewer GPUs than
the processes a measurement needs, it is skipped, said so, and left out of
the file (Note [Only what was measured] in runtime/measure.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from hetc.commands import Subparsers
from hetc.ir.errors import Diagnostic, UsageError
from hetc.passes.cost.params import block_params
from hetc.runtime.host_load import cpu_times, steal_share
from hetc.ir.spec import Arch, DeviceSpec, DType, ModelSpec, NodeSpec, Spec

__all__ = ["ranks_at_once", "register", "run"]

DEFAULT_SIZES = "65536,1048576"
COPY_SIZES = [1 << 20, 16 << 20]
# blocking calls per --repeats timed for their wait for a core (Note [core wait] in passes/cost/cores.py)
CORE_WAIT_CALLS = 8


def register(sub: Subparsers) -> None:
    p = sub.add_parser("profile", help="measure the local device into a profile file",
                       description="Time hetc's layers forward and backward, local collectives and point-to-"
                                   "point transfers, and host<->device copies. The default run takes seconds "
                                   "on a CPU.")
    p.add_argument("spec", nargs="?", metavar="SPEC", help="take the model from this spec")
    p.add_argument("-o", "--output", default="profile.json", metavar="FILE",
                   help="where to write (profile.json)")
    p.add_argument("--device-kind", metavar="NAME",
                   help="the catalog device kind measured (default: from the CUDA device name, or cpu); it "
                        "must be this machine's: a GPU kind needs a GPU here, and `cpu` none")
    p.add_argument("--micro-batches", default="1,2", metavar="B,B", help="micro-batch sizes (1,2)")
    p.add_argument("--seqs", metavar="S,S", help="sequence lengths (default: the model's)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point, after one warm-up (3)")
    p.add_argument("--ranks", type=int, default=2, help="local processes for collectives and p2p (2)")
    p.add_argument("--ranks-at-once", type=int, metavar="N",
                   help="time the layers in N processes at once, as a node runs its ranks (default: with SPEC, "
                        "the ranks its cluster runs on this machine for the measured kind; else 1)")
    p.add_argument("--comm-sizes", default=DEFAULT_SIZES, metavar="BYTES,BYTES",
                   help=f"message sizes for collectives and p2p ({DEFAULT_SIZES})")
    p.add_argument("--no-comm", action="store_true", help="skip collectives and p2p")
    model = p.add_argument_group("model (without SPEC)")
    model.add_argument("--arch", default="llama", choices=[a.value for a in Arch])
    model.add_argument("--hidden", type=int, default=256)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int)
    model.add_argument("--ffn", type=int, default=704)
    model.add_argument("--vocab", type=int, default=1024)
    model.add_argument("--seq", type=int, default=128)
    model.add_argument("--dtype", default="fp32", choices=[d.value for d in DType])
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise UsageError(f"{what} must be positive integers, got '{text}'")
    return values


def _spec(args: argparse.Namespace) -> tuple[Spec | None, list[tuple[Path, str]]]:
    """The spec SPEC names (None without one), and what it reads (Note [output files])."""
    if not args.spec:
        return None, []
    from hetc.compiler import load_checked

    loaded, checked = load_checked(args.spec)
    if checked.spec.model is None:
        raise UsageError(f"{args.spec} has no model block")
    return checked.spec, loaded.inputs()


def ranks_at_once(spec: Spec | None, kind: str) -> int:
    """How many ranks of the measured kind run at once on this machine (Note [shared cores]): a local run
    (`cpu` kinds) starts every rank of the cluster here, a GPU node its GPUs."""
    if spec is None or spec.cluster is None:
        return 1
    nodes = [n for n in spec.cluster.nodes if n.device == kind]
    if not nodes:
        return 1
    if kind.lower().startswith("cpu"):
        return sum(n.count * n.gpus for n in nodes)
    return max(n.gpus for n in nodes)


def _check_kind(kind: str, backend: str, name: str) -> None:
    """--device-kind names the device measured: a GPU kind only with a GPU, a `cpu...` kind only without one
    (Note [Only what was measured] in runtime/measure.py); else the CPU's layers, memory copies and loopback
    gloo would be recorded as a GPU's compute, host link and interconnect, or a GPU's as a CPU rank's."""
    is_cpu = DeviceSpec(name=kind, memory=1).is_cpu
    if backend == "cuda" and is_cpu:
        raise UsageError(f"--device-kind {kind}: this machine measures its GPU ({name}); a `cpu` kind stands for "
                         "a CPU rank of a local run: profile it on a machine without a GPU (or with "
                         "CUDA_VISIBLE_DEVICES= to hide them)")
    if backend != "cuda" and not is_cpu:
        raise UsageError(f"--device-kind {kind}: this machine has no GPU, and hetc profile records only what it "
                         f"measured on the device it describes: run it on a machine with a {kind}, or leave "
                         "--device-kind out (this machine's profile is kind cpu)")


def _model(args: argparse.Namespace, spec: Spec | None) -> ModelSpec:
    if spec is not None and spec.model is not None:   # _spec refuses a spec without a model
        return spec.model
    flags = {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "ffn": args.ffn,
             "vocab": args.vocab, "seq": args.seq}
    for field, value in flags.items():
        _within(ModelSpec, field, f"--{field.replace('_', '-')}", value)
    model = ModelSpec(name="profiled", arch=Arch(args.arch), layers=1, dtype=DType(args.dtype), **flags)
    from hetc.passes.validate import check_model

    errors: list[Diagnostic] = []
    check_model(model, errors)      # the rules a spec's model block is held to
    if errors:
        raise UsageError("; ".join(e.message for e in errors))
    return model


def _within(node: type, field: str, flag: str, value: int | None) -> None:
    """A flag within the bounds of the spec field it stands for (the front end's, hetc/ir/spec.py)."""
    from hetc.frontend.schema import fields_of

    meta = next(info.meta for info in fields_of(node) if info.name == field)
    if value is not None and ((meta.lo is not None and value < meta.lo) or (meta.hi is not None and value > meta.hi)):
        raise UsageError(f"{flag} must be between {meta.lo:,.0f} and {meta.hi:,.0f}, got {value}")


class _Progress:
    """One status line on stderr, rewritten in place."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.what = "starting"     # the measurement in progress

    def __call__(self, what: str) -> None:
        self.what = what
        line = f"hetc profile: {what} ({time.perf_counter() - self.start:.1f} s)"
        text, end = (f"\r{line:<72}", "") if self.tty else (line, "\n")
        print(text, end=end, file=sys.stderr, flush=True)

    def done(self, path: Path) -> None:
        self(f"wrote {path}")
        if self.tty:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    spec, reads = _spec(args)
    model = _model(args, spec)
    micro_batches = _ints(args.micro_batches, "--micro-batches")
    seqs = _ints(args.seqs, "--seqs") if args.seqs else [model.seq]
    sizes = _ints(args.comm_sizes, "--comm-sizes")
    if args.repeats < 1 or args.ranks < 2:
        raise UsageError("--repeats must be at least 1 and --ranks at least 2")
    _within(NodeSpec, "gpus", "--ranks", args.ranks)    # processes on this machine: at most a node's ranks
    _within(NodeSpec, "gpus", "--ranks-at-once", args.ranks_at_once)
    from hetc.ir.outdir import check_output_file

    check_output_file(Path(args.output), "-o", reads)
    progress = _Progress()
    progress("starting")
    try:
        return _measure(args, spec, model, (micro_batches, seqs, sizes), progress)
    except Exception as err:
        if not _out_of_memory(err):
            raise
        raise UsageError(f"this machine ran out of memory measuring ({progress.what}): measure smaller shapes "
                         "(--hidden, --ffn, --vocab, --micro-batches, --seqs, --comm-sizes)") from None


def _out_of_memory(err: BaseException) -> bool:
    """An allocation that failed, here or in a measuring process (whose error arrives as text)."""
    import torch

    return isinstance(err, MemoryError | torch.OutOfMemoryError) or \
        any(text in str(err) for text in ("can't allocate memory", "CUDA out of memory", "MemoryError"))


def _measure(args: argparse.Namespace, spec: Spec | None, model: ModelSpec,
             shapes: tuple[list[int], list[int], list[int]], progress: _Progress) -> int:
    """Measure this machine and write the profile (the flags are checked)."""
    micro_batches, seqs, sizes = shapes
    load_before, ticks_before = os.getloadavg()[0], cpu_times()
    import torch

    from hetc.passes.cost.sources.devices import catalog_name
    from hetc.passes.cost.sources.hetc_profile import write_profile
    from hetc.runtime import measure

    device = measure.local_device()
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"
    kind = args.device_kind or (catalog_name(name) if device.type == "cuda" else "cpu")
    _check_kind(kind, device.type, name)
    at_once = args.ranks_at_once or ranks_at_once(spec, kind)
    can = measure.measurable(gpus, args.ranks, at_once, comm=not args.no_comm)
    for line in can.skipped:
        print(f"hetc profile: not measured: {line}", file=sys.stderr, flush=True)
    layers = measure.time_layers(model, micro_batches, seqs, args.repeats, progress)
    concurrency = {}
    if can.layers_at_once > 1:
        progress(f"layers in {at_once} processes at once")
        loaded = measure.time_layers_at_once(model, micro_batches, seqs, args.repeats, at_once)
        concurrency = {"concurrency": {"ranks": at_once, "cores": len(os.sched_getaffinity(0)),
                                       "slowdown": measure.slowdown(layers, loaded)}}
    progress("host<->device copies")
    copies = measure.copy_rates(COPY_SIZES, args.repeats)
    comm = {}
    if can.comm_at_once is not None:
        progress(f"collectives and p2p between {args.ranks} processes, "
                 f"{measure.comm_world(args.ranks, can.comm_at_once)} at once")
        collectives, p2p = measure.comm_rates(args.ranks, sizes, args.repeats, can.comm_at_once)
        comm = {"collectives": collectives, "p2p": p2p}
    core_wait = {}
    if can.comm_at_once is not None and at_once > 1 and device.type == "cpu":
        from hetc.runtime.core_wait import measure_core_wait

        progress(f"blocking calls between {at_once} processes computing beside them")
        sample = measure_core_wait(model, micro_batches[0], at_once, CORE_WAIT_CALLS * args.repeats)
        core_wait = {"core_wait": sample.to_json()}
    memory = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 0
    out = Path(args.output)
    write_profile(out, {
        "device": {"kind": kind, "name": name, "backend": device.type, "memory": memory,
                   "count": torch.cuda.device_count() if device.type == "cuda" else 1},
        "dtype": model.dtype.value,
        "model": {"name": model.name, "arch": model.arch.value, "hidden": model.hidden, "heads": model.heads,
                  "kv_heads": model.num_kv_heads, "ffn": model.ffn, "vocab": model.vocab,
                  "block_params": block_params(model)},
        "layers": [{"layer": s.layer, "tp": 1, "seq": s.seq, "micro_batch": s.micro_batch,
                    "forward_s": s.forward_s, "backward_s": s.backward_s} for s in layers],
        **comm, "copy": copies,
        **concurrency, **core_wait,
        **({"not_measured": list(can.skipped)} if can.skipped else {}),
    })
    progress.done(out)
    _warn_if_loaded(load_before)
    _warn_if_stolen(steal_share(ticks_before, cpu_times()))
    return 0


def _warn_if_loaded(load_before: float) -> None:
    """Other work on the machine while it was measured is in the slowdown and the waits (Note [core wait])."""
    cores = len(os.sched_getaffinity(0))
    load = max(load_before, os.getloadavg()[0])
    if load > cores:
        print(f"hetc profile: warning: the machine's load average reached {load:.1f} on {cores} cores while it "
              "was measured; other work is in the measured slowdown and waits: profile again when the machine "
              "is as loaded as when it will run", file=sys.stderr)


# Above this share of the CPU time taken by the hypervisor (runtime/host_load.py), measurements on a virtual
# machine moved by more than the cost model's tolerances from one run to the next (docs/costmodel.md).
STEAL_WARNING = 0.05


def _warn_if_stolen(steal: float | None) -> None:
    """The host ran other machines on this one's cores while it was measured: what it timed varies with them."""
    if steal is not None and steal > STEAL_WARNING:
        print(f"hetc profile: warning: the host took {steal:.0%} of this virtual machine's CPU time while it was "
              "measured (steal time); the times include other machines' work and change with it: profile again "
              "when the host is quieter, or on a machine of its own", file=sys.stderr)
