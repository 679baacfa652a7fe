"""What else the machine did while hetc measured it: the share of its CPU time a hypervisor took (steal).

On a virtual machine the host may run other machines on the cores this one
thinks it has; Linux counts the time its virtual cores waited for them as
`steal` (/proc/stat). Measurements taken while it is high time the host's
other work as well as hetc's, and on a shared host they move from one run to
the next (docs/costmodel.md, Known limits: `hetc run --local` on this 2-core
machine). `hetc profile` warns when it was high while it measured, and the
runtime-prediction benchmark prints it beside its figures.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["cpu_times", "steal_share"]

_STEAL = 7    # /proc/stat's `cpu` fields: user nice system idle iowait irq softirq steal ...


def cpu_times() -> list[int] | None:
    """The machine's CPU time so far by state (/proc/stat's `cpu` line, in ticks); None where there is none."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the CPUs' time between two `cpu_times` that the hypervisor gave to other machines; None
    where either is unknown or no time passed."""
    if before is None or after is None or min(len(before), len(after)) <= _STEAL:
        return None
    total = sum(after[:_STEAL + 1]) - sum(before[:_STEAL + 1])
    return (after[_STEAL] - before[_STEAL]) / total if total > 0 else None
