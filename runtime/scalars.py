"""Where rank 0 sends each step's scalars besides `--metrics`: TensorBoard and Weights & Biases.

Both take the same scalars (`step_scalars` in runtime/report.py: the fields of the metrics record that
are one number per step, peak memory as the maximum over ranks), tagged with the metrics field names,
so that docs/metrics.md describes all three. Neither package is imported before `hetc run` asks for it:
`missing_package` lets the command refuse a flag whose package is absent before any rank starts.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

__all__ = ["ScalarSink", "TensorBoardSink", "WandbSink", "missing_package"]

# flag -> (module it needs, what to install)
_PACKAGES = {
    "--tensorboard": ("tensorboard", "pip install tensorboard  (or hetc's extra: pip install 'hetc[tensorboard]')"),
    "--wandb": ("wandb", "pip install wandb"),
}


def missing_package(flag: str) -> str | None:
    """The usage error for `flag` when the package it writes through is not installed, else None."""
    module, install = _PACKAGES[flag]
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{flag} needs the `{module}` package, which is not installed: {install}"
    return None


class ScalarSink(Protocol):
    def add(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in `directory` through torch.utils.tensorboard, one scalar per tag and step."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def add(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()     # a run that dies later still leaves its steps readable

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in `project`; WANDB_MODE=offline (wandb's own variable) keeps it on disk."""

    def __init__(self, project: str, config: dict[str, Any]) -> None:
        wandb = importlib.import_module("wandb")    # not a dependency: no types to check against
        self.run = wandb.init(project=project, config=config)

    def add(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
