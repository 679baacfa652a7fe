"""Read a Zorse data folder: per-block latency fits and model shapes.

`data/model_latencies.json`: `model → gpu → seq_len → dtype →
[[fwd_slope, fwd_intercept], [bwd_slope, bwd_intercept], [fwd_ms...],
[bwd_ms...]]` (milliseconds per transformer block, linear in the
micro-batch size; the raw lists are optional). `data/model_stats.json`:
hidden size, blocks and parameters per block. Zorse does not use tensor
parallelism, so every table is for tp = 1; embedding and head are not
measured (the cost model times them from FLOPs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetc.passes.cost.sources.devices import catalog_name
from hetc.passes.cost.profiles import ComputeTable, LinearFit, ProfileError, Profiles, Rejected
from hetc.passes.cost.shapes import LayerKind
from hetc.passes.cost.sources.sailor_data import read_json
from hetc.ir.jsontypes import read_by_layout
from hetc.ir.program import Phase

__all__ = ["DTYPES", "LATENCIES", "STATS", "looks_like", "read_zorse"]

LATENCIES = Path("data/model_latencies.json")
STATS = Path("data/model_stats.json")
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def looks_like(path: Path) -> bool:
    return path.is_dir() and (path / LATENCIES).is_file()


def read_zorse(folder: Path) -> Profiles:
    latencies = read_json(folder / LATENCIES)
    stats = read_json(folder / STATS) if (folder / STATS).is_file() else {}
    fail = f"not laid out as Zorse's data folder is ({LATENCIES}: objects by model, GPU, sequence length and dtype; " \
           f"{STATS}: each model's hidden_size, num_layers and parameters_per_layer)"
    with read_by_layout(lambda detail: ProfileError(f"{fail}: {detail}", file=str(folder)), keep=(ProfileError,)):
        return _read(folder, latencies, stats)


def _read(folder: Path, latencies: Any, stats: Any) -> Profiles:    # parsed JSON, walked by Zorse's layout
    tables, rejected = [], []
    for model, per_gpu in latencies.items():
        shape = stats.get(model)
        if shape is None:
            rejected.append(Rejected(model, str(folder / LATENCIES), f"model '{model}' is not in {STATS}"))
            continue
        for gpu, per_seq in per_gpu.items():
            for seq, per_dtype in per_seq.items():
                for dtype, entry in per_dtype.items():
                    fits = _fits(entry)
                    where = f"{folder / LATENCIES}: {model}/{gpu}/{seq}/{dtype}"
                    if fits is None or dtype not in DTYPES:
                        rejected.append(Rejected(model, where, "no forward and backward fit"))
                        continue
                    tables.append(ComputeTable(where, catalog_name(gpu), int(shape["hidden_size"]),
                                               int(shape["parameters_per_layer"]), int(seq), DTYPES[dtype],
                                               fits, None, int(shape["num_layers"]), model))
    return Profiles(tuple(tables), rejected=tuple(rejected), sources=(str(folder),))


def _fits(entry: Any) -> dict[tuple[str, int, Phase], LinearFit] | None:    # entry: parsed JSON
    try:
        (fs, fi), (bs, bi) = entry[0], entry[1]
        fwd, bwd = LinearFit(float(fi) / 1e3, float(fs) / 1e3), LinearFit(float(bi) / 1e3, float(bs) / 1e3)
    except (TypeError, ValueError, IndexError):
        return None
    return {(LayerKind.BLOCK, 1, Phase.FORWARD): fwd, (LayerKind.BLOCK, 1, Phase.BACKWARD): bwd}

