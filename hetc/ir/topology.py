"""The cluster as a list of GPUs and a link lookup between any two of them.

GPUs are numbered in declaration order (node group, node, GPU). Links are
looked up from most to least specific: the same node (its `intra` link, or
the device's default), a `link` between the two node groups, a `link`
between their zones, then their regions, then the cluster default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hetc.ir.memo import cached_property
from hetc.ir.spec import ClusterSpec, DeviceSpec, Spec

__all__ = ["DEFAULT_INTRA_BANDWIDTH", "MAX_GPUS", "Gpu", "Link", "Topology"]

# What bounds it is time and memory, not an algorithm: planning grows about linearly with the GPUs
# (9 s at 16,384, 20 s at 32,768 on 2 cores), and a compile holds every rank's program (issue 31).
MAX_GPUS = 1 << 18
# PCIe-class default when a node declares no intra link.
DEFAULT_INTRA_BANDWIDTH = 16e9
DEFAULT_INTRA_LATENCY = 5e-6


@dataclass(frozen=True, slots=True)
class Gpu:
    id: int                # index over every GPU of the cluster
    group: str             # node group
    node: int              # node index inside the group
    local: int             # GPU index inside the node
    device: DeviceSpec
    region: str
    zone: str
    # (group, node): the machine it sits on, made once (the planner and lowering ask it of every GPU often)
    host: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "host", (self.group, self.node))

    def __str__(self) -> str:
        return f"{self.group}[{self.node}, {self.local}]"


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float   # bytes/s
    latency: float     # s
    egress: float = 0.0  # $/GB
    origin: str = ""     # what the spec declares this link by (or the default it falls back on)
    declared: bool = False   # a `link` or `intra` block of the spec, not a default


class Topology:
    """Resolved cluster: GPUs, node groups and links."""

    def __init__(self, cluster: ClusterSpec, devices: Sequence[DeviceSpec]):
        self.cluster = cluster
        self.groups = {n.name: n for n in self.cluster.nodes}
        kinds = {d.name: d for d in devices}
        gpus: list[Gpu] = []
        for group in self.cluster.nodes:
            device = kinds.get(group.device)
            if device is None:
                continue  # reported by validation
            zone = group.zone or group.region
            for node in range(group.count):
                for local in range(group.gpus):
                    gpus.append(Gpu(len(gpus), group.name, node, local, device, group.region, zone))
        self.gpus: tuple[Gpu, ...] = tuple(gpus)
        # Links are built once, each with its origin (`hetc explain` lists where every rate came from).
        self._links = {frozenset((spec.a, spec.b)): Link(spec.bandwidth, spec.latency, spec.egress,
                                                         f"link {spec.a} <-> {spec.b} at {spec.span}", True)
                       for spec in self.cluster.links}
        self._intra = {g.name: Link(g.intra.bandwidth, g.intra.latency, 0.0,
                                    f"the intra link of node group {g.name} at {g.intra.span}", True)
                       for g in self.cluster.nodes if g.intra is not None}
        self._default_intra = Link(DEFAULT_INTRA_BANDWIDTH, DEFAULT_INTRA_LATENCY, 0.0,
                                   "the default intra-node link (PCIe class; the node group declares none)")
        self._default_inter = Link(self.cluster.inter_bandwidth, self.cluster.inter_latency, 0.0,
                                   "the cluster's inter_bandwidth (no link declared between these nodes)")

    @classmethod
    def of(cls, spec: Spec) -> Topology | None:
        """The topology of `spec`'s cluster; None for a spec without one (a catalog, a model)."""
        return None if spec.cluster is None else cls(spec.cluster, spec.devices)

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @cached_property
    def first_gpu_of_group(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for gpu in self.gpus:
            out.setdefault(gpu.group, gpu.id)
        return out

    def gpu_at(self, group: str, node: int, local: int) -> Gpu:
        g = self.groups[group]
        return self.gpus[self.first_gpu_of_group[group] + node * g.gpus + local]

    def link(self, a: Gpu, b: Gpu) -> Link:
        if a.host == b.host:
            return self._intra.get(a.group, self._default_intra)
        for key in ((a.group, b.group), (a.zone, b.zone), (a.region, b.region)):
            link = self._links.get(frozenset(key))
            if link is not None:
                return link
        return self._default_inter

    def endpoints(self) -> set[str]:
        """Names a `link` may join: node groups, zones and regions."""
        nodes = self.cluster.nodes
        return {*self.groups, *(g.region for g in nodes), *(g.zone or g.region for g in nodes)}
