"""Units of the spec language; every quantity is stored in base SI units.

memory in bytes, bandwidth in bytes/s, compute in FLOP/s, time in seconds,
prices in $/hour and $/GB, throughput in tokens/s.
"""

from __future__ import annotations

import math
from enum import StrEnum

__all__ = ["DISPLAY", "UNITS", "Dim", "counted", "format_quantity", "human_bytes", "human_count", "human_rate",
           "human_seconds", "to_base", "units_of"]


class Dim(StrEnum):
    MEMORY = "memory"
    BANDWIDTH = "bandwidth"
    COMPUTE = "compute"
    TIME = "time"
    PRICE_HOUR = "price per hour"
    PRICE_GB = "price per GB"
    THROUGHPUT = "throughput"


_K, _M, _G, _T, _P = 1e3, 1e6, 1e9, 1e12, 1e15

# unit text -> (dimension, factor to base)
UNITS: dict[str, tuple[Dim, float]] = {
    "B": (Dim.MEMORY, 1), "KB": (Dim.MEMORY, _K), "MB": (Dim.MEMORY, _M), "GB": (Dim.MEMORY, _G),
    "TB": (Dim.MEMORY, _T), "KiB": (Dim.MEMORY, 2**10), "MiB": (Dim.MEMORY, 2**20),
    "GiB": (Dim.MEMORY, 2**30), "TiB": (Dim.MEMORY, 2**40),
    "B/s": (Dim.BANDWIDTH, 1), "KB/s": (Dim.BANDWIDTH, _K), "MB/s": (Dim.BANDWIDTH, _M),
    "GB/s": (Dim.BANDWIDTH, _G), "TB/s": (Dim.BANDWIDTH, _T), "MiB/s": (Dim.BANDWIDTH, 2**20),
    "GiB/s": (Dim.BANDWIDTH, 2**30), "Mb/s": (Dim.BANDWIDTH, _M / 8), "Gb/s": (Dim.BANDWIDTH, _G / 8),
    "Tb/s": (Dim.BANDWIDTH, _T / 8), "Mbps": (Dim.BANDWIDTH, _M / 8), "Gbps": (Dim.BANDWIDTH, _G / 8),
    "FLOP/s": (Dim.COMPUTE, 1), "GFLOP/s": (Dim.COMPUTE, _G), "TFLOP/s": (Dim.COMPUTE, _T),
    "PFLOP/s": (Dim.COMPUTE, _P), "TFLOPS": (Dim.COMPUTE, _T),
    "s": (Dim.TIME, 1), "ms": (Dim.TIME, 1e-3), "us": (Dim.TIME, 1e-6), "ns": (Dim.TIME, 1e-9),
    "$/h": (Dim.PRICE_HOUR, 1), "$/hr": (Dim.PRICE_HOUR, 1),
    "$/GB": (Dim.PRICE_GB, 1),
    "tokens/s": (Dim.THROUGHPUT, 1),
}

# the units `hetc fmt` and `hetc plan` print, largest first
DISPLAY: dict[Dim, tuple[str, ...]] = {
    Dim.MEMORY: ("TiB", "GiB", "MiB", "KiB", "GB", "MB", "B"),
    Dim.BANDWIDTH: ("TB/s", "GB/s", "Gb/s", "MB/s", "B/s"),
    Dim.COMPUTE: ("PFLOP/s", "TFLOP/s", "GFLOP/s", "FLOP/s"),
    Dim.TIME: ("s", "ms", "us", "ns"),
    Dim.PRICE_HOUR: ("$/h",),
    Dim.PRICE_GB: ("$/GB",),
    Dim.THROUGHPUT: ("tokens/s",),
}


def units_of(dim: Dim) -> list[str]:
    return [u for u, (d, _) in UNITS.items() if d == dim]


def to_base(value: float, unit: str) -> tuple[Dim, float]:
    """(dimension, value in base units); KeyError for an unknown unit."""
    dim, factor = UNITS[unit]
    return dim, _scale(value, factor)


def _scale(value: float, factor: float) -> float:
    # Divide by 1e6 rather than multiply by 1e-6: "5 us" is then exactly 5e-06.
    return value / round(1 / factor) if factor < 1 else value * factor


def _short(x: float) -> str:
    if x == int(x) and abs(x) < 1e16:
        return str(int(x))
    return repr(x)


def format_quantity(base: float, dim: Dim) -> str:
    """The shortest display that parses back to exactly `base`."""
    candidates = []
    for unit in DISPLAY[dim]:
        factor = UNITS[unit][1]
        shown = base * round(1 / factor) if factor < 1 else base / factor
        if not math.isfinite(shown):
            continue
        for digits in (6, 12, 17):
            text = _short(float(f"{shown:.{digits}g}"))
            if _scale(float(text), factor) == base:
                candidates.append((len(text), abs(shown) < 1 and base != 0, f"{text} {unit}"))
                break
    if not candidates:
        unit = DISPLAY[dim][-1]
        return f"{_short(base / UNITS[unit][1])} {unit}"  # only for inf/nan, never parsed back
    return min(candidates)[2]


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(seconds: float, digits: int = 3) -> str:
    """A duration in the unit that reads, to `digits` significant digits: '25.1 s' (not '25095.02 ms'),
    '41.3 ms', '1,204 s'. Every step time hetc prints goes through here."""
    if abs(seconds) >= 10 ** (digits - 1):
        return f"{seconds:,.0f} s"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= size:
            return f"{seconds / size:.{digits}g} {unit}"
    return f"{seconds:.{digits}g} s"


def human_rate(flops: float) -> str:
    for unit, size in (("EFLOP/s", 1e18), ("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= size:
            return f"{flops / size:.2f} {unit}"
    return f"{flops:.0f} FLOP/s"


def human_count(n: float) -> str:
    """A parameter count as model cards write it: '65.29B', '124.4M', '0.2M'."""
    return f"{n / 1e9:.2f}B" if abs(n) >= 1e9 else f"{n / 1e6:.1f}M"


def counted(count: int, noun: str) -> str:
    """'1 stage', '3 stages', '2 microbatches': a count and its noun, in the plural unless it is 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('ch') else 's'}"
