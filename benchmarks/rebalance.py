"""Live rebalancing against doing nothing; writes docs/benchmarks.md "Live rebalancing".

    .venv/bin/python benchmarks/rebalance.py [--steps 40] [--factor 3] [--link] [--no-write]

The hetero demo plan (specs/demo/hetero.het: 4 local CPU ranks, a middle stage of two lanes serving
3 and 1 microbatches), three runs of `--steps` steps:

- *unperturbed*, with `--rebalance`: its false alarms, and the step-to-step noise of every lane's
  compute per microbatch as the detector sees it (`LaneWatch.ratios`: the largest slowdown any lane
  showed, which the default --rebalance-threshold must stay above);
- *slowed, nothing done*: rank 1 (the lane of 3 microbatches) `--factor` times slower from step 6, or
  with `--link` the link between rank 0 and rank 1 (the border of that lane);
- *slowed, rebalanced*: the same with `--rebalance`.

The link case has its own section, "Live rebalancing: a slow link".

Throughput is tokens per second from median step times: *before* (steps 2-5), *slowed* (after the
slowdown, before the switch) and *after* (from `window` steps past the switch, to the end); the same
step ranges of the run that does nothing. Detection: steps from the slowdown to the detection line;
switch: the time to compile, verify and publish the new programs (rank 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import publish
from hetc.compiler import load_checked
from hetc.runtime.rebalance import LaneWatch, RebalanceOptions

HEADING = "## Live rebalancing"
LINK_HEADING = "## Live rebalancing: a slow link"
PLAN = ROOT / "specs" / "demo" / "hetero.het"
SLOW_RANK, SLOW_FROM = 1, 5        # 0-based step: the run's step 6
SLOW_LINK = (0, 1)                 # --link: the border of rank 1's lane to the head


def run(plan: Path, out: Path, steps: int, *extra: str) -> list[dict]:
    metrics = out / f"m{len(list(out.glob('m*.jsonl')))}.jsonl"
    done = subprocess.run([sys.executable, "-m", "hetc", "run", str(plan), "--local", "--steps", str(steps), "-q",
                           "--metrics", str(metrics), *extra], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"hetc run failed ({done.returncode}): {done.stderr[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if "class_times_s" in r]


def median_tps(records: list[dict], first: int, stop: int) -> float:
    """Median tokens/s over 1-based steps first..stop-1."""
    return statistics.median(r["tokens_per_s"] for r in steps_of(records) if first <= r["step"] < stop)


def noise(records: list[dict], opts: RebalanceOptions) -> float:
    """The largest window-median over reference ratio of any lane in an unperturbed run (LaneWatch's)."""
    _, checked = load_checked(PLAN, require_complete=True)
    pipeline = checked.pipeline
    assert pipeline is not None
    lanes = [(st.index, lane.index) for st in pipeline.stages for lane in st.lanes]
    watch, worst = LaneWatch(lanes, opts), 1.0
    for r in steps_of(records):
        compute = [c["compute"] for c in r["class_times_s"]]
        watch.observe({(st.index, lane.index): max(compute[x] for x in lane.ranks) / len(lane.microbatches)
                       for st in pipeline.stages for lane in st.lanes})
        worst = max([worst, *watch.ratios().values()])
    return worst


def measure(steps: int, factor: float, link: bool = False) -> dict:
    opts = RebalanceOptions()
    slowed = f"link={SLOW_LINK[0]}-{SLOW_LINK[1]}" if link else f"rank={SLOW_RANK}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        subprocess.run([sys.executable, "-m", "hetc", "compile", str(PLAN), "-o", str(out / "plan")], cwd=ROOT,
                       check=True, capture_output=True)
        plan = out / "plan"
        inject = ["--inject", f"slow {slowed} factor={factor} from={SLOW_FROM}"]
        calm = run(plan, out, steps, "--rebalance")
        idle = run(plan, out, steps, *inject)
        fixed = run(plan, out, steps, "--rebalance", *inject)
    events = [r for r in fixed if r.get("event") == "rebalance"]
    detected = next((r for r in events if (r.get("link") == list(SLOW_LINK) if link else r.get("slow") == [1, 0])),
                    None)
    switch = next((r for r in events if r.get("taken")), None)
    if detected is None or switch is None:
        raise SystemExit(f"no detection or switch in the rebalanced run: {events}")
    resumed = switch["step"] + opts.window + 1
    return {
        "steps": steps, "factor": factor, "link": link,
        "false_alarms": sum(1 for r in calm if "slow" in r or "link" in r),
        "false_replans": sum(1 for r in calm if r.get("taken")),
        "noise": noise(calm, opts), "threshold": opts.threshold,
        "detection_steps": detected["step"] - SLOW_FROM, "switch_s": switch["compile_s"],
        "change": switch["change"], "before": median_tps(fixed, 2, SLOW_FROM + 1),
        "slowed": median_tps(fixed, SLOW_FROM + 1, switch["step"] + 1),
        # the step the switch predicted, as tokens/s: the slowed rate scaled by the predicted speed-up
        "predicted_tps": median_tps(fixed, SLOW_FROM + 1, switch["step"] + 1) * switch["measured_step_s"]
        / switch["predicted_step_s"],
        "after": median_tps(fixed, resumed, steps + 1),
        "nothing_before": median_tps(idle, 2, SLOW_FROM + 1), "nothing_after": median_tps(idle, resumed, steps + 1),
    }


def render(m: dict) -> str:
    (stage, (old, new)), = m["change"].items()
    gap = m["after"] / m["predicted_tps"] - 1
    what = (f"the link between rank {SLOW_LINK[0]} (the head) and rank {SLOW_LINK[1]} (the middle stage's lane of 3\n"
            f"microbatches) {m['factor']:g}x as late from step {SLOW_FROM + 1} (`--inject 'slow link=...'`, Note [a slowed "
            "link] in\nruntime/inject.py)") if m["link"] else \
        (f"rank {SLOW_RANK}, the middle stage's lane of 3 microbatches, {m['factor']:g}x slower from step {SLOW_FROM + 1}\n"
         "(`--inject`)")
    return f"""{LINK_HEADING if m['link'] else HEADING}

`benchmarks/rebalance.py{' --link' if m['link'] else ''}`: the hetero demo plan on 4 local CPU ranks (2 shared cores), \
{m['steps']} steps;
{what}. Tokens/s are medians over step ranges (before: steps 2-{SLOW_FROM}; after: from
{RebalanceOptions.window} steps past the switch). Note [live rebalancing] in runtime/rebalance.py.

| run | before | slowed | after |
|---|---|---|---|
| doing nothing | {m['nothing_before']:,.0f} | | {m['nothing_after']:,.0f} |
| `--rebalance` | {m['before']:,.0f} | {m['slowed']:,.0f} | **{m['after']:,.0f}** (predicted {m['predicted_tps']:,.0f}, {gap:+.0%}) |

- detection: {m['detection_steps']} steps after the slowdown began; switch (compile, verify, publish the
  programs on rank 0): {m['switch_s'] * 1e3:.0f} ms, no restart; stage {stage}'s microbatches {old} -> {new}.
- after the switch the rebalanced run makes {m['after'] / m['nothing_after']:.2f}x the throughput of doing nothing.
- noise: over an unperturbed run with `--rebalance`, the largest slowdown of any lane (the fastest of its
  last 5 steps over its reference, over the median of that over all lanes) was {m['noise']:.2f}, under the default
  threshold of {m['threshold']:g}; false detections (of a lane or a link): {m['false_alarms']}, \
re-plans: {m['false_replans']}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--link", action="store_true", help="slow the link between ranks 0 and 1, not rank 1")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    return publish(LINK_HEADING if args.link else HEADING, render(measure(args.steps, args.factor, args.link)),
                   not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
