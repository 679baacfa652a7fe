"""Read a Sailor data folder: models, per-layer profiles and network fits.

Layout (as in Sailor's repository): `training_config_*.json` (model and
batch), `llm_info.json` (parameters per layer and TP degree),
`profiles/<MODEL>/<GPU>/profile.json` (`{micro_batch: {tp: {layer:
[fwd_s, bwd_s, update_s]}}}`, layer 0 the embedding, the last the final
norm and LM head), `network_coeffs_all_homo.json`,
`intra_node_bandwidths.json` and `multizone_bandwidths_het.json` (fits
`[[a, b, c], cap]`, see network.QuadraticLogFit), `basic_cluster_config.json`,
`prices.json`.

A profile is used only if its layer count fits the model it is filed under
(L + 2 entries, or L + 3 with the final norm apart from the head): a profile
of another shape would silently time the wrong model.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetc.passes.cost.sources.devices import catalog_name
from hetc.passes.cost.network import Bandwidth, QuadraticLogFit
from hetc.passes.cost.profiles import ComputeTable, NetworkFits, ProfileError, Profiles, Rejected, fit_line
from hetc.passes.cost.sources.measured_json import read_measurements
from hetc.ir.program import Phase
from hetc.ir.jsontypes import read_by_layout
from hetc.ir.spec import Arch

__all__ = ["SailorModel", "looks_like", "read_json", "read_models", "read_sailor"]

_GPT_TYPES = {"gpt", "gpt2", "opt", "gpt_neo", "gptneo", "gpt-neo"}


def read_json(path: Path) -> Any:
    """A file of the folder; every number in it finite (Note [finite measurements])."""
    return read_measurements(path)


def looks_like(path: Path) -> bool:
    return path.is_dir() and ((path / "profiles").is_dir()
                              or (path / "network_coeffs_all_homo.json").is_file())


@dataclass(frozen=True)
class SailorModel:
    """A model as Sailor describes it, with what llm_info.json adds (the runs' real counts)."""

    name: str
    arch: Arch
    hidden: int
    layers: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    global_batch: int
    dtype_bytes: int            # 4: fp32 weights, TF32 matmuls in the profiles and runs
    block_params: int | None    # from llm_info.json
    head_has_matrix: bool       # the last layer holds a V×H matrix (untied, or a tied copy)


def read_models(folder: Path) -> dict[str, SailorModel]:
    """Models with a training config in `folder`, keyed by Sailor's model name."""
    info = _optional_json(folder / "llm_info.json") or {}
    out = {}
    for path in sorted(folder.glob("training_config_*.json")):
        cfg = read_json(path)
        try:
            model = _model(cfg, info.get(cfg["model"], {}).get("1"))
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileError(f"'{path}' is not a Sailor training config: missing or bad {err}") from None
        out[model.name] = model
    return out


def _model(cfg: dict[str, Any], layers_info: dict[str, Any] | None) -> SailorModel:
    kind = str(cfg.get("type", "gpt2")).lower()
    arch = Arch.GPT if kind in _GPT_TYPES else Arch.LLAMA
    hidden, seq = int(cfg["hidden_size"]), int(cfg["sequence_length"])
    ffn = int(cfg.get("ffn_hidden_size", cfg.get("intermediate_size", 4 * hidden)))
    vocab, block, head_matrix, dtype_bytes = int(cfg["vocab_size"]), None, True, 4
    if layers_info:
        embed = layers_info["0"]
        pos = int(cfg.get("max_position_embeddings", seq)) if arch is Arch.GPT else 0
        if embed["params_floats"] % hidden == 0:
            vocab = embed["params_floats"] // hidden - pos  # the padded vocabulary that ran
        block = int(layers_info["1"]["params_floats"])
        last = layers_info[str(len(layers_info) - 1)]["params_floats"]
        head_matrix = last >= vocab * hidden
        dtype_bytes = round(embed["params_bytes"] / embed["params_floats"])
    return SailorModel(str(cfg["model"]), arch, hidden, int(cfg["num_layers"]), int(cfg["heads"]), seq,
                       vocab, ffn, int(cfg.get("global_batch_size", 1)), dtype_bytes, block, head_matrix)


def _optional_json(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def read_sailor(folder: Path) -> Profiles:
    models = read_models(folder)
    tables, rejected = [], []
    for path in sorted(folder.glob("profiles/*/*/profile.json")):
        name, gpu = path.parent.parent.name, path.parent.name
        model = models.get(name)
        if model is None:
            rejected.append(Rejected(name, str(path), f"no training_config_*.json describes model '{name}'"))
            continue
        table, why = _table(path, model, catalog_name(gpu))
        if table is None:
            rejected.append(Rejected(name, str(path), why))
        else:
            tables.append(table)
    return Profiles(tuple(tables), _network(folder), rejected=tuple(rejected), sources=(str(folder),))


def _table(path: Path, model: SailorModel, device: str) -> tuple[ComputeTable | None, str]:
    data = read_json(path)
    _check_times(data, str(path))
    points: dict[tuple[str, int, Phase], list[tuple[float, float]]] = {}
    try:
        for mb, per_tp in data.items():
            for tp, per_layer in per_tp.items():
                n = len(per_layer)
                if n not in (model.layers + 2, model.layers + 3):
                    return None, (f"it has {n} layers but {model.name} has {model.layers} blocks "
                                  f"(expected {model.layers + 2} entries)")
                for slot, entries in _slots(per_layer, n, model.layers).items():
                    for phase, col in ((Phase.FORWARD, 0), (Phase.BACKWARD, 1)):
                        t = sum(e[col] for e in entries) if slot == "head" else \
                            sum(e[col] for e in entries) / len(entries)
                        points.setdefault((slot, int(tp), phase), []).append((int(mb), t))
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as err:
        return None, f"not a Sailor profile ({err})"
    fits = {key: fit_line(pts) for key, pts in points.items()}
    # 4-byte runs were measured with TF32 matmuls (their layers beat the fp32 peak: hetc/importers/sailor.py)
    dtype = "tf32" if model.dtype_bytes == 4 else "fp16"
    block = model.block_params if model.block_params is not None else 0
    return ComputeTable(str(path), device, model.hidden, block, model.seq, dtype, fits, model.vocab,
                        model.layers, model.name), ""


def _check_times(data: Any, source: str) -> None:
    """Refuse a negative time (Sailor records 0 for work a layer does not do: no update of a norm)."""
    if not isinstance(data, dict):
        return   # not a Sailor profile: `_table` says so
    for mb, per_tp in data.items():
        for tp, per_layer in per_tp.items() if isinstance(per_tp, dict) else ():
            for layer, entry in per_layer.items() if isinstance(per_layer, dict) else ():
                for col, value in enumerate(entry if isinstance(entry, list) else []):
                    if isinstance(value, (int, float)) and value < 0:
                        raise ProfileError(f"{mb}.{tp}.{layer}[{col}] is {value}; layer times cannot be "
                                           "negative", file=source)


def _slots(per_layer: dict[str, Any], n: int, blocks: int) -> dict[str, list[list[float]]]:
    """Embedding, the blocks (averaged: they are identical) and the head (final norm + LM head)."""
    entries = [per_layer[str(i)] for i in range(n)]
    return {"embed": entries[:1], "block": entries[1:1 + blocks], "head": entries[1 + blocks:]}


def _network(folder: Path) -> NetworkFits:
    intra: dict[tuple[str, int], Bandwidth] = {}
    inter: dict[tuple[str, str, int, str, str, int], Bandwidth] = {}
    inter_any: dict[tuple[str, int], Bandwidth] = {}
    homo_path, intra_path = folder / "network_coeffs_all_homo.json", folder / "intra_node_bandwidths.json"
    het_path = folder / "multizone_bandwidths_het.json"
    homo = _optional_json(homo_path) or {}
    with _laid_out(homo_path):
        homo_intra, homo_inter = homo.get("intra", {}), homo.get("inter", {})
    for table, source in ((homo_intra, homo_path), (_optional_json(intra_path) or {}, intra_path)):
        with _laid_out(source):
            for gpu, per_count in table.items():
                for count, fit in per_count.items():
                    intra[(catalog_name(gpu), int(count))] = _fit(fit, source)
    with _laid_out(homo_path):
        for gpu, per_count in homo_inter.items():
            for count, fit in per_count.items():
                inter_any[(catalog_name(gpu), int(count))] = _fit(fit, homo_path)
    het = _optional_json(het_path) or {}
    with _laid_out(het_path):
        for za, per_gpu in het.items():
            for ga, per_count in per_gpu.items():
                for ca, per_zone in per_count.items():
                    for zb, per_gpu_b in per_zone.items():
                        for gb, per_count_b in per_gpu_b.items():
                            for cb, fit in per_count_b.items():
                                key = (za, catalog_name(ga), int(ca), zb, catalog_name(gb), int(cb))
                                inter[key] = _fit(fit, het_path)
    return NetworkFits(intra, inter, inter_any)


def _laid_out(source: Path) -> AbstractContextManager[None]:
    """Walking a network table's nested objects (GPU kind -> GPU count -> fit, and by zone for the multizone
    one): a level that is not an object, or a count that is not a number, is a ProfileError naming the file."""
    return read_by_layout(lambda detail: ProfileError("not laid out as Sailor's network tables are (objects by "
                                                      f"GPU kind, then GPU count): {detail}", file=str(source)),
                          keep=(ProfileError,))


def _fit(raw: Any, source: Path) -> QuadraticLogFit:    # raw: parsed JSON, ((a, b, c), cap)
    try:
        (a, b, c), cap = raw
        return QuadraticLogFit(float(a), float(b), float(c), float(cap), str(source))
    except (TypeError, ValueError) as err:
        raise ProfileError(f"a Sailor network fit must be [[a, b, c], cap], got {raw!r} ({err})") from None
