"""The profile file `hetc profile` writes and the cost model reads (JSON, versioned).

    {
      "format": "hetc-profile", "version": 1,
      "device": {"kind": "cpu", "name": "...", "backend": "cpu" | "cuda", "memory": bytes, "count": n},
      "dtype": "fp32",
      "model": {"name", "arch", "hidden", "heads", "kv_heads", "ffn", "vocab", "block_params"},
      "layers": [{"layer": "embed" | "block" | "head", "tp": 1, "seq": S, "micro_batch": b,
                  "forward_s": t, "backward_s": t}, ...],
      "collectives": [{"kind": "all_reduce" | "all_gather" | ..., "ranks": n, "bytes": X, "seconds": t}, ...],
      "p2p": [{"bytes": X, "seconds": t}, ...],
      "copy": [{"direction": "h2d" | "d2h", "bytes": X, "seconds": t}, ...],
      "microbatch_overhead_s": t            (optional)
      "concurrency": {"ranks": n, "cores": c, "slowdown": s}   (optional)
      "core_wait": {"ranks": n, "cores": c, "collective_s": t, "p2p_s": t, "exchange_s": t,
                    "world_collective_s": t, "calls": k}   (optional; exchange_s, world_collective_s optional)
    }

`device.kind` is the catalog name the measurements apply to (GPUs of that
kind in a spec). Collective times are for the full buffer (`bytes`) over
`ranks` local processes; the link rate is recovered with the ring model.
The layer times are one process's alone; `concurrency` says the same
layers timed in n processes at once on this machine's c cores ran s times
slower (Note [shared cores] in cores.py: where a plan shares cores among n
ranks, the cost model takes n / s as their effective cores, which the ranks
computing at once share). `core_wait` says how much longer
than back to back one blocking collective and one message took, from
their last member's arrival, with n processes on c cores computing between
them (k calls each; Note [core wait]: the cost model adds it to every
blocking call where ranks outnumber the cores they share); `exchange_s`
the mean extra of a ring-attention shift, from each member's own entry
(Note [exchange wait]; without it a shift waits as a message);
`world_collective_s` the mean extra of an all-reduce over all n processes,
which collectives over n ranks or more wait (without it: `collective_s`). `microbatch_overhead_s` is what a stage of the executing engine spends per
microbatch outside its layers (dispatch, device synchronizations, loss
glue): a measured run's step time less its layers, per microbatch and stage.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from hetc.passes.cost.cores import CoreWait
from hetc.passes.cost.network import Bandwidth, MeasuredPoints, ring_chunk, ring_steps
from hetc.ir.program import Phase
from hetc.ir.spec import DType
from hetc.passes.cost.profiles import LAYER_SLOTS, ComputeTable, NetworkFits, ProfileError, Profiles, fit_line
from hetc.passes.cost.sources.measured_json import positive, read_measurements

__all__ = ["FORMAT", "VERSION", "profile_from_dict", "read_profile", "write_profile"]

FORMAT = "hetc-profile"
VERSION = 1


def write_profile(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **data}, indent=1) + "\n")


def read_profile(path: Path) -> Profiles:
    try:
        data = read_measurements(path)   # Note [finite measurements]
    except ProfileError as err:
        if err.file is not None:
            raise
        raise ProfileError(f"'{path}' is not a hetc profile: {err}") from None
    return profile_from_dict(data, str(path))


def profile_from_dict(data: Any, source: str) -> Profiles:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"'{source}' is not a hetc profile (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ProfileError(f"'{source}' is a version {data.get('version')} profile; this hetc reads "
                           f"version {VERSION}")
    try:
        kind = str(data["device"]["kind"])
        tables = _tables(data, kind, source)
        network = _network(data, kind, source)
        copy = _copy_rate(data, source)
        overhead = _overhead(data)
        shared = _shared(data, kind)
        core_wait = _core_wait(data, kind)
    except ProfileError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(f"'{source}': malformed hetc profile ({type(err).__name__}: {err})") from None
    return Profiles(tuple(tables), network, {kind: copy} if copy else {}, {kind: source} if copy else {},
                    {kind: overhead} if overhead is not None else {}, sources=(source,), shared=shared,
                    core_wait=core_wait)


def _shared(data: dict[str, Any], kind: str) -> dict[str, tuple[int, float]]:
    shared = data.get("concurrency")
    if shared is None:
        return {}
    ranks, slowdown = int(shared["ranks"]), float(shared["slowdown"])
    if ranks < 1 or not slowdown > 0:   # also rejects NaN
        raise ValueError(f"concurrency needs at least 1 rank and a positive slowdown, not {ranks} and {slowdown}")
    return {kind: (ranks, slowdown)}


def _core_wait(data: dict[str, Any], kind: str) -> dict[str, CoreWait]:
    wait = data.get("core_wait")
    if wait is None:
        return {}
    exchange, world = wait.get("exchange_s"), wait.get("world_collective_s")
    return {kind: CoreWait(int(wait["ranks"]), int(wait["cores"]), float(wait["collective_s"]),
                           float(wait["p2p_s"]), None if exchange is None else float(exchange),
                           None if world is None else float(world))}


def _tables(data: dict[str, Any], kind: str, source: str) -> list[ComputeTable]:
    model = data["model"]
    by_seq: dict[int, dict[tuple[str, int, Phase], list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for i, row in enumerate(data.get("layers", [])):
        if row["layer"] not in LAYER_SLOTS:
            raise ValueError(f"layer '{row['layer']}' is not one of {', '.join(LAYER_SLOTS)}")
        seq, key, mb = int(row["seq"]), (str(row["layer"]), int(row.get("tp", 1))), int(row["micro_batch"])
        for phase, field in ((Phase.FORWARD, "forward_s"), (Phase.BACKWARD, "backward_s")):
            by_seq[seq][key + (phase,)].append((mb, positive(float(row[field]), f"layers[{i}].{field}", source)))
    return [ComputeTable(source, kind, int(model["hidden"]), int(model["block_params"]), seq,
                         DType(str(data.get("dtype", "fp32"))).value, {k: fit_line(v) for k, v in points.items()},
                         int(model["vocab"]) if "vocab" in model else None, None, str(model.get("name", "")))
            for seq, points in sorted(by_seq.items())]


def _network(data: dict[str, Any], kind: str, source: str) -> NetworkFits:
    """One ring step's rate between two local processes, by ring size, from p2p and collectives."""
    points: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for i, row in enumerate(data.get("p2p", [])):
        nbytes, seconds = _transfer(row, f"p2p[{i}]", source)
        points[2].append((nbytes, nbytes / seconds))
    for i, row in enumerate(data.get("collectives", [])):
        n, (nbytes, seconds) = int(row["ranks"]), _transfer(row, f"collectives[{i}]", source)
        steps = ring_steps(str(row["kind"]), n)
        if steps:
            chunk = ring_chunk(nbytes, n)
            points[n].append((chunk, steps * chunk / seconds))
    intra: dict[tuple[str, int], Bandwidth] = {}
    for n, pts in points.items():
        by_size: dict[float, list[float]] = defaultdict(list)
        for size, rate in pts:
            by_size[size].append(rate)
        sizes = sorted(by_size)
        rates = tuple(sum(by_size[s]) / len(by_size[s]) for s in sizes)
        intra[(kind, n)] = MeasuredPoints(tuple(sizes), rates, source)
    return NetworkFits(intra=intra)


def _transfer(row: dict[str, Any], where: str, source: str) -> tuple[float, float]:
    """(bytes, seconds) of one timed transfer, both positive."""
    return (positive(float(row["bytes"]), f"{where}.bytes", source),
            positive(float(row["seconds"]), f"{where}.seconds", source))


def _copy_rate(data: dict[str, Any], source: str) -> float | None:
    rows = [_transfer(r, f"copy[{i}]", source) for i, r in enumerate(data.get("copy", []))]
    if not rows:
        return None
    largest = max(nbytes for nbytes, _ in rows)
    rates = [nbytes / seconds for nbytes, seconds in rows if nbytes == largest]
    return sum(rates) / len(rates)


def _overhead(data: dict[str, Any]) -> float | None:
    if "microbatch_overhead_s" not in data:
        return None
    seconds = float(data["microbatch_overhead_s"])
    if not seconds >= 0:   # also rejects NaN
        raise ValueError(f"microbatch_overhead_s must be a time of at least 0 s, not {seconds}")
    return seconds
