"""How long messages take to cross each link of a running job, for live rebalancing (`hetc run --rebalance`).

Note [link transit]
Every rank stamps, by the wall clock, when it posted each send and each receive of a training step and
when each receive arrived (after a slowed link's lateness, Note [a slowed link] in runtime/inject.py);
plan rank 0 gathers the stamps after the step (runtime/rebalance.py). A message's *transit* is its
arrival less the later of its two posts: the time from when both ends were ready (gloo and NCCL hand a
message over once the receiver has posted for it) to its arrival, with no wait for the sender's compute
in it. A link's figure for a step is the fastest transit of its messages, either way: the interpreter
sees an arrival only when the receiving thread waits for it, so a message that came while its receiver
computed reads late, and the fastest is one its receiver waited for (in a pipeline each step has one: the
first activation and the first gradient a stage receives). From there a link is watched exactly as a
lane is (`RateWatch`: a reference from the first window, the fastest of each window over it).

A slowed link makes every message of both lanes it joins late, so re-routing counts it in each lane's
time per microbatch (`border_seconds`): the link's extra seconds per message (reference x (slowdown - 1))
times its messages per microbatch of the lane, as last seen (`border_rates`: a lane given no microbatch
sends nothing over its links, and keeps the rate it had). The re-plan's cost model takes the slowdown
as its own time of the link's messages made longer by the seconds measured (`model_link_factor`): a
factor on the model's time of the message, since the model's time of a link and the machine's differ
(the demo plan's 0.5 ms latency against 0.1-0.2 ms measured on loopback), which a ratio would carry over.

Stamps of two hosts need their clocks to agree to well under a message's time: one host (`--local`), or
hosts kept together by PTP. A rank that waits for a core takes longer to see an arrival and to hand its
own messages over, so on shared cores a starved rank reads as slow links: on the demo (4 ranks on 2
cores), unperturbed runs with `--rebalance` read a largest link slowdown of 1.9 at a load average near 2
and 5.8 near 5 (other jobs running), where a 3x slowed link reads 7-12x (the plan's 0.5 ms a message
added twice, over about 0.15 ms measured). So a link has its own threshold, 4 by default
(`--rebalance-link-threshold`): twice the noise seen at a load near 2, under what a 3x slowed link
reads; and a detection re-routes only when the simulation predicts a gain.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from hetc.ir.pipeline import Pipeline

__all__ = ["LinkId", "LinkTransits", "MessageLog", "border_rates", "border_seconds", "link_transits",
           "model_link_factor"]

LinkId = tuple[int, int]       # two ranks, lower first
LaneId = tuple[int, int]       # (stage, lane)


@dataclass
class MessageLog:
    """One rank's messages of the current training step: when each was posted, and each receive's arrival."""

    sent: dict[tuple[int, int], float] = field(default_factory=dict)                 # (to, tag) -> posted
    # (from, tag) -> (posted, arrived, bytes)
    received: dict[tuple[int, int], tuple[float, float, int]] = field(default_factory=dict)

    def clear(self) -> None:
        self.sent.clear()
        self.received.clear()

    def posted_send(self, peer: int, tag: int) -> None:
        self.sent[(peer, tag)] = time.time()

    def arrived(self, peer: int, tag: int, posted: float, nbytes: int) -> None:
        """A receive of `nbytes` from `peer`, posted at `posted` (by `time.time()`), has arrived now."""
        self.received[(peer, tag)] = (posted, time.time(), nbytes)

    def to_json(self) -> str:
        return json.dumps({"sent": [[p, t, s] for (p, t), s in self.sent.items()],
                           "received": [[p, t, *got] for (p, t), got in self.received.items()]})

    @classmethod
    def from_json(cls, text: str) -> MessageLog:
        got = json.loads(text)
        return cls({(p, t): s for p, t, s in got["sent"]}, {(p, t): (a, b, n) for p, t, a, b, n in got["received"]})


@dataclass(frozen=True)
class LinkTransits:
    """One step's figure of every link that carried a message (Note [link transit])."""

    fastest: dict[LinkId, float]    # seconds: the fastest transit of the link's messages
    messages: dict[LinkId, int]     # how many messages crossed it, either way
    nbytes: dict[LinkId, int]       # the size of its fastest message


def link_transits(logs: Mapping[int, MessageLog]) -> LinkTransits:
    """Each link's fastest transit and its messages, from every rank's log of one step (rank -> log)."""
    fastest: dict[LinkId, float] = {}
    messages: dict[LinkId, int] = {}
    nbytes: dict[LinkId, int] = {}
    for rank, log in logs.items():
        for (src, tag), (posted, arrived, size) in log.received.items():
            sent = logs[src].sent.get((rank, tag)) if src in logs else None
            if sent is None:
                continue      # a piece whose tag another piece shares: its send stamp is the other's
            link = (min(rank, src), max(rank, src))
            transit = max(arrived - max(posted, sent), 0.0)
            if link not in fastest or transit < fastest[link]:
                fastest[link], nbytes[link] = transit, size
            messages[link] = messages.get(link, 0) + 1
    return LinkTransits(fastest, messages, nbytes)


def border_rates(pipeline: Pipeline, messages: Mapping[LinkId, int]) -> dict[tuple[LinkId, LaneId], float]:
    """Messages per microbatch of each lane a link joins, from one step's `messages` per link under
    `pipeline`'s routing (a link that carried none is left out: its last rate stands, Note [link transit])."""
    lane_of = {r: (st.index, lane.index) for st in pipeline.stages for lane in st.lanes for r in lane.ranks}
    out: dict[tuple[LinkId, LaneId], float] = {}
    for link, count in messages.items():
        for lane in {lane_of[r] for r in link}:
            served = len(pipeline.stages[lane[0]].lanes[lane[1]].microbatches)
            if count and served:
                out[(link, lane)] = count / served
    return out


def border_seconds(rates: Mapping[tuple[LinkId, LaneId], float], extra: Mapping[LinkId, float]) -> dict[LaneId, float]:
    """Seconds per microbatch each lane loses to its slow links: a link's `extra` seconds per message times
    its messages per microbatch of the lane (`border_rates`)."""
    out: dict[LaneId, float] = {}
    for (link, lane), per_microbatch in rates.items():
        if link in extra:
            out[lane] = out.get(lane, 0.0) + extra[link] * per_microbatch
    return out


def model_link_factor(extra_s: float, model_s: float) -> float:
    """The cost model's slowdown of a link whose messages take `extra_s` seconds longer than they did, the
    model timing one at `model_s` (Note [link transit])."""
    return 1 + extra_s / model_s if model_s > 0 else 1.0
