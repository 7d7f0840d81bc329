"""What the planner plans on: a cluster (:class:`ClusterSpec`) of catalogue GPUs and links."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .catalogue import GPU, Link, gpu as catalogue_gpu, link as catalogue_link


@dataclass(frozen=True)
class ClusterSpec:
    """``count`` GPUs in nodes of ``gpus_per_node``, joined by ``intra_link`` inside a node and by
    ``inter_link`` between nodes (``None``: a single node). ``inter_link`` is one NIC (port);
    a node has ``nics_per_node`` of them (default: one per GPU, as in DGX/HGX nodes), which
    :mod:`.network` shares among the groups that cross nodes."""

    gpu: GPU
    count: int
    gpus_per_node: int
    intra_link: Link
    inter_link: Link | None
    nics_per_node: int | None = None

    def __post_init__(self):
        if not isinstance(self.gpu, GPU):
            raise ValueError(f"gpu must be a catalogue GPU, got {self.gpu!r} "
                             f"(ClusterSpec.make takes names)")
        for f in ("intra_link", "inter_link"):
            value = getattr(self, f)
            if value is not None and not isinstance(value, Link):
                raise ValueError(f"{f} must be a catalogue Link, got {value!r}")
        if self.nics_per_node is None:
            object.__setattr__(self, "nics_per_node", self.gpus_per_node)
        for f in ("count", "gpus_per_node", "nics_per_node"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f} must be a positive integer, got {value!r}")
        if self.count > self.gpus_per_node:
            if self.count % self.gpus_per_node:
                raise ValueError(f"count ({self.count}) must be a multiple of gpus_per_node "
                                 f"({self.gpus_per_node}) when it spans several nodes")
            if self.inter_link is None:
                raise ValueError(f"count ({self.count}) spans {self.nodes} nodes of "
                                 f"{self.gpus_per_node}: give an inter_link")

    @property
    def nodes(self) -> int:
        return max(1, self.count // self.gpus_per_node)

    @property
    def gpus_in_node(self) -> int:
        """GPUs actually used per node (fewer than ``gpus_per_node`` in a partial single node)."""
        return min(self.count, self.gpus_per_node)

    def __str__(self) -> str:
        inter = f", {self.inter_link.name} between" if self.nodes > 1 else ""
        return (f"{self.count}× {self.gpu.name} ({self.nodes} node(s) × {self.gpus_in_node}, "
                f"{self.intra_link.name} inside{inter})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ClusterSpec:
        inter = d.get("inter_link")
        return cls(gpu=GPU(**d["gpu"]), count=d["count"], gpus_per_node=d["gpus_per_node"],
                   intra_link=Link(**d["intra_link"]),
                   inter_link=Link(**inter) if inter is not None else None,
                   nics_per_node=d.get("nics_per_node"))

    @classmethod
    def make(cls, gpu: str, count: int, gpus_per_node: int | None = None, intra: str | None = None,
             inter: str | None = "ib-ndr", nics_per_node: int | None = None) -> ClusterSpec:
        """From catalogue names; ``gpus_per_node`` and ``intra`` default to the GPU's node,
        ``nics_per_node`` to one NIC per GPU."""
        g = catalogue_gpu(gpu)
        per_node = g.gpus_per_node if gpus_per_node is None else gpus_per_node
        return cls(gpu=g, count=count, gpus_per_node=per_node,
                   intra_link=catalogue_link(intra or g.intra_link),
                   inter_link=catalogue_link(inter) if inter else None,
                   nics_per_node=nics_per_node)
