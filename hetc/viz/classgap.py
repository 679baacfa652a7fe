"""Predicted against measured, one TimeClass at a time: `hetc viz --compare` and `hetc calibrate`.

Both sides are split by Note [time classes] (hetc/ir/timeline.py) and averaged
over ranks, so a gap names the term of the cost model that is off: compute
(layer times), communication wait (links, and the schedule's waits),
optimizer or offload (host copies).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from hetc.ir.errors import UsageError
from hetc.ir.userfile import require_regular_file
from hetc.ir.jsontypes import JsonObject
from hetc.ir.timeline import TimeClass, mean_class_times

__all__ = ["ClassGap", "class_gaps", "gap_table", "measured_from_metrics", "read_measured", "worst_gap"]


@dataclass(frozen=True, slots=True)
class ClassGap:
    time_class: str
    predicted_s: float     # mean per rank, one step
    measured_s: float

    @property
    def gap_s(self) -> float:
        return self.measured_s - self.predicted_s

    @property
    def ratio(self) -> float | None:
        """measured / predicted; None when nothing was predicted."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else None

    def to_json(self) -> JsonObject:
        return {"class": self.time_class, "predicted_s": self.predicted_s, "measured_s": self.measured_s,
                "gap_s": self.gap_s, "ratio": self.ratio}


def class_gaps(predicted: dict[str, float], measured: dict[str, float]) -> list[ClassGap]:
    """One row per TimeClass, in the enum's order."""
    return [ClassGap(c.value, predicted.get(c.value, 0.0), measured.get(c.value, 0.0)) for c in TimeClass]


def worst_gap(gaps: list[ClassGap]) -> ClassGap | None:
    """The class whose measured time is furthest from its prediction (in seconds); None if all agree."""
    off = max(gaps, key=lambda g: abs(g.gap_s), default=None)
    return off if off is not None and off.gap_s != 0 else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def gap_table(gaps: list[ClassGap], predicted_step: float, measured_step: float) -> str:
    """A short text table: a row per class and one for the step, then the term most off."""
    rows = [("class", "predicted ms", "measured ms", "gap ms", "measured/predicted")]
    rows += [(g.time_class, _ms(g.predicted_s), _ms(g.measured_s), f"{g.gap_s * 1e3:+.3f}",
              f"×{g.ratio:.2f}" if g.ratio is not None else "-") for g in gaps]
    step_ratio = f"×{measured_step / predicted_step:.2f}" if predicted_step > 0 else "-"
    rows.append(("step", _ms(predicted_step), _ms(measured_step), f"{(measured_step - predicted_step) * 1e3:+.3f}",
                 step_ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    off = worst_gap(gaps)
    if off is not None:
        how = f"×{off.ratio:.2f} of predicted" if off.ratio is not None else "none predicted"
        lines.append(f"most off: {off.time_class}, {off.gap_s * 1e3:+.3f} ms a step per rank ({how})")
    return "\n".join(lines)


def measured_from_metrics(path: Path, skip: int = 1) -> tuple[dict[str, float], float]:
    """(median over steps of the mean per rank of each class, median step seconds) of a `--metrics` file.

    The first `skip` steps are left out while more remain (warm-up: allocation, first-touch, caches).
    """
    steps = [step for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()
             if (step := _timed_step(line, f"{path}:{n}")) is not None]
    if not steps:
        raise ValueError(f"{path}: no step with class_times_s (write it with `hetc run --metrics`)")
    kept = steps[skip:] if len(steps) > skip else steps
    per_step = [mean_class_times(per_rank) for per_rank, _ in kept]
    classes = {c.value: statistics.median(s[c.value] for s in per_step) for c in TimeClass}
    return classes, statistics.median(seconds for _, seconds in kept)


def _timed_step(line: str, where: str) -> tuple[list[dict[str, float]], float] | None:
    """A metrics line's (seconds per class of each rank, step seconds); None for a step without class times."""
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(record, dict):
        raise TypeError(f"{where}: expected one JSON object a line, got {type(record).__name__}")
    per_rank, step = record.get("class_times_s"), record.get("step_time_s")
    if not per_rank:
        return None
    if not _seconds(step):
        raise ValueError(f"{where}: step_time_s must be seconds (a number ≥ 0), not {step!r}")
    if not isinstance(per_rank, list) or not all(
            isinstance(r, dict) and all(_seconds(r.get(c.value, 0.0)) for c in TimeClass) for r in per_rank):
        classes = ", ".join(c.value for c in TimeClass)
        raise ValueError(f"{where}: class_times_s must list one object a rank of seconds per class ({classes})")
    return per_rank, float(step)   # type: ignore[arg-type]   # checked above


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def read_measured(path: Path) -> tuple[dict[str, float], float]:
    """`measured_from_metrics` of a file the user named: a file that is not one is a UsageError."""
    require_regular_file(path, "metrics file")   # Note [untrusted paths]
    try:
        return measured_from_metrics(path)
    except OSError as err:
        raise UsageError(f"{path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file (a `hetc run --metrics` file is JSON lines)") from None
    except (ValueError, TypeError) as err:   # names the file and line
        raise UsageError(str(err)) from None
