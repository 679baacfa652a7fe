"""The analytic cost model against published training runs; writes docs/benchmarks.md "Published runs".

    .venv/bin/python benchmarks/published_runs.py [--no-write] [--only NAME]

Each row of RUNS is a published Megatron-LM run as facts (model shape, GPUs,
plan, measured speed) with its source. The run's plan is written as a .het
spec (`spec_text`: the DGX nodes the paper ran on, A100 or H100, their GPU
naming its SM count) and timed as `hetc explain` times it, in process, without a profile:
the analytic path (passes/cost/gemm.py). Measured seconds per iteration come
from the paper's own FLOP count and its per-GPU TFLOP/s or MFU (`measured_s`),
or its table of iteration times. Reported: the signed error of each row,
mean and max |error|, and for each group of one model on one GPU count
whether the predicted order of its configurations is the measured one. Runs
of other engines (Megatron-DeepSpeed; Meta's Llama 3 trainer, the only
plan above 6,144 GPUs) are reported beside, outside those figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish
from hetc.frontend.printer import format_spec
from hetc.importers.common import catalog_devices
from hetc.ir.spec import Arch, DeviceSpec, Spec

HEADING = "## Published runs"
CATALOG = ROOT / "specs" / "catalog.het"
NARAYANAN = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters (arXiv 2104.04473), Table 1"
NEMOTRON = "NVIDIA 2024, Nemotron-4 340B Technical Report (arXiv 2406.11704), Table 2"
SMITH = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B (arXiv 2201.11990), "
         "§2.4's iteration times")
KORTHIKANTI = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models (arXiv 2205.05198)"
LLAMA3 = "Llama Team, AI @ Meta 2024, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
LLAMA3_ENGINE = "Meta's Llama 3 trainer"


@dataclass(frozen=True)
class Machine:
    """A DGX node as the papers ran it: its GPU as the catalog's kind, which names its SM count (compute by
    matrix shape, Note [GEMM curve]; its `efficiency` the asymptote of docs/costmodel.md "Compute time by
    shape"), NVLink per direction and the node's InfiniBand (one NIC per GPU); and, for the comparison, the
    one efficiency for every layer the catalog gave the kind before it named its SMs (`flat_efficiency`)."""

    device: str
    flat_efficiency: float
    nvlink_gb_s: int
    ib_gb_s: int

    @cached_property
    def kind(self) -> DeviceSpec:
        (kind,) = catalog_devices({self.device})
        return kind

    @property
    def peak_bf16(self) -> float:
        return self.kind.peak.bf16

    @property
    def flat_device(self) -> str:
        return f"{self.device}-flat"

    @property
    def flat_text(self) -> str:
        """A `device` block of the same GPU timing every layer at `flat_efficiency` of peak (no `sms`)."""
        return self._variant(self.flat_device, sms=0, efficiency=self.flat_efficiency)

    def at_asymptote(self, asymptote: float) -> tuple[str, str]:
        """(the device's name, its `device` block): the catalog's kind, its SM count kept, with another
        asymptote, the `efficiency` of docs/costmodel.md "Compute time by shape"."""
        name = f"{self.device}-at-{round(asymptote * 100)}"
        return name, self._variant(name, efficiency=asymptote)

    def _variant(self, name: str, **changes: float) -> str:
        """A `device` block named `name`: the catalog's kind with `changes`."""
        return format_spec(Spec(devices=(replace(self.kind, name=name, **changes),)))


DGX_A100 = Machine("A100-80", 0.5, 300, 200)    # 8 HDR 200 Gb/s
DGX_H100 = Machine("H100", 0.45, 450, 400)      # 8 NDR 400 Gb/s


@dataclass(frozen=True)
class Run:
    """A published run: facts only. `tflops` is the paper's per-GPU TFLOP/s, `mfu` its model FLOPs
    utilisation, `seconds` its measured iteration time: one of them is set."""

    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    tp: int
    pp: int
    global_batch: int
    recompute: str                  # full | selective
    sequence_parallel: bool = False
    micro_batch: int = 1
    seq: int = 2048
    vocab: int = 51200
    kv_heads: int | None = None     # GQA; None: one per head
    ffn: int | None = None          # None: 4 × hidden
    virtual: int = 1                # virtual stages a stage runs (interleaved 1F1B when > 1)
    lighter_ends: int = 0           # layers the first and the last stage hold fewer than the others
    arch: Arch = Arch.GPT           # gpt: LayerNorm, a two-matrix MLP; llama: RMSNorm, SwiGLU's three matrices
    dropout: float = 0.1
    attention: str = "unfused"
    machine: Machine = DGX_A100
    zero: int = 0                   # 1: Megatron's distributed optimizer (optimizer state sharded over DP)
    engine: str = "Megatron-LM"     # whose pipeline engine ran it: the headline is Megatron-LM's own
    tflops: float | None = None
    mfu: float | None = None
    seconds: float | None = None

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def group(self) -> str:
        """One model on one GPU count: the configurations a ranking compares."""
        return f"{self.layers}x{self.hidden} on {self.gpus}"

    def model_flops(self, recompute: bool) -> float:
        """The papers' FLOPs per iteration, the papers' way: every multiply of a token's forward (q, k, v and
        output projections, the MLP's two, the attention's two products over the whole sequence, the
        logits), three times for forward and backward, and the layers' forward once more under full
        recomputation. With GPT's shapes this is Narayanan's eq. 3, 96·B·s·l·h²·(1 + s/6h + V/16lh), and
        without recomputation Korthikanti's 72·B·s·l·h²·(1 + s/6h + V/12lh)."""
        h, s = self.hidden, self.seq
        head = h // self.heads
        kv = self.kv_heads or self.heads
        mlp = 3 if self.arch is Arch.LLAMA else 2
        layer = 2 * h * (h + 2 * kv * head) + 2 * h * h + 2 * mlp * h * (self.ffn or 4 * h) + 4 * s * h
        passes = 4 if recompute else 3
        per_token = passes * self.layers * layer + 3 * 2 * h * self.vocab
        return self.global_batch * s * per_token

    def measured_s(self) -> float:
        if self.seconds is not None:
            return self.seconds
        if self.tflops is not None:
            return self.model_flops(recompute=self.recompute == "full") / (self.gpus * self.tflops * 1e12)
        assert self.mfu is not None, self.name
        return self.model_flops(recompute=False) / (self.gpus * self.machine.peak_bf16 * self.mfu)


def _narayanan(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
               tflops: float) -> Run:
    return Run(f"GPT {params} (N21)", NARAYANAN, layers, hidden, heads, gpus, tp, pp, batch, "full", tflops=tflops)


def _korthikanti(params: str, heads: int, hidden: int, layers: int, pp: int, batch: int, *, full_s: float,
                 selective_mfu: float) -> list[Run]:
    """Table 5's two configurations of one model: full recomputation (its iteration time), and sequence
    parallelism with selective recomputation (its MFU, also in Megatron-LM's README)."""
    gpus = 8 * pp
    return [Run(f"GPT {params} full (K22)", KORTHIKANTI + ", Table 5", layers, hidden, heads, gpus, 8, pp, batch,
                "full", seconds=full_s),
            Run(f"GPT {params} SP+selective (K22)", KORTHIKANTI + ", Table 5", layers, hidden, heads, gpus, 8, pp,
                batch, "selective", sequence_parallel=True, mfu=selective_mfu)]


RUNS: tuple[Run, ...] = (
    _narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _narayanan("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _narayanan("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _narayanan("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _narayanan("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _narayanan("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _narayanan("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _narayanan("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _narayanan("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _narayanan("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    *_korthikanti("175B", 96, 12288, 96, 8, 64, full_s=18.13, selective_mfu=0.514),
    *_korthikanti("530B", 128, 20480, 105, 35, 280, full_s=49.05, selective_mfu=0.560),
    *_korthikanti("1T", 160, 25600, 128, 64, 512, full_s=94.42, selective_mfu=0.563),
    *(Run(f"Nemotron-4 340B DP {dp} (N24)", NEMOTRON, 96, 18432, 96, 8 * 12 * dp, 8, 12, batch, "none",
          sequence_parallel=True, seq=4096, vocab=256000, kv_heads=8, virtual=8, dropout=0.0, attention="flash",
          zero=1, machine=DGX_H100, seconds=s)
      for dp, batch, s in ((16, 768, 10.3), (32, 1536, 10.3), (64, 2304, 8.0))),
    # Llama 3 405B in its 8K-context pretraining: Grand Teton nodes (8 H100 SXM on NVLink, 400 Gb/s RoCE a
    # GPU: DGX H100's links), 16M tokens a batch, one sequence a microbatch, interleaved over one-layer chunks
    # with the first stage one layer lighter and the last one lighter (so the first chunk is the embedding
    # alone and the last the head alone: 126 + 2 = 16 × 8), FSDP that keeps the gathered parameters through
    # the step (the distributed optimizer's traffic, once a step), no recomputation; TFLOP/s of model FLOPs.
    *(Run(f"Llama 3 405B DP {dp} (L24)", LLAMA3, 126, 16384, 128, 8 * 16 * dp, 8, 16, 2048, "none",
          sequence_parallel=True, seq=8192, vocab=128256, kv_heads=8, ffn=53248, virtual=8, lighter_ends=1,
          arch=Arch.LLAMA, dropout=0.0, attention="flash", zero=1, machine=DGX_H100, engine=LLAMA3_ENGINE, tflops=t)
      for dp, t in ((64, 430), (128, 400))),
    *(Run(f"MT-NLG 530B DP {dp} (S22)", SMITH, 105, 20480, 128, 8 * 35 * dp, 8, 35, 1920, "full",
          engine="Megatron-DeepSpeed", seconds=s)
      for dp, s in ((8, 60.1), (10, 50.2), (12, 44.4))),
)


def _stage_layers(run: Run, idx: int) -> str:
    """Stage `idx`'s layers: one range per virtual stage, Megatron's round robin (virtual stage j of stage i
    holds chunk j·pp + i), the embedding with the first chunk and the head with the last. With
    `lighter_ends`, the first and the last chunk hold that many layers fewer (Llama 3's balance: with one
    layer a chunk, the first holds only the embedding and the last only the head)."""
    chunks = run.pp * run.virtual
    per = (run.layers + 2 * run.lighter_ends) // chunks
    ranges = []
    for j in range(run.virtual):
        chunk = j * run.pp + idx
        start = max(chunk * per - run.lighter_ends, 0)
        end = min((chunk + 1) * per - run.lighter_ends, run.layers) - 1
        names = (["embed"] if chunk == 0 else []) + ([f"block{start}", f"block{end}"] if end >= start else []) + \
            (["head"] if chunk == chunks - 1 else [])
        ranges.append(f"{names[0]}..{names[-1]}")
    return ", ".join(ranges)


def spec_text(run: Run, shaped: bool = True, asymptote: float | None = None) -> str:
    """The run as a .het spec: its DGX nodes (8 GPUs on NVSwitch, one InfiniBand rail per GPU: `nics = 8`), a GPT model
    as the paper defines it (LayerNorm, GELU, its FFN, key/value heads and dropouts), Megatron's 1F1B, or
    interleaved 1F1B over its virtual stages, with its TP, PP and DP, and the distributed optimizer where it
    ran one. `shaped`: on the catalog's kind, which names its SM count (compute by shape), else on the same
    GPU with one flat efficiency for every layer (`Machine.flat_text`); `asymptote`: the shaped kind with that
    asymptote instead of the catalog's (`Machine.at_asymptote`)."""
    nodes_per_stage = run.dp * run.tp // 8
    assert nodes_per_stage * 8 == run.dp * run.tp, run.name
    assert (run.layers + 2 * run.lighter_ends) % (run.pp * run.virtual) == 0, run.name
    m = run.machine
    device, block = (m.device, "") if shaped else (m.flat_device, m.flat_text)
    if asymptote is not None:
        device, block = m.at_asymptote(asymptote)
    stages = "\n".join(
        f"  stage pp{i} {{\n    layers = [{_stage_layers(run, i)}]\n"
        f"    ranks = dgx[{i * nodes_per_stage}:{(i + 1) * nodes_per_stage}]\n"
        f"    lanes = {run.dp}\n    tp = {run.tp}\n"
        f"    sequence_parallel = {'true' if run.sequence_parallel else 'false'}\n  }}"
        for i in range(run.pp))
    return f"""use "{CATALOG}"

{block}
model {run.arch.value} {{
  arch = {run.arch.value}
  layers = {run.layers}
  hidden = {run.hidden}
  heads = {run.heads}
  kv_heads = {run.kv_heads or run.heads}
  ffn = {run.ffn or 4 * run.hidden}
  vocab = {run.vocab}
  seq = {run.seq}
  dtype = bf16
  activation_checkpoint = {run.recompute}
  attention = {run.attention}
  hidden_dropout = {run.dropout}
  attention_dropout = {run.dropout}
}}

cluster selene {{
  node dgx {{
    device = {device}
    count = {run.gpus // 8}
    gpus = 8
    nics = 8
    intra {{
      bandwidth = {m.nvlink_gb_s} GB/s
      latency = 3 us
    }}
  }}
  inter_bandwidth = {m.ib_gb_s} GB/s
  inter_latency = 5 us
}}

train {{
  global_batch = {run.global_batch}
  micro_batch = {run.micro_batch}
}}

parallel {{
  schedule = {'interleaved' if run.virtual > 1 else '1f1b'}
  zero = {run.zero}
{stages}
}}
"""


@dataclass(frozen=True)
class Result:
    run: Run
    measured_s: float
    predicted_s: float
    flat_s: float          # on the same GPU, one efficiency for every layer (`Machine.flat_text`)

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def predict(run: Run, shaped: bool = True, asymptote: float | None = None) -> float:
    """Seconds per iteration as `hetc explain` prints them for the run's spec (no profile)."""
    from hetc.compiler import load_checked
    from hetc.passes.cost import CostModel, Profiles
    from hetc.passes.simulated_step import simulated_estimate

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.het"
        path.write_text(spec_text(run, shaped=shaped, asymptote=asymptote))
        _, checked = load_checked(path, require_complete=True)
    plan = checked.explicit()
    assert plan is not None, run.name
    costs = CostModel(plan, Profiles())
    return simulated_estimate(costs, costs.estimate()).step_time_s


def ranked_as_measured(results: list[Result]) -> dict[str, bool]:
    """For each group of two or more configurations: whether predicted times order them as measured."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.run.group, []).append(r)
    return {name: [r.run.name for r in sorted(rs, key=lambda r: r.measured_s)] ==
            [r.run.name for r in sorted(rs, key=lambda r: r.predicted_s)]
            for name, rs in groups.items() if len(rs) > 1}


def _table(results: list[Result]) -> list[str]:
    lines = [("| run | GPUs | TP × PP × DP | VP | global batch | recompute | measured s | predicted s | error | "
              "flat s | source |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        run = r.run
        lines.append(f"| {run.name} | {run.gpus} | {run.tp} × {run.pp} × {run.dp} | {run.virtual} | "
                     f"{run.global_batch} | {run.recompute}{' + SP' if run.sequence_parallel else ''} | "
                     f"{r.measured_s:.2f} | {r.predicted_s:.2f} | {r.error:+.1%} | {r.flat_s:.2f} | {run.source} |")
    return lines


# the H100 asymptotes the sensitivity table times the H100 rows at (the catalog's first)
H100_ASYMPTOTES = (0.80, 0.75, 0.70, 0.65)


def asymptote_rows(results: list[Result], retimed: dict[float, dict[str, float]]) -> list[str]:
    """The H100 rows' errors and the whole benchmark's mean and max |error| at each asymptote of `retimed`
    (asymptote -> run name -> predicted seconds; the runs not named keep their prediction)."""
    own = [r for r in results if r.run.engine == "Megatron-LM"]
    h100 = [r for r in own if r.run.machine is DGX_H100]
    lines = ["| H100 asymptote | " + " | ".join(r.run.name for r in h100) + " | mean \\|error\\| | max |",
             "|---|" + "---|" * (len(h100) + 2)]
    for asymptote, times in retimed.items():
        errors = [times.get(r.run.name, r.predicted_s) / r.measured_s - 1 for r in own]
        row = [f"{times[r.run.name] / r.measured_s - 1:+.1%}" for r in h100]
        lines.append(f"| {asymptote:.2f} ({asymptote * DGX_H100.peak_bf16 / 1e12:.0f} TFLOP/s) | " + " | ".join(row)
                     + f" | {statistics.fmean(abs(e) for e in errors):.1%} | {max(abs(e) for e in errors):.1%} |")
    return lines


def section(results: list[Result], retimed: dict[float, dict[str, float]] | None = None) -> str:
    own = [r for r in results if r.run.engine == "Megatron-LM"]
    errors = [abs(r.error) for r in own]
    flat = [abs(r.flat_s / r.measured_s - 1) for r in own]
    ranks = ranked_as_measured(own)
    largest = max(r.run.gpus for r in own)
    lines = [HEADING, "",
             ("`benchmarks/published_runs.py`: published Megatron-LM runs on DGX A100 (GPT shapes, seq 2048, "
              "vocab 51,200) and DGX H100 (Nemotron-4 340B), each written as a .het spec with the published plan "
              "and timed by `hetc explain`'s path without a profile (compute by matrix shape, "
              "passes/cost/gemm.py). Measured seconds per iteration are the papers' FLOPs per iteration over "
              "their per-GPU TFLOP/s or MFU (Narayanan's count includes the recomputed forward, Korthikanti's "
              "MFU does not), or their iteration times. Error = (predicted − measured) / measured. Micro-batch 1 "
              "and plain 1F1B where the paper does not say otherwise."), "",
             (f"**{len(own)} runs at {min(r.run.gpus for r in own)}-{largest:,} GPUs: mean |error| "
              f"{statistics.fmean(errors):.1%}, max {max(errors):.1%}; {sum(ranks.values())} of {len(ranks)} "
              "groups of one model on one GPU count ordered as measured.** With one efficiency for every layer "
              "instead (no `sms`: A100 0.5, H100 0.45, the catalog's before it named its kinds' SMs): "
              f"mean |error| {statistics.fmean(flat):.1%}, max {max(flat):.1%}."), "",
             *_table(own)]
    lines += ["", "| group | ordered as measured |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'no'} |" for name, ok in ranks.items()]
    lines += ["", ("Both papers' GPT configurations drop 10 % of the attention probabilities and of the hidden "
                   "state: the specs set `hidden_dropout` and `attention_dropout` to 0.1, which hetc runs and "
                   "costs (memory-bound; with unfused attention S² more bytes each way per head, most of a small "
                   "model's share). The attention is `unfused` in those specs: flash attention reached "
                   "Megatron-LM after both papers. Nemotron-4 340B (GQA with 8 key/value heads, FFN 4h, "
                   "squared ReLU costed as GELU, no dropout, flash attention, sequence parallelism, the "
                   "distributed optimizer, no recomputation: Megatron-LM's default) names its interleaving but not its virtual stages: 8, "
                   "one layer each, as NVIDIA's recipes run this model (PP 8 × VP 12 there); its measured MFU "
                   "(41.0-42.4 %) is what this file's FLOP count gives its iteration times. What the model "
                   "leaves out: Narayanan's 2021 software is slower than Korthikanti's 2022 on the same pipeline "
                   "(1T: 512 microbatches of one sequence through 64 stages of TP 8 in both, 102.6 s at DP 6 "
                   "against 94.4 s at DP 1), which no term of the plan explains.")]
    if retimed:
        lines += ["", ("What the H100 rows rest on: the catalog's H100 asymptote, 0.80 of the bf16 peak, is the "
                       "burst rate published matmul maxima report (about 794 of 989 TFLOP/s); a training step "
                       "runs at the board's power limit for hours, where the SM clock and the rate fall. "
                       "benchmarks/gpu_check.py's \"matmul asymptote\" row measures both on the GPU it runs on "
                       "(docs/benchmarks.md \"GPU\"; no H100 run yet). The H100 rows timed at other asymptotes, "
                       "the kind otherwise the catalog's (`Machine.at_asymptote`), so that a measured sustained "
                       "rate reads off as these errors (a prediction, not a fit: the catalog keeps 0.80 until "
                       "a GPU measures it):"), "", *asymptote_rows(results, retimed)]
    for engine, note in OTHER_ENGINES.items():
        runs = [r for r in results if r.run.engine == engine]
        if runs:
            lines += ["", note(runs), "", *_table(runs)]
    return "\n".join(lines) + "\n"


def _scaling(results: list[Result], seconds: Callable[[Result], float]) -> float:
    """The time of the largest over the smallest of one model's runs (measured or predicted)."""
    by_gpus = sorted(results, key=lambda r: r.run.gpus)
    return seconds(by_gpus[-1]) / seconds(by_gpus[0])


def _deepspeed_note(results: list[Result]) -> str:
    return ("Runs of another pipeline engine, outside the figures above: Megatron-DeepSpeed (DeepSpeed's pipeline "
            "engine around Megatron-LM's layers). The same 530B shape and TP 8 × PP 35 on DGX A100 ran at 113-126 "
            "TFLOP/s a GPU there and 163 in Megatron-LM's own (Narayanan's 529.6B above, within its error); hetc "
            "times Megatron-LM's engine, and no term of the plan explains the difference. The scaling from 280 to "
            f"420 nodes at one batch is the plan's: measured {_scaling(results, lambda r: r.measured_s):.3f} of "
            f"the time, predicted {_scaling(results, lambda r: r.predicted_s):.3f}.")


def _llama3_note(results: list[Result]) -> str:
    errors = ", ".join(f"{r.error:+.1%}" for r in results)
    return ("Meta's own trainer, outside the figures above: Llama 3 405B's 8K-context pretraining, the one whole "
            "published plan above 6,144 GPUs this benchmark has. Its pipeline schedule is not Megatron's: it runs "
            "a tunable number of consecutive microbatches through each virtual stage, and the paper trains "
            "without activation recomputation, where Megatron's interleaved 1F1B, which hetc lowers, holds up to "
            "70 GiB of activations on a stage (`hetc explain` of the 8,192-GPU run: 93.6 GiB a GPU on the 80 GB "
            f"H100). Written as interleaved 1F1B its runs come out {errors}: fast, as Nemotron-4's above, against "
            "the catalog's H100 asymptote (a burst rate: the sensitivity table). The scaling from 8,192 to 16,384 "
            "GPUs at one batch (twice the data-parallel lanes, half the microbatches each) is the plan's: "
            f"measured {_scaling(results, lambda r: r.measured_s):.3f} of the time, predicted "
            f"{_scaling(results, lambda r: r.predicted_s):.3f}.")


# the engines reported beside Megatron-LM's figures, each with what tells it apart
OTHER_ENGINES: dict[str, Callable[[list[Result]], str]] = {
    "Megatron-DeepSpeed": _deepspeed_note,
    LLAMA3_ENGINE: _llama3_note,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--only", default="", help="time the runs whose name contains this")
    args = parser.parse_args(argv)
    results = []
    for run in RUNS:
        if args.only in run.name:
            print(f"{run.name}", file=sys.stderr, flush=True)
            results.append(Result(run, run.measured_s(), predict(run), predict(run, shaped=False)))
    h100 = [r.run for r in results if r.run.machine is DGX_H100 and r.run.engine == "Megatron-LM"]
    retimed = {a: {run.name: predict(run, asymptote=a) for run in h100} for a in H100_ASYMPTOTES} if h100 else None
    return publish(HEADING, section(results, retimed), write=not args.no_write and not args.only)


if __name__ == "__main__":
    sys.exit(main())
