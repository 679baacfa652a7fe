"""Fault injection for tests and demos: `hetc run ... --inject 'slow rank=R factor=F from=S [until=U]'` and
`--inject 'slow link=A-B factor=F from=S [until=U]'`, each with an optional `world=N`.

A slowed rank computes `factor` times slower from step S (0-based, the step index the run prints as S+1)
until step U (exclusive; for good when absent): after each of its compute instructions it waits
(factor - 1) times as long as the instruction took, as a throttled GPU or a noisy neighbour would
stretch it. The rest of the run is untouched, so the losses are those of an unperturbed run; only the
time changes (what live rebalancing, runtime/rebalance.py, must notice).

`world=N` holds an injection only while the run has N ranks: an elastic run (`--elastic`) re-plans as
nodes leave and join, and each plan numbers its ranks afresh, so "rank 0" names a different GPU in each;
`world=` says which plan's rank is meant.

On a GPU the host times a kernel launch, not the kernel, so an injected rank synchronizes its device
around each compute instruction to measure it: an injected run is a test of the job's reaction, not a
measurement of its speed.

Note [a slowed link]
A slowed link delivers every point-to-point message between ranks A and B, either way, `factor` times
as late: once the receive completes, the receiving rank waits (factor - 1) times the message's time
before the message counts as arrived. Two choices differ from a slowed rank's:
- *the receiving side only*: a message is one transfer, late where it arrives. The sender's side
  cannot be stretched too without counting it twice (gloo and NCCL both hand a message over when the
  receiver has posted for it, so the sender's completion already waits for the receiver's).
- *the message's time is the plan's*: the cost model's time of the message on that link (latency and
  bytes over bandwidth, `CostModel.p2p_transfer_time`), not a measured one. A host cannot time a
  transfer apart from the wait for its peer: from post to completion a receive also waits for the
  sender to compute what it sends. So an F-times link reads as F times slower (runtime/links.py
  measures it) where the plan's link model matches the machine's, as the demo's latency is set to
  gloo's on loopback, and as 1 + (F - 1) x planned / machine time elsewhere.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetc.ir.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["Injection", "LinkSlowdown", "Slowdown", "check_ranks", "compute_factor", "injection_from_dict",
           "link_factor", "parse_injection", "stretch", "synchronize"]

_KEYS = {"rank", "link", "factor", "from", "until", "world"}
_FORM = ("`slow rank=R factor=F [from=S] [until=U] [world=N]` or "
         "`slow link=A-B factor=F [from=S] [until=U] [world=N]`")


class _Steps:
    """The steps [start, until) an injection holds over (`until` None: for good), in a run of `world` ranks
    (None: of any size)."""

    start: int
    until: int | None
    world: int | None

    def active(self, step: int, world: int) -> bool:
        return self.start <= step and (self.until is None or step < self.until) and self.world in (None, world)


@dataclass(frozen=True)
class Slowdown(_Steps):
    """One `slow rank=` injection: `rank` computes `factor` times slower over steps [start, until)."""

    rank: int
    factor: float
    start: int = 0
    until: int | None = None
    world: int | None = None


@dataclass(frozen=True)
class LinkSlowdown(_Steps):
    """One `slow link=` injection: messages between the two ranks of `link` (lower first), either way,
    arrive `factor` times as late over steps [start, until) (Note [a slowed link])."""

    link: tuple[int, int]
    factor: float
    start: int = 0
    until: int | None = None
    world: int | None = None


Injection = Slowdown | LinkSlowdown


def injection_from_dict(fields: dict) -> Injection:
    """The injection `dataclasses.asdict` wrote (the options travel to the ranks as JSON)."""
    if "link" in fields:
        return LinkSlowdown(**{**fields, "link": tuple(fields["link"])})
    return Slowdown(**fields)


def parse_injection(text: str) -> Injection:
    """`slow rank=R ...` or `slow link=A-B ...` (`_FORM`), or a UsageError that quotes it and says what is wrong."""
    words = text.split()
    if not words or words[0] != "slow":
        raise UsageError(f"--inject '{text}': expected {_FORM}")
    fields: dict[str, str] = {}
    for word in words[1:]:
        m = re.fullmatch(r"([a-z]+)=(\S+)", word)
        if m is None or m[1] not in _KEYS:
            raise UsageError(f"--inject '{text}': '{word}' is not one of {', '.join(sorted(k + '=' for k in _KEYS))}")
        fields[m[1]] = m[2]
    if ("rank" in fields) == ("link" in fields):
        both = "both" if "rank" in fields else "neither"
        raise UsageError(f"--inject '{text}': name one rank= or one link=, not {both}")
    if "factor" not in fields:
        raise UsageError(f"--inject '{text}': factor missing")
    try:
        factor, start = float(fields["factor"]), int(fields.get("from", 0))
        until = int(fields["until"]) if "until" in fields else None
        world = int(fields["world"]) if "world" in fields else None
        got: Injection = Slowdown(int(fields["rank"]), factor, start, until, world) if "rank" in fields else \
            LinkSlowdown(_link(fields["link"]), factor, start, until, world)
    except ValueError as err:
        raise UsageError(f"--inject '{text}': {err}") from None
    who = got.rank if isinstance(got, Slowdown) else max(got.link)
    if min(_ranks(got)) < 0 or not 1 <= got.factor < math.inf or got.start < 0 \
            or (got.until is not None and got.until <= got.start):
        raise UsageError(f"--inject '{text}': needs ranks >= 0, a finite factor >= 1 and 0 <= from < until")
    if got.world is not None and not who < got.world:     # a plan of N ranks numbers them 0..N-1
        raise UsageError(f"--inject '{text}': a plan of world={got.world} ranks has no rank {who}")
    return got


def _ranks(inj: Injection) -> tuple[int, ...]:
    return (inj.rank,) if isinstance(inj, Slowdown) else inj.link


def check_ranks(injections: tuple[Injection, ...], world: int) -> None:
    """A UsageError for an injection that would slow nothing in a run of this plan alone: one naming a rank
    the plan does not have, or held to another number of ranks (`world=`, for elastic runs)."""
    for inj in injections:
        if inj.world not in (None, world):
            raise UsageError(f"--inject: world={inj.world}, but the plan has {world} ranks and keeps them "
                             "(world= is for --elastic runs, whose re-plans change it)")
        if max(_ranks(inj)) >= world:
            what = f"rank={inj.rank}" if isinstance(inj, Slowdown) else f"link={inj.link[0]}-{inj.link[1]}"
            raise UsageError(f"--inject: {what} is not a rank of the plan's {world} (0..{world - 1})")


def _link(text: str) -> tuple[int, int]:
    """`A-B`: two different ranks, lower first."""
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if m is None or m[1] == m[2]:
        raise ValueError(f"link={text} is not two different ranks A-B")
    a, b = int(m[1]), int(m[2])
    return (min(a, b), max(a, b))


def compute_factor(injections: tuple[Injection, ...], rank: int, step: int, world: int) -> float:
    """How many times slower `rank` of a `world`-rank plan computes in `step`."""
    return math.prod((inj.factor for inj in injections
                      if isinstance(inj, Slowdown) and inj.rank == rank and inj.active(step, world)), start=1.0)


def link_factor(injections: tuple[Injection, ...], a: int, b: int, step: int, world: int) -> float:
    """How many times as late messages between ranks `a` and `b` of a `world`-rank plan arrive in `step`
    (Note [a slowed link])."""
    link = (min(a, b), max(a, b))
    return math.prod((inj.factor for inj in injections
                      if isinstance(inj, LinkSlowdown) and inj.link == link and inj.active(step, world)),
                     start=1.0)


def stretch(seconds: float, factor: float) -> None:
    """Wait out the extra time of an instruction that took `seconds` at `factor` times slower."""
    if factor > 1 and seconds > 0:
        time.sleep((factor - 1) * seconds)


def synchronize(device: torch.device) -> None:
    """Finish the device's queued work (a slowed GPU rank times its compute on the device)."""
    if device.type == "cuda":
        import torch     # here: `hetc run --help` and the CLI's parser read this module without torch

        torch.cuda.synchronize(device)
