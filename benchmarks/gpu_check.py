"""One GPU, one script: what a session that holds a GPU for minutes runs once. docs/benchmarks.md "GPU".

    .venv/bin/python benchmarks/gpu_check.py [--out DIR] [--cpu] [--quick] [--budget S] [--only NAMES]

The checks, most useful first, each under its own time limit (one that overruns is recorded as
timed out and the script goes on), all within `--budget` seconds (480: eight minutes on one H200):

1. versions: torch, CUDA, NCCL, the driver and the device, through torch.cuda.
2. verify (three rows): `hetc compile`, then `hetc verify --backend nccl`, of a ~1B bf16 Llama on
   H200s in a 1-rank plan, a Zorse-offload plan and a 2-stage plan (benchmarks/specs/gpu_check/).
   A plan that does not verify under NCCL's rules is recorded (`fail`, with the verifier's first line).
3. the device against the cost model's constants (Issue 32's open figures, before the longer runs):
   the matmul asymptote: one bf16 matmul (8192³) back to back for 30 s, its first second's rate
   and its last quarter's, against the catalog kind's bf16 peak, with the SM clock `nvidia-smi` reads
   at the end: the burst rate is what published matmul maxima measure, the sustained one what a
   training step gets once the device is at its power limit (docs/costmodel.md "Compute time by shape").
   The streaming bandwidth: c = a + b over tensors of 512 MiB for 5 s (two read, one written), its
   median rate against the kind's datasheet `memory_bandwidth`: the fraction the cost model times every
   memory-bound byte at (0.9, Note [streaming bandwidth] in passes/cost/compute.py; target within 5 %).
   The GEMM curve: each published run's block GEMMs (benchmarks/published_runs.py) in nn.Linear's three
   layouts, and causal flash attention where the run used it, timed here against Note [GEMM curve]'s time
   for the same shape on this kind: what the published runs' compute rests on, shape by shape.
4. profile: `hetc profile` of the run model on this device (layers only: `--no-comm`, one GPU has
   no link to measure).
5. step time and peak memory: a 1-rank bf16 run of the run model, compiled with that profile;
   the median step (steps 3..K) against summary.json's prediction (target within 15 %), and CUDA's
   peak allocated bytes against `hetc explain --json`'s estimate of what the rank allocates, its
   total less the reserve (target within 10 %; the reserved peak is recorded beside it).
6. offload overlap: a 1-rank plan sweeping two ministages with parameters and activations on the
   host, under torch.profiler: the share of the device's copy time hidden behind kernels.
7. resume: `hetc run --local` of half the steps with --checkpoint, then --resume to the end; the
   resumed losses must continue the uninterrupted run's (check 5's).
8. 2-stage: the 2-stage plan on this one GPU, both ranks on it, point-to-point through gloo with
   CUDA tensors (host-staged). The runtime starts CUDA ranks on NCCL (runtime/worker.py), so on a
   GPU this is recorded as `unsupported` with the error it gave, until the runtime has that path.
9. fp16 loss scale: the 1-rank plan in fp16 with grad_clip, its dynamic loss scale on every step
   (runtime/loss_scale.py): the precision of V100s and T4s, through CUDA's fp16 kernels.
10. loss falls: every run above ends below where it started.

`--cpu` runs the same sequence on this machine's CPU as a dry run: the demo model (specs/demo/), a
`cpu` device kind, gloo; the verify rows still compile the 1B plans for H200s (compiling needs no
device). `--quick` shortens every run. Writes DIR/gpu_check.json and DIR/gpu_check.md (DIR: --out,
else $OUT/gpu_check when $OUT is set, else a new folder under /tmp) and prints the table. Exit 1 when
a check errored or timed out; a target missed or a plan that deadlocks under NCCL is data (exit 0).
Everything runs through hetc's CLI (`python -m hetc`, or hetc.cli.main in benchmarks/gpu_check_rank.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetc.ir.spec import DeviceSpec, ModelSpec
    from hetc.passes.cost.gemm import DeviceFacts, Gemm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PLANS = ROOT / "benchmarks" / "specs" / "gpu_check"
CATALOG = ROOT / "specs" / "catalog.het"
TEXT = ROOT / "specs" / "demo" / "data" / "tiny.txt"   # byte-level text: travels with the repository
HETC = [sys.executable, "-m", "hetc"]
RANK = [sys.executable, str(ROOT / "benchmarks" / "gpu_check_rank.py")]

STEP_TOLERANCE = 0.15
MEMORY_TOLERANCE = 0.10
STREAMING_TOLERANCE = 0.05   # the streaming fraction measured, against Note [streaming bandwidth]'s 0.9
RESUME_RTOL = 0.02       # bf16 kernels need not repeat bit for bit; a resume that lost state is far off
SKIP = 2                 # steps 1 and 2 warm up: the measured step is the median of steps 3..K
FAILING = ("error", "timeout")


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    dtype: str = "bf16"


@dataclass(frozen=True)
class Job:
    """What job.het says beside the model: the device kind of the node's four GPUs, batch and data."""

    model: Model
    device: str
    global_batch: int
    micro_batch: int
    text_data: bool        # the repository's byte-level text (the loss falls), else synthetic tokens
    grad_clip: float = 0.0


LLAMA_1B = Model("llama1b", 16, 2048, 32, 8, 8192, 128256, 2048)      # Llama 3.2 1B's shape
RUN_GPU = Model("small", 12, 1024, 16, 8, 2816, 256, 1024)            # ~0.15B, ~60 ms a step on an H200
RUN_CPU = Model("demo", 4, 64, 4, 2, 176, 256, 32)                    # specs/demo/job.het's model
VERIFY_JOB = Job(LLAMA_1B, "H200", global_batch=16, micro_batch=2, text_data=False)


def job_text(job: Job) -> str:
    """job.het for the plans of benchmarks/specs/gpu_check/ (they `use` it)."""
    m = job.model
    data = f'text {{\n    path = "{TEXT}"\n  }}' if job.text_data else "synthetic {}"
    return f"""use "{CATALOG}"

model {m.name} {{
  arch = llama
  layers = {m.layers}
  hidden = {m.hidden}
  heads = {m.heads}
  kv_heads = {m.kv_heads}
  ffn = {m.ffn}
  vocab = {m.vocab}
  seq = {m.seq}
  dtype = {m.dtype}
  optimizer adamw {{
    beta1 = 0.9
    beta2 = 0.95
    weight_decay = 0.1
  }}
}}

cluster one_node {{
  node gpu {{
    device = {job.device}
    count = 1
    gpus = 4
    intra {{
      bandwidth = 450 GB/s
      latency = 5 us
    }}
  }}
}}

train {{
  global_batch = {job.global_batch}
  micro_batch = {job.micro_batch}
  steps = 20
  lr = 1e-3
  seed = 1234
  grad_clip = {job.grad_clip}
  data {data}
}}
"""


def write_plans(job: Job, dest: Path) -> Path:
    """The gpu_check plans with their job.het in `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for plan in PLANS.glob("*.het"):
        shutil.copy(plan, dest / plan.name)
    (dest / "job.het").write_text(job_text(job))
    return dest


@dataclass
class Row:
    check: str
    status: str                 # ok, fail, n/a, unsupported, skipped, error, timeout
    value: str = ""
    target: str = ""
    detail: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


class CheckTimeout(Exception):
    pass


class CheckError(Exception):
    """A step a check needs failed; `tail` is the end of its output, kept in the JSON for whoever reads it."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(message)
        self.tail = tail


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str

    def last_line(self) -> str:
        lines = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return next((line for line in lines if line.startswith("error")), lines[-1] if lines else "")[:400]

    def tail(self) -> str:
        return (self.stderr or self.stdout)[-3000:]


@dataclass
class Context:
    """What the checks share: the mode, the folders, the time left, and what earlier checks found."""

    gpu: bool
    quick: bool
    work: Path
    kind: str                                    # the catalog's name for this device ("cpu" for --cpu)
    deadline: float = 0.0                        # the running check's (time.monotonic)
    profile: Path | None = None                  # check 4's
    reference_losses: list[float] = field(default_factory=list)   # check 5's uninterrupted run
    losses: dict[str, list[float]] = field(default_factory=dict)  # every run's, for check 9

    @property
    def steps(self) -> int:
        return (6 if self.quick else 8) if not self.gpu else (8 if self.quick else 12)

    def job(self) -> Job:
        if self.gpu:
            return Job(RUN_GPU, self.kind, global_batch=32, micro_batch=8, text_data=True)
        return Job(RUN_CPU, self.kind, global_batch=8, micro_batch=2, text_data=True)

    def call(self, argv: list[str], env: dict[str, str] | None = None) -> Done:
        """Run `argv` until this check's deadline; kill its whole process group if it overruns."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CheckTimeout("no time left")
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            stop_session(proc)
            raise CheckTimeout(" ".join(argv[2:5])) from None
        return Done(proc.returncode, out, err)

    def hetc(self, *argv: str) -> Done:
        return self.call([*HETC, *argv])

    def must(self, *argv: str) -> Done:
        """`hetc ARGV`, which must succeed for the check to go on."""
        done = self.hetc(*argv)
        if done.returncode != 0:
            raise CheckError(f"hetc {argv[0]} exited {done.returncode}: {done.last_line()}", done.tail())
        return done

    def run_plans(self) -> Path:
        return write_plans(self.job(), self.work / "run")


def stop_session(proc: subprocess.Popen[str]) -> None:
    """End a command that overran, and every process it started: SIGTERM first (`hetc run --local` passes
    it to its ranks, which finish or save), then SIGKILL to the whole session. The ranks run in process
    groups of their own (runtime/local.py) but stay in the session the command was started in."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:   # a process outside the session still holds its output open
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()


def _session_members(session: int) -> list[int]:
    """The processes of session `session` (/proc/PID/stat's sixth field), on Linux."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:   # after the name: state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if line.strip()]


def within(ratio: float, tolerance: float) -> str:
    return "ok" if abs(ratio - 1) <= tolerance else "fail"


# ---- the checks, in order -------------------------------------------------------------------------

def check_versions(ctx: Context) -> list[Row]:
    import torch
    found: dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()   # a tuple in torch 2.x, an int before
        found.update(nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), device=props.name,
                     device_memory_gib=round(props.total_memory / 2**30, 1),
                     capability=f"{props.major}.{props.minor}", driver=_driver_version(torch))
    found["kind"] = ctx.kind
    value = ", ".join(f"{k} {v}" for k, v in found.items() if k != "cuda_available")
    return [Row("versions", "ok", value, data=found)]


def _driver_version(torch: ModuleType) -> str:
    """The CUDA driver's version as torch.cuda sees it (`nvidia-smi` where this build does not say)."""
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    if getter is not None:
        raw = int(getter())
        return f"{raw // 1000}.{raw % 1000 // 10}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30, check=False)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "unknown"


def check_verify(plan: str) -> Callable[[Context], list[Row]]:
    def check(ctx: Context) -> list[Row]:
        specs = write_plans(VERIFY_JOB, ctx.work / "verify")
        out = ctx.work / "verify" / f"out_{plan}"
        name = f"verify 1B {plan} (nccl)"
        compiled = ctx.hetc("compile", str(specs / f"{plan}.het"), "-o", str(out))
        if compiled.returncode != 0:   # compile verifies too (for the plan's backend, once it does)
            return [Row(name, "fail", "compile failed", "verifies", compiled.last_line(),
                        data={"output_tail": compiled.tail()})]
        done = ctx.hetc("verify", "--backend", "nccl", str(out))
        summary = json.loads((out / "summary.json").read_text())
        value = f"{summary.get('step_time_s', 0) * 1e3:.0f} ms/step predicted"
        if done.returncode == 0:
            return [Row(name, "ok", value, "verifies", done.stdout.strip().split(": ", 1)[-1][:400])]
        return [Row(name, "fail", value, "verifies", done.last_line(), data={"output_tail": done.tail()})]
    return check


def check_profile(ctx: Context) -> list[Row]:
    specs = ctx.run_plans()
    out = ctx.work / "profile.json"
    quick = ["--repeats", "1"] if ctx.quick else []
    kind = ["--device-kind", ctx.kind] if ctx.gpu else []
    # the run's micro-batch, in one process: the 1-rank plans it serves run one rank on the device
    ctx.must("profile", str(specs / "single.het"), "-o", str(out), "--no-comm", "--ranks-at-once", "1",
             "--micro-batches", str(ctx.job().micro_batch), *kind, *quick)
    ctx.profile = out
    device = json.loads(out.read_text()).get("device", {})
    return [Row("profile", "ok", f"{device.get('name', '?')} ({device.get('kind', '?')})", "measured",
                f"{out.stat().st_size / 1024:.0f} KiB; layers only (--no-comm)")]


def check_one_rank(ctx: Context) -> list[Row]:
    specs = ctx.run_plans()
    profile = ["--profile", str(ctx.profile)] if ctx.profile else []
    plan = ctx.work / "run" / "out_single"
    ctx.must("compile", str(specs / "single.het"), "-o", str(plan), *profile)
    predicted = json.loads((plan / "summary.json").read_text())["step_time_s"]
    explained = json.loads(ctx.must("explain", "--json", *profile, str(specs / "single.het")).stdout)
    estimate = explained["memory"][0]
    metrics, result = ctx.work / "run" / "single.jsonl", ctx.work / "run" / "single.json"
    done = ctx.call([*RANK, str(plan), str(result), "--steps", str(ctx.steps), "--metrics", str(metrics)])
    if done.returncode != 0:
        raise CheckError(f"the 1-rank run exited {done.returncode}: {done.last_line()}", done.tail())
    ctx.reference_losses = ctx.losses["1-rank"] = losses(metrics)
    step = _step_row(metrics, predicted)
    step.detail = "costed from: " + ", ".join(Path(s).name for s in explained["sources"].get("0", []))
    return [step, _memory_row(json.loads(result.read_text()), metrics, estimate)]


def _step_row(metrics: Path, predicted: float) -> Row:
    steps = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][SKIP:]
    measured = statistics.median(steps)
    ratio = measured / predicted
    return Row("step time, 1 rank", within(ratio, STEP_TOLERANCE),
               f"{measured * 1e3:.1f} ms measured / {predicted * 1e3:.1f} ms predicted = {ratio:.2f}",
               f"within {STEP_TOLERANCE:.0%}", data={"measured_s": measured, "predicted_s": predicted, "ratio": ratio})


def _memory_row(result: dict[str, Any], metrics: Path, estimate: dict[str, float]) -> Row:
    """CUDA's peak allocations against the estimate less its reserve (which the allocator does not see);
    on a CPU rank, the process's peak resident memory against the whole estimate."""
    if result["cuda"]:
        measured, expected, what = result["max_memory_allocated"], estimate["total"] - estimate["reserve"], \
            "allocated"
    else:
        last = json.loads(metrics.read_text().splitlines()[-1])
        measured, expected, what = last["peak_memory_bytes"][0], estimate["total"], "resident"
    ratio = measured / expected
    reserved = result["max_memory_reserved"]
    beside = f"; reserved {reserved / 2**30:.2f} GiB ({reserved / expected:.2f})" if reserved else ""
    return Row("peak memory, 1 rank", within(ratio, MEMORY_TOLERANCE),
               f"{what} {measured / 2**30:.2f} GiB / estimate {expected / 2**30:.2f} GiB = {ratio:.2f}{beside}",
               f"within {MEMORY_TOLERANCE:.0%}", data={"measured": measured, "estimate": expected, "ratio": ratio,
                                                        "max_memory_reserved": reserved, "estimate_parts": estimate})


def check_matmul(ctx: Context) -> list[Row]:
    import torch

    from hetc.ir.spec import DType

    n, seconds, dtype = (8192, 30.0, torch.bfloat16) if ctx.gpu else (384, 1.0 if ctx.quick else 4.0, torch.float32)
    device = "cuda" if ctx.gpu else "cpu"
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    rates = _timed_rates(torch, device, lambda: torch.mm(a, b), 2.0 * n ** 3, seconds,
                         batch=20 if ctx.gpu else 2, warmup=2)   # cuBLAS's heuristics and the allocator
    kind = _catalog_kind(ctx)
    peak = kind.peak.for_dtype(DType.BF16 if ctx.gpu else DType.FP32) if kind else None
    burst = statistics.median(r for t, r in rates if t <= 1.0)
    sustained = statistics.median(r for t, r in rates if t >= 0.75 * seconds)
    share = (lambda r: f" ({r / peak:.2f} of peak)") if peak else (lambda r: "")
    clock = _sm_clock() if ctx.gpu else {}
    value = (f"burst {burst / 1e12:.3g} TFLOP/s{share(burst)}, sustained {sustained / 1e12:.3g}{share(sustained)}"
             + (f"; SM {clock['sm']} of {clock['max']} MHz at {clock['power']} W" if clock else ""))
    return [Row("matmul asymptote", "ok", value, "recorded: the kind's `efficiency` (docs/costmodel.md)",
                f"{n}³ {str(dtype).split('.')[-1]} for {seconds:.0f} s",
                data={"rates": rates, "burst": burst, "sustained": sustained, "peak": peak, **clock})]


def check_streaming(ctx: Context) -> list[Row]:
    import torch

    from hetc.passes.cost.compute import STREAM_FRACTION

    device, dtype = ("cuda", torch.bfloat16) if ctx.gpu else ("cpu", torch.float32)
    numel = (256 << 20) if ctx.gpu else (8 << 20)   # 512 MiB of bf16 a tensor on a GPU, 32 MiB on the CPU
    seconds = 5.0 if ctx.gpu else (0.5 if ctx.quick else 2.0)
    a, b, c = (torch.ones(numel, dtype=dtype, device=device) for _ in range(3))
    # c = a + b: two tensors read, one written
    rates = [r for _, r in _timed_rates(torch, device, lambda: torch.add(a, b, out=c), 3.0 * numel * a.element_size(),
                                         seconds, batch=10, warmup=1)]
    kind = _catalog_kind(ctx)
    datasheet = kind.memory_bandwidth if kind else 0.0
    rate = statistics.median(rates)
    if not datasheet:
        return [Row("streaming bandwidth", "n/a", f"{rate / 1e9:.3g} GB/s", "no datasheet rate for this kind",
                    data={"rates": rates})]
    fraction = rate / datasheet
    return [Row("streaming bandwidth", within(fraction / STREAM_FRACTION, STREAMING_TOLERANCE),
                f"{rate / 1e9:.4g} GB/s of the datasheet's {datasheet / 1e9:.4g} = {fraction:.2f}",
                f"{STREAM_FRACTION} within {STREAMING_TOLERANCE:.0%}", f"c = a + b, {numel:,} elements a tensor",
                data={"rates": rates, "rate": rate, "datasheet": datasheet, "fraction": fraction})]


def _published_blocks() -> list[tuple[str, ModelSpec, int, int]]:
    """(run, model, micro-batch, tp) of each published run whose block shape differs (benchmarks/published_runs.py):
    the GEMM shapes the published-runs benchmark times on the analytic path."""
    from benchmarks.published_runs import RUNS, spec_text
    from hetc.frontend.load import load_spec

    found, seen = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            key = (run.hidden, run.heads, run.kv_heads, run.ffn, run.seq, run.micro_batch, run.tp)
            if key in seen:
                continue
            seen.add(key)
            path = Path(tmp) / "run.het"
            path.write_text(spec_text(run))
            model = load_spec(path).spec.model
            assert model is not None, run.name
            found.append((run.name, model, run.micro_batch, run.tp))
    return found


def check_gemm_curve(ctx: Context) -> list[Row]:
    """Each published run's block GEMMs (forward, input-gradient and weight-gradient layouts, as nn.Linear runs
    them) and flash attention, timed here, against what Note [GEMM curve] gives this kind for the same shape."""
    import torch

    from hetc.ir.spec import AttentionKind
    from hetc.passes.cost.compute import streaming_bandwidth
    from hetc.passes.cost.gemm import DeviceFacts, attention_efficiency, block_gemms

    kind = _catalog_kind(ctx)
    if kind is None or not kind.sms:
        return [Row("GEMM curve", "n/a", detail="needs a device kind the catalog names with its SM count")]
    device = "cuda" if ctx.gpu else "cpu"
    seconds = 0.05 if ctx.quick else 0.2
    runs, shapes, attention = [], [], []
    for name, model, micro_batch, tp in _published_blocks():
        facts = DeviceFacts.of(kind, model, streaming_bandwidth(kind))
        timed = [t for g in block_gemms(model, micro_batch * model.seq, tp)
                 for t in _time_linear(torch, device, g, facts, seconds)]
        shapes += [{"run": name, **t} for t in timed]
        ratio = sum(t["model_s"] for t in timed) / sum(t["measured_s"] for t in timed)
        runs.append({"run": name, "block_gemms_model_over_measured": ratio})
        if model.attention is AttentionKind.FLASH:
            heads, d = micro_batch * model.heads // tp, model.head_size
            forward, backward = _time_flash(torch, device, heads, model.seq, d, seconds)
            attention.append({"run": name, "seq": model.seq, "head": d, "forward": forward / facts.peak,
                              "backward": backward / facts.peak,
                              "model_forward": attention_efficiency(model.seq, d, facts),
                              "model_backward": attention_efficiency(model.seq, d, facts, backward=True)})
    ratios = [r["block_gemms_model_over_measured"] for r in runs]
    worst = max(runs, key=lambda r: abs(r["block_gemms_model_over_measured"] - 1))
    implied = implied_asymptote(shapes, kind.efficiency)
    value = (f"model / measured block GEMM time: mean {statistics.mean(ratios):.3f}, worst "
             f"{worst['block_gemms_model_over_measured']:.3f} ({worst['run']}); {len(shapes)} shapes"
             + (f"; asymptote implied by the compute-bound ones {implied:.3f} (catalog {kind.efficiency})"
                if implied is not None else ""))
    value += "".join(f"; {a['run']} attention fwd {a['forward']:.2f} (model {a['model_forward']:.2f}), bwd "
                     f"{a['backward']:.2f} (model {a['model_backward']:.2f}) of peak" for a in attention)
    return [Row("GEMM curve", "ok", value, "recorded: Note [GEMM curve] against this kind",
                f"the published runs' block shapes, bf16, {seconds} s a shape",
                data={"runs": runs, "shapes": shapes, "attention": attention, "implied_asymptote": implied})]


def _time_linear(torch: ModuleType, device: str, g: Gemm, facts: DeviceFacts, seconds: float) -> list[dict[str, Any]]:
    """One nn.Linear's three multiplies at `g`'s shape (y = x·wᵀ, dx = dy·w, dw = dyᵀ·x), each measured and as
    Note [GEMM curve] times it."""
    from hetc.passes.cost.gemm import gemm_seconds

    x = torch.randn(g.m, g.k, dtype=torch.bfloat16, device=device)
    w = torch.randn(g.n, g.k, dtype=torch.bfloat16, device=device)
    dy = torch.randn(g.m, g.n, dtype=torch.bfloat16, device=device)
    dgrad, wgrad = g.backward()
    found = []
    for layout, shape, run in (("fprop", g, lambda: x @ w.t()), ("dgrad", dgrad, lambda: dy @ w),
                               ("wgrad", wgrad, lambda: dy.t() @ x)):
        rate = _median_rate(torch, device, run, shape.flops, seconds)
        model_s = gemm_seconds(shape, facts)
        # compute-bound in the model where its time is the tiles' alone (the roofline's streaming not longer)
        tiles_s = gemm_seconds(shape, dataclasses.replace(facts, memory_bandwidth=math.inf))
        found.append({"layout": layout, "m": shape.m, "n": shape.n, "k": shape.k, "measured_s": shape.flops / rate,
                      "model_s": model_s, "measured": rate / facts.peak, "model": shape.flops / model_s / facts.peak,
                      "compute_bound": tiles_s >= model_s})
    return found


def implied_asymptote(shapes: list[dict[str, Any]], asymptote: float) -> float | None:
    """The asymptote at which the model's time of the compute-bound shapes (their time scales as 1/asymptote)
    sums to what was measured: the `efficiency` the catalog's kind would take from this device."""
    bound = [s for s in shapes if s["compute_bound"]]
    if not bound:
        return None
    return asymptote * sum(s["model_s"] for s in bound) / sum(s["measured_s"] for s in bound)


def _time_flash(torch: ModuleType, device: str, heads: int, seq: int, d: int, seconds: float) -> tuple[float, float]:
    """FLOP/s of causal scaled-dot-product attention's forward and backward (half the square's work each)."""
    import torch.nn.functional as F

    from hetc.passes.cost.gemm import CAUSAL_WORK

    q, k, v = (torch.randn(1, heads, seq, d, dtype=torch.bfloat16, device=device, requires_grad=True)
               for _ in range(3))
    work = 4.0 * heads * seq ** 2 * d * CAUSAL_WORK
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    return (_median_rate(torch, device, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), work,
                         seconds),
            _median_rate(torch, device, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                         2 * work, seconds))


def _median_rate(torch: ModuleType, device: str, run: Callable[[], Any], work: float, seconds: float) -> float:
    """The median `work` per second of batches of five `run()`s over `seconds` (`_timed_rates`)."""
    return statistics.median(r for _, r in _timed_rates(torch, device, run, work, seconds, batch=5, warmup=2))


def _catalog_kind(ctx: Context) -> DeviceSpec | None:
    """The catalog's device kind of the device present, if the catalog has it."""
    from hetc.frontend.load import load_spec

    return next((d for d in load_spec(CATALOG).spec.devices if d.name == ctx.kind), None)


def _timed_rates(torch: ModuleType, device: str, run: Callable[[], Any], work: float, seconds: float, *,
                 batch: int, warmup: int) -> list[tuple[float, float]]:
    """(seconds since the start, `work` per second) of each batch of `batch` back-to-back `run()`s on `device`,
    for `seconds`, after `warmup` runs."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        run()
    sync()
    rates, start = [], time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        for _ in range(batch):
            run()
        sync()
        rates.append((time.perf_counter() - start, batch * work / (time.perf_counter() - now)))
    return rates


def _sm_clock() -> dict[str, str]:
    """The SM clock, its maximum and the board's power draw as `nvidia-smi` reads them now."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    done = subprocess.run([smi, "--query-gpu=clocks.sm,clocks.max.sm,power.draw", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30, check=False)
    fields = done.stdout.strip().splitlines()[0].split(", ") if done.returncode == 0 and done.stdout.strip() else []
    return dict(zip(("sm", "max", "power"), fields, strict=True)) if len(fields) == 3 else {}


def check_overlap(ctx: Context) -> list[Row]:
    specs = ctx.run_plans()
    plan = ctx.work / "run" / "out_offload1"
    ctx.must("compile", str(specs / "offload1.het"), "-o", str(plan))
    metrics, result = ctx.work / "run" / "offload1.jsonl", ctx.work / "run" / "offload1.json"
    steps = str(max(2, ctx.steps // 3))
    done = ctx.call([*RANK, str(plan), str(result), "--steps", steps, "--metrics", str(metrics), "--profile-trace"])
    if done.returncode != 0:
        raise CheckError(f"the offload run exited {done.returncode}: {done.last_line()}", done.tail())
    ctx.losses["offload"] = losses(metrics)
    found = json.loads(result.read_text())
    share = found["hidden_share"]
    if share is None:
        return [Row("offload overlap", "n/a", "no device copies", detail="a CPU rank has no copies to hide",
                    data=found)]
    return [Row("offload overlap", "ok", f"{share:.0%} of {found['copy_s'] * 1e3:.1f} ms of copies hidden",
                "recorded", data=found)]


def check_resume(ctx: Context) -> list[Row]:
    if not ctx.reference_losses:
        return [Row("checkpoint + resume", "skipped", detail="needs the 1-rank run's losses (check 5)")]
    plan, ckpt = ctx.work / "run" / "out_single", ctx.work / "checkpoints"
    half, metrics = ctx.steps // 2, ctx.work / "run" / "resumed.jsonl"
    ctx.must("run", str(plan), "--local", "1", "--steps", str(half), "--checkpoint", str(ckpt), "--quiet")
    ctx.must("run", str(plan), "--local", "1", "--steps", str(ctx.steps), "--checkpoint", str(ckpt), "--resume",
             "--metrics", str(metrics), "--quiet")
    resumed, reference = losses(metrics), ctx.reference_losses[half:ctx.steps]
    ctx.losses["resumed"] = ctx.reference_losses[:half] + resumed
    worst = max((abs(a - b) / abs(b) for a, b in zip(resumed, reference, strict=True)), default=float("inf"))
    status = "ok" if len(resumed) == len(reference) and worst <= RESUME_RTOL else "fail"
    return [Row("checkpoint + resume", status, f"steps {half + 1}..{ctx.steps}: largest relative difference {worst:.1e}",
                f"within {RESUME_RTOL:.0%} of the uninterrupted run", data={"resumed": resumed, "reference": reference})]


def check_two_stage(ctx: Context) -> list[Row]:
    specs = ctx.run_plans()
    plan, metrics = ctx.work / "run" / "out_pp2", ctx.work / "run" / "pp2.jsonl"
    ctx.must("compile", str(specs / "pp2.het"), "-o", str(plan))
    done = ctx.hetc("run", str(plan), "--local", "2", "--steps", str(ctx.steps), "--metrics", str(metrics),
                    "--quiet", "--timeout", "60")
    name = "2-stage, one device, gloo"
    if done.returncode != 0:
        if not ctx.gpu:
            raise CheckError(f"hetc run exited {done.returncode}: {done.last_line()}", done.tail())
        why = "the runtime starts CUDA ranks on NCCL (runtime/worker.py), no host-staged gloo path: "
        return [Row(name, "unsupported", detail=why + done.last_line(), data={"output_tail": done.tail()})]
    ctx.losses["2-stage"] = losses(metrics)
    return [Row(name, "ok", f"{ctx.steps} steps, loss {ctx.losses['2-stage'][-1]:.4f}")]


def check_fp16(ctx: Context) -> list[Row]:
    """The 1-rank plan in fp16 with its dynamic loss scale (runtime/loss_scale.py), the precision V100s and T4s
    train in: every step reports its scale, none goes non-finite, and the loss falls."""
    job = ctx.job()
    fp16 = dataclasses.replace(job, model=dataclasses.replace(job.model, dtype="fp16"), grad_clip=1.0)
    specs = write_plans(fp16, ctx.work / "fp16")
    plan, metrics = ctx.work / "fp16" / "out_single", ctx.work / "fp16" / "single.jsonl"
    ctx.must("compile", str(specs / "single.het"), "-o", str(plan))
    ctx.must("run", str(plan), "--local", "1", "--steps", str(ctx.steps), "--metrics", str(metrics), "--quiet")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    ctx.losses["fp16"] = [r["loss"] for r in records]
    scales = [r.get("loss_scale") for r in records]
    skipped = sum(bool(r.get("skipped")) for r in records)
    if None in scales or not all(math.isfinite(loss) for loss in ctx.losses["fp16"]):
        return [Row("fp16 loss scale", "fail", f"scales {scales}, losses {ctx.losses['fp16']}",
                    "every step scaled, finite")]
    value = f"{skipped} of {len(records)} steps skipped, scale {scales[0]:g} -> {scales[-1]:g}"
    return [Row("fp16 loss scale", "ok", value, "every step scaled, finite",
                data={"losses": ctx.losses["fp16"], "scales": scales})]


def check_gpu_tests(ctx: Context) -> list[Row]:
    """The suite's `gpu`-marked tests: the CUDA paths CPU CI skips (fused Adam, CUDA-event timing, stream-waited
    offload, ring blocks through flash attention, grouped experts)."""
    if not ctx.gpu:
        return [Row("gpu-marked tests", "skipped", detail="no GPU: they skip on CPU")]
    done = ctx.call([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                     "tests/"])
    lines = done.stdout.strip().splitlines()
    summary = lines[-1][:400] if lines else done.last_line()      # pytest's "N passed, M skipped" line
    status = "ok" if done.returncode == 0 else "fail"
    return [Row("gpu-marked tests", status, summary, "all pass", data={"output_tail": done.stdout[-3000:]})]


def check_loss_falls(ctx: Context) -> list[Row]:
    if not ctx.losses:
        return [Row("loss falls", "skipped", detail="no run finished")]
    ends = {run: (series[0], series[-1]) for run, series in ctx.losses.items()}
    falling = all(last < first for first, last in ends.values())
    value = "; ".join(f"{run} {first:.3f} -> {last:.3f}" for run, (first, last) in ends.items())
    return [Row("loss falls", "ok" if falling else "fail", value, "last < first, every run")]


# (name, limit in seconds on a GPU, check): the order is the order of usefulness
CHECKS: list[tuple[str, float, Callable[[Context], list[Row]]]] = [
    ("versions", 60, check_versions),
    ("verify 1B single", 60, check_verify("single")),
    ("verify 1B zorse_offload", 60, check_verify("zorse_offload")),
    ("verify 1B pp2", 60, check_verify("pp2")),
    ("matmul asymptote", 45, check_matmul),
    ("streaming bandwidth", 20, check_streaming),
    ("GEMM curve", 60, check_gemm_curve),
    ("profile", 150, check_profile),
    ("1-rank run", 150, check_one_rank),
    ("offload overlap", 120, check_overlap),
    ("checkpoint + resume", 150, check_resume),
    ("2-stage", 90, check_two_stage),
    ("fp16 loss scale", 90, check_fp16),
    ("gpu-marked tests", 120, check_gpu_tests),
    ("loss falls", 10, check_loss_falls),
]


def run_checks(ctx: Context, budget_s: float, record: Callable[[list[Row]], None] = lambda rows: None,
               only: frozenset[str] = frozenset()) -> list[Row]:
    """Every check in order (`only`: those named) within `budget_s`; `record` gets the rows so far after each
    check, so that a run cut off (a lent machine taken back, a command's time limit) still leaves its finished
    rows on disk."""
    end, rows = time.monotonic() + budget_s, []
    for name, limit, check in CHECKS:
        if only and name not in only:
            continue
        start = time.monotonic()
        if start >= end:
            rows.append(Row(name, "skipped", detail=f"the {budget_s:.0f} s budget was spent"))
            continue
        ctx.deadline = min(end, start + limit * (1 if ctx.gpu else 2))   # the CPU dry run is slower per step
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        try:
            found = check(ctx)
        except CheckTimeout as err:
            found = [Row(name, "timeout", detail=f"over its {ctx.deadline - start:.0f} s limit: {err}")]
        except Exception as err:  # noqa: BLE001 -- a check that breaks is a row, and the next check runs
            found = [Row(name, "error", detail=f"{type(err).__name__}: {err}"[:600],
                         data={"output_tail": getattr(err, "tail", "")})]
        for row in found:
            row.seconds = round(time.monotonic() - start, 1)
            print(f"    {row.check}: {row.status} {row.value}", file=sys.stderr, flush=True)
        rows += found
        record(rows)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| check | status | value | target | s | detail |", "|---|---|---|---|---|---|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r.check} | {r.status} | {r.value} | {r.target} | {r.seconds:.0f} | {detail} |")
    return "\n".join(lines) + "\n"


def local_kind() -> str | None:
    """The catalog's device kind of CUDA device 0 (as `hetc profile` names it), or None without CUDA."""
    import torch

    from hetc.passes.cost.sources.devices import catalog_name
    return catalog_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check"
    return Path(tempfile.mkdtemp(prefix="hetc-gpu-check-"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=None, metavar="DIR",
                    help="where gpu_check.json and gpu_check.md go (default: $OUT/gpu_check, else under /tmp)")
    ap.add_argument("--cpu", action="store_true", help="dry run on this machine's CPU with the demo model")
    ap.add_argument("--quick", action="store_true", help="fewer steps and profile points (tests use it)")
    ap.add_argument("--only", default="", metavar="NAMES",
                    help="run only these checks, comma-separated by the names of the list above (\"matmul "
                         "asymptote,GEMM curve\"): what a second, shorter lease reruns after a run was cut off; "
                         "a check whose input an earlier one makes runs without it or records `skipped`")
    ap.add_argument("--budget", type=float, default=480, metavar="S",
                    help="seconds for all the checks (480); the checks it leaves out are recorded as skipped")
    args = ap.parse_args(argv)
    only = frozenset(n.strip() for n in args.only.split(",") if n.strip())
    unknown = sorted(only - {name for name, _, _ in CHECKS})
    if unknown:
        print(f"error: --only names no check {', '.join(map(repr, unknown))}; the checks: "
              + ", ".join(name for name, _, _ in CHECKS), file=sys.stderr)
        return 2
    kind = "cpu" if args.cpu else local_kind()
    if kind is None:
        print("error: no CUDA device here: `--cpu` runs the same checks on the CPU as a dry run", file=sys.stderr)
        return 2
    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)

    def record(rows: list[Row]) -> None:
        report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "mode": "cpu" if args.cpu else "gpu", "quick": args.quick, "budget_s": args.budget,
                  "load_average": os.getloadavg(), "checks": [asdict(r) for r in rows]}
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "gpu_check.md").write_text(table(rows))

    with tempfile.TemporaryDirectory(prefix="hetc-gpu-check-work-") as work:   # checkpoints stay out of DIR
        ctx = Context(gpu=not args.cpu, quick=args.quick, work=Path(work), kind=kind)
        rows = run_checks(ctx, args.budget, record, only)
    sys.stdout.write(table(rows))
    print(f"wrote {out / 'gpu_check.json'} and gpu_check.md", file=sys.stderr)
    return 1 if any(r.status in FAILING for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
