"""What both importers need: catalog devices, node-group bookkeeping, rank slices, rendering."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetc.ir.errors import UsageError
from hetc.ir.jsontypes import read_by_layout
from hetc.ir.userfile import read_user_text
from hetc.frontend.load import BUNDLED_SPECS, load_spec
from hetc.frontend.printer import format_spec
from hetc.ir.spec import DeviceSpec, IntraLinkSpec, LayerRange, ModelSpec, NodeSpec, RankSlice, Spec

__all__ = [
    "NodeBook",
    "catalog_devices",
    "gpu_slice",
    "laid_out",
    "layer_range",
    "read_input_json",
    "render",
    "require_dir",
]


def read_input_json(path: str | Path, what: str) -> Any:
    """A user-given JSON file; a missing or malformed one is a UsageError naming it."""
    p = Path(path)
    try:
        return json.loads(read_user_text(p, what))
    except json.JSONDecodeError as err:
        raise UsageError(f"the {what} '{p}' is not valid JSON: {err}") from None


def laid_out(what: str, path: str | Path) -> AbstractContextManager[None]:
    """Reading a user-given JSON file's values by its system's layout: one of another type or shape is a
    UsageError naming the file (`read_by_layout`)."""
    return read_by_layout(lambda detail: UsageError(f"the {what} '{path}' is not laid out as expected: {detail}"))


def require_dir(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"the {what} '{p}' is not a directory")
    return p


def catalog_devices(names: set[str]) -> tuple[DeviceSpec, ...]:
    """The catalog's device kinds for `names` (copied into the imported spec: it stands alone)."""
    catalog = {d.name: d for d in load_spec(BUNDLED_SPECS / "catalog.het").spec.devices}
    missing = sorted(n for n in names if n not in catalog)
    if missing:
        raise UsageError(f"no device kind {', '.join(missing)} in specs/catalog.het; add it there first")
    return tuple(catalog[n] for n in sorted(names))


def _ident(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_").lower()
    return name if name and not name[0].isdigit() else f"g_{name}"


@dataclass
class NodeBook:
    """Node groups keyed by (device kind, GPUs per node, zone); hands out nodes in order."""

    counts: dict[tuple[str, int, str], int] = field(default_factory=dict)

    def name_of(self, key: tuple[str, int, str]) -> str:
        kind, gpus, zone = key
        return _ident(f"{kind}_{gpus}_{zone}")

    def take(self, kind: str, gpus: int, zone: str) -> tuple[str, int]:
        """A fresh node of this kind: (group name, node index)."""
        key = (kind, gpus, zone)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        return self.name_of(key), index

    def node_specs(self, region_of: Callable[[str], str],
                   intra_of: Callable[[str, int], IntraLinkSpec | None]) -> tuple[NodeSpec, ...]:
        """The node groups, named; `region_of(zone)` and `intra_of(kind, gpus)` fill in their links."""
        return tuple(NodeSpec(name=self.name_of((kind, gpus, zone)), device=kind, count=count, gpus=gpus,
                              region=region_of(zone), zone=zone, intra=intra_of(kind, gpus))
                     for (kind, gpus, zone), count in sorted(self.counts.items()))


def gpu_slice(group: str, node: int, first: int, stop: int) -> RankSlice:
    """`group[node, first:stop]`."""
    return RankSlice(group=group, node_start=node, node_stop=None, gpu_start=first, gpu_stop=stop,
                     node_is_slice=False, gpu_is_slice=True)


def layer_range(model: ModelSpec, first: int, stop: int) -> LayerRange:
    return LayerRange(first=model.layer_name(first), last=model.layer_name(stop - 1))


def render(spec: Spec, header: list[str]) -> str:
    return "".join(f"# {line}\n" if line else "#\n" for line in header) + "\n" + format_spec(spec)
