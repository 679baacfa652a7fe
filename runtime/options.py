"""The options of `hetc run` as one value: what every rank runs with (torch-free, so that the `--local`
launcher hands them to its ranks without importing torch).

The ranks `hetc run --local` starts read the launcher's RunOptions from RUN_OPTIONS_ENV (`to_json`): the
one set of options, not a command line rebuilt from them, where an option could be left out.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from hetc.ir.spec import TrainSpec
from hetc.runtime.inject import Injection, injection_from_dict
from hetc.runtime.rebalance import RebalanceOptions

__all__ = ["DIVERGED_STATUS", "RUN_OPTIONS_ENV", "NonFinite", "RunOptions"]

RUN_OPTIONS_ENV = "HETC_RUN_OPTIONS"   # set by `hetc run --local` in the environment of its ranks


class NonFinite(StrEnum):
    """What `hetc run` does after a step whose loss or gradient norm is not finite."""

    STOP = "stop"
    SKIP = "skip"


DIVERGED_STATUS = 3   # a run stopped by a non-finite step (1 is a failure, 2 bad input, 143 preempted)


@dataclass(frozen=True)
class RunOptions:
    steps: int | None = None
    metrics: Path | None = None
    tensorboard: Path | None = None     # rank 0 writes TensorBoard event files here
    wandb: str | None = None            # rank 0 logs to this Weights & Biases project
    trace: Path | None = None
    checkpoint: Path | None = None
    every: int = 0
    keep: int | None = None
    resume: bool = False                # resume from --checkpoint; a directory holding none is an error
    resume_if_present: bool = False     # resume when there is a checkpoint, else start at step 0 (--elastic)
    weights_from: Path | None = None    # --load-weights-only: a checkpoint's weights, when nothing is resumed
    timeout_s: float = 120.0            # a step's collectives and messages (Note [Init and step timeouts])
    init_timeout_s: float = 300.0       # the rendezvous and creating the process groups
    heartbeat_timeout_s: float = 10.0
    grace_s: float = 30.0
    exit_after_s: float | None = None   # --exit-after: stop, save and exit 0 this long after a rank starts
    elastic: bool = False
    quiet: bool = False
    log_every: int = 1                  # --log-every: a step line every N steps (their means)
    on_nonfinite: NonFinite = NonFinite.STOP
    rebalance: RebalanceOptions | None = None     # --rebalance: Note [live rebalancing] in runtime/rebalance.py
    inject: tuple[Injection, ...] = ()            # --inject: runtime/inject.py

    def to_json(self) -> str:
        """These options as JSON (`from_json` reads them back equal)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["rebalance"] = None if self.rebalance is None else dataclasses.asdict(self.rebalance)
        fields["inject"] = [dataclasses.asdict(s) for s in self.inject]
        return json.dumps({k: str(v) if isinstance(v, Path | StrEnum) else v for k, v in fields.items()})

    @classmethod
    def from_json(cls, text: str) -> RunOptions:
        """The options `to_json` wrote."""
        fields = json.loads(text)
        paths = {f.name for f in dataclasses.fields(cls) if "Path" in str(f.type)}
        fields.update({k: Path(v) for k, v in fields.items() if k in paths and v is not None})
        fields["on_nonfinite"] = NonFinite(fields["on_nonfinite"])
        fields["rebalance"] = None if fields["rebalance"] is None else RebalanceOptions(**fields["rebalance"])
        fields["inject"] = tuple(injection_from_dict(s) for s in fields["inject"])
        return cls(**fields)

    def plan_problem(self, train: TrainSpec) -> str:
        """Why these options cannot run a job of `train` ('' where they can): checked by `hetc run --local`
        once before any rank starts, and by every rank (under torchrun no launcher reads the plan)."""
        if self.on_nonfinite is NonFinite.SKIP and not train.grad_clip:
            return ("--on-nonfinite skip needs train.grad_clip in the spec: the global gradient norm it checks "
                    "before the update is computed only under clipping (Note [non-finite steps] in "
                    "runtime/worker.py)")
        return ""
