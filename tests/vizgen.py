"""Synthetic plans for the visualizer's tests, benchmark and screenshot.

A small 1F1B / Zorse-style lowering (stages x lanes, microbatches routed
round-robin to the lanes of every stage, ZeRO-1 collectives, optional param
offload) and a tiny discrete-event simulator that turns the Program into a
Timeline: sends are asynchronous (`h=`) and waited on before the optimizer,
receives block until the matching send arrives, collectives start when the
last member enters. Not the compiler: just realistic inputs until
`hetc compile` writes real plan directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetc.program import (AllGather, Backward, Forward, Group, Load, Offload, Prefetch, Program, RankProgram,
                          Recv, ReduceScatter, Send, Step, Tensor, Wait)
from hetc.timeline import Event, Flow, MemorySample, RankInfo, Stream, Timeline, classify

__all__ = ["SynthPlan", "synth_program", "simulate", "write_plan_dir", "DEMO", "demo_plan", "scaled_plan"]

GiB = 1024 ** 3
# device kind -> (relative speed, memory bytes)
DEVICES = {"cpu": (1.0, 4 * GiB), "A100-40": (1.0, 40 * GiB), "H100": (2.5, 80 * GiB), "T4": (0.3, 15 * GiB)}


@dataclass(frozen=True)
class SynthPlan:
    lanes: tuple[int, ...]            # lanes per stage
    devices: tuple[str, ...]          # device kind per stage
    microbatches: int                 # per step, over all lanes
    fwd_time: float = 1e-3            # forward of one stage on speed 1.0
    act_bytes: int = 2 * 32 * 64 * 4  # one boundary activation (b x S x H fp32)
    param_bytes: int = 256 * 1024 ** 2
    offload: bool = False
    bandwidth: float = 5e9
    shape: tuple[int, ...] = (2, 32, 64)

    @property
    def num_stages(self) -> int:
        return len(self.lanes)

    def rank_of(self, stage: int, lane: int) -> int:
        return sum(self.lanes[:stage]) + lane

    def lane_of(self, stage: int, mb: int) -> int:
        return mb % self.lanes[stage]

    def microbatches_of(self, stage: int, lane: int) -> list[int]:
        return [mb for mb in range(self.microbatches) if self.lane_of(stage, mb) == lane]


# shaped like specs/demo/pp.het: 2 stages x 2 lanes, global batch 8 / micro-batch 2 = 4 microbatches
DEMO = SynthPlan(lanes=(2, 2), devices=("cpu", "cpu"), microbatches=4, param_bytes=2 * 1024 ** 2)


def demo_plan() -> SynthPlan:
    return DEMO


def scaled_plan(num_stages: int, num_lanes: int, per_lane: int) -> SynthPlan:
    """`num_stages` x `num_lanes` ranks on alternating H100 / A100 stages."""
    devices = tuple("H100" if s % 2 else "A100-40" for s in range(num_stages))
    return SynthPlan(lanes=(num_lanes,) * num_stages, devices=devices, microbatches=num_lanes * per_lane,
                     fwd_time=20e-3, act_bytes=8 * 4096 * 8192 * 2, param_bytes=4 * GiB, bandwidth=50e9)


def synth_program(plan: SynthPlan) -> Program:
    ranks = []
    for stage, num_lanes in enumerate(plan.lanes):
        for lane in range(num_lanes):
            instrs = _lower_rank(plan, stage, lane)
            ranks.append(RankProgram(plan.rank_of(stage, lane), stage, lane, 0, 0, (), tuple(instrs)))
    groups = tuple(Group(f"dp{s}", tuple(plan.rank_of(s, lane) for lane in range(n)))
                   for s, n in enumerate(plan.lanes) if n > 1)
    return Program(tuple(ranks), groups)


def _lower_rank(plan: SynthPlan, stage: int, lane: int) -> list:
    mbs = plan.microbatches_of(stage, lane)
    last = plan.num_stages - 1
    handles: list[int] = []
    out: list = []
    if plan.offload:
        out += [Prefetch(Tensor.PARAMS, stage, handle=900), Wait(900)]

    def send(what: Tensor, ms: int, mb: int, peer_stage: int) -> None:
        handles.append(len(handles) + 1)
        peer = plan.rank_of(peer_stage, plan.lane_of(peer_stage, mb))
        out.append(Send(what, ms, mb, peer, plan.shape, handles[-1]))

    def forward(mb: int) -> None:
        if stage == 0:
            out.append(Load(mb))
        else:
            out.append(Recv(Tensor.ACT, stage - 1, mb, plan.rank_of(stage - 1, plan.lane_of(stage - 1, mb)),
                            plan.shape))
        out.append(Forward(stage, mb))
        if stage < last:
            send(Tensor.ACT, stage, mb, stage + 1)

    def backward(mb: int) -> None:
        if stage < last:
            out.append(Recv(Tensor.GRAD, stage + 1, mb, plan.rank_of(stage + 1, plan.lane_of(stage + 1, mb)),
                            plan.shape))
        out.append(Backward(stage, mb))
        if stage > 0:
            send(Tensor.GRAD, stage, mb, stage - 1)

    warmup = min(last - stage, len(mbs))
    for mb in mbs[:warmup]:
        forward(mb)
    for i, mb in enumerate(mbs[warmup:]):
        forward(mb)
        backward(mbs[i])
    for mb in mbs[len(mbs) - warmup:]:
        backward(mb)
    out += [Wait(h) for h in handles]
    if plan.lanes[stage] > 1:
        out.append(ReduceScatter(Tensor.GRADS, stage, f"dp{stage}"))
    out.append(Step(stage))
    if plan.lanes[stage] > 1:
        out.append(AllGather(Tensor.PARAMS, stage, f"dp{stage}"))
    if plan.offload:
        out.append(Offload(Tensor.PARAMS, stage))
    return out


def simulate(plan: SynthPlan, program: Program) -> Timeline:
    return _Simulator(plan, program).run()


class _Simulator:
    def __init__(self, plan: SynthPlan, program: Program):
        self.plan, self.program = plan, program
        n = program.world_size
        self.clock = [0.0] * n
        self.stream_free = {(r, s): 0.0 for r in range(n) for s in Stream}
        self.pc = [0] * n
        self.sent: dict[tuple, tuple[int, int, float]] = {}   # (what, ms, mb, dst) -> (src, index, arrival)
        self.handle_end: dict[tuple[int, int], float] = {}
        self.entered: dict[int, dict[int, int]] = {}             # rank -> {instr index: call number}
        self.arrivals: dict[tuple[str, int], dict[int, float]] = {}  # (group, call) -> {rank: entry time}
        self.events: list[Event] = []
        self.flows: list[Flow] = []
        self.mem = [_static_bytes(plan, rp.stage) for rp in program.ranks]
        self.samples = [MemorySample(r, 0.0, m) for r, m in enumerate(self.mem)]

    def run(self) -> Timeline:
        progress = True
        while progress:
            progress = False
            for rp in self.program.ranks:
                while self.pc[rp.rank] < len(rp.instrs) and self._try(rp, self.pc[rp.rank]):
                    self.pc[rp.rank] += 1
                    progress = True
        stuck = [r for r, rp in enumerate(self.program.ranks) if self.pc[r] < len(rp.instrs)]
        assert not stuck, f"synthetic schedule deadlocks on ranks {stuck}"
        ranks = tuple(RankInfo(rp.rank, rp.stage, rp.lane, self.plan.devices[rp.stage], f"node{rp.rank // 8}"
                               f"[{rp.rank % 8}]", DEVICES[self.plan.devices[rp.stage]][1])
                      for rp in self.program.ranks)
        step_time = max(e.end for e in self.events)
        facts = (("schedule", "1f1b"), ("stages", str(self.plan.num_stages)),
                 ("lanes", "/".join(map(str, self.plan.lanes))), ("zero", "1"),
                 ("microbatches", str(self.plan.microbatches)), ("tokens_per_step", str(self.plan.microbatches * 64)))
        return Timeline("predicted", ranks, tuple(self.events), tuple(self.flows), tuple(self.samples),
                        step_time, facts)

    def _try(self, rp: RankProgram, index: int) -> bool:
        instr, rank, plan = rp.instrs[index], rp.rank, self.plan
        kind, stream = classify(instr)
        speed = DEVICES[plan.devices[rp.stage]][0]
        start = max(self.clock[rank], self.stream_free[rank, stream])
        if isinstance(instr, Recv):
            key = (instr.what, instr.ms, instr.mb, rank)
            if key not in self.sent:
                return False
            src, src_index, arrival = self.sent[key]
            end = max(start, arrival) + 2e-6
            self.flows.append(Flow(src, src_index, rank, index, plan.act_bytes))
        elif isinstance(instr, (ReduceScatter, AllGather)):
            got = self._collective(rp, instr.group, start)
            if got is None:
                return False
            start, end = got
        elif isinstance(instr, Wait):
            end = max(start, self.handle_end.get((rank, instr.handle), start))
        elif isinstance(instr, Send):
            end = start + plan.act_bytes / plan.bandwidth + 5e-6
            self.sent[instr.what, instr.ms, instr.mb, instr.peer_to] = (rank, index, end)
        else:
            factor = {Forward: 1.0, Backward: 2.0, Step: 0.5, Load: 0.05}.get(type(instr), 0.0)
            copy = plan.param_bytes / 25e9 if isinstance(instr, (Prefetch, Offload)) else 0.0
            end = start + factor * plan.fwd_time / speed + copy
        self._record(rp, index, kind, stream, start, end)
        return True

    def _collective(self, rp: RankProgram, group: str, start: float) -> tuple[float, float] | None:
        """(start, end) once every member has entered this call of the group, else None."""
        members = self.program.group(group).ranks
        entered = self.entered.setdefault(rp.rank, {})
        call = entered.setdefault(self.pc[rp.rank], len(entered))
        arrivals = self.arrivals.setdefault((group, call), {})
        arrivals.setdefault(rp.rank, start)
        if len(arrivals) < len(members):
            return None
        begin, n = max(arrivals.values()), len(members)
        return begin, begin + (n - 1) / n * self.plan.param_bytes / self.plan.bandwidth + 20e-6

    def _record(self, rp: RankProgram, index: int, kind, stream: Stream, start: float, end: float) -> None:
        rank = rp.rank
        self.events.append(Event(rank, index, str(rp.instrs[index]), kind, stream, start, end))
        self.stream_free[rank, stream] = end
        handle = getattr(rp.instrs[index], "handle", None)
        # an instruction with a handle only starts; the rank goes on after issuing it
        self.clock[rank] = self.clock[rank] + 1e-6 if handle is not None else end
        delta = {Forward: self.plan.act_bytes * 6, Backward: -self.plan.act_bytes * 6,
                 Prefetch: self.plan.param_bytes, Offload: -self.plan.param_bytes}.get(type(rp.instrs[index]), 0)
        if delta:
            self.mem[rank] += delta
            self.samples.append(MemorySample(rank, end, self.mem[rank]))
        if handle is not None:
            self.handle_end[rank, handle] = end


def _static_bytes(plan: SynthPlan, stage: int) -> float:
    """Params + grads resident, Adam state sharded over the stage's lanes (ZeRO-1), 16 bytes/param total."""
    params = plan.param_bytes / 2
    resident = 0 if plan.offload else 2 * params
    return resident + 2 * params + 12 * params / plan.lanes[stage]


def write_plan_dir(out: Path, program: Program, timeline: Timeline | None) -> Path:
    """The parts of a `hetc compile` plan directory that `hetc viz` reads."""
    (out / "programs").mkdir(parents=True, exist_ok=True)
    for rp in program.ranks:
        (out / "programs" / f"rank-{rp.rank:04d}.txt").write_text(rp.to_text())
    (out / "groups.txt").write_text(program.groups_text())
    if timeline is not None:
        (out / "timeline.json").write_text(timeline.to_json())
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m tests.vizgen OUT [--lanes 2,2] [--devices cpu,cpu] [--microbatches 8]`: a synthetic plan dir."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.vizgen", description=main.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--lanes", default="2,2", help="lanes per stage")
    parser.add_argument("--devices", default="cpu,cpu", help=f"device per stage, of {', '.join(DEVICES)}")
    parser.add_argument("--microbatches", type=int, default=DEMO.microbatches)
    args = parser.parse_args(argv)
    plan = SynthPlan(lanes=tuple(int(n) for n in args.lanes.split(",")), devices=tuple(args.devices.split(",")),
                     microbatches=args.microbatches, param_bytes=DEMO.param_bytes)
    program = synth_program(plan)
    write_plan_dir(args.out, program, simulate(plan, program))


if __name__ == "__main__":
    main()
