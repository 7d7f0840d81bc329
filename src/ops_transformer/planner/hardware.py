"""A hardware profile for the α–β cost model, and the profile of this kind of machine.

Collective time (Hockney's α–β model, with the per-rank volumes of ring algorithms, Patarasuk & Yuan
2009): ``t = α + wire_elements(kind, n, p) · bytes / β`` where ``wire_elements`` is ``2(p−1)/p·n``
for an all-reduce and ``(p−1)/p·n`` for an all-gather, a reduce-scatter or an all-to-all. Compute
time: ``FLOPs / achieved FLOP/s``. A step whose ranks sit on different nodes (``level="inter"``)
pays the slower of the intra-node figures and the profile's inter-node ones
(``inter_node_alpha_s``, ``inter_node_bandwidth``; ``None``: the same as inside a node, which is all a
one-machine measurement can say).

``CPU_GLOO`` are rough figures of the development machine (2 shared cores, gloo over loopback, one
thread per rank) from one early measurement (medians of 1-element and 4M-element all-reduces at 2
ranks, 512² matmuls). They are the fallback when ``ops-transformer calibrate`` has not written a
measured profile (:mod:`.profile`), which every cost-model choice prefers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.ledger import wire_elements


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    matmul_flops: float  # achieved FLOP/s of one rank on large matmuls
    alpha_s: float  # latency of one collective, seconds
    bandwidth: float  # bytes/s one rank sends in a collective (bus bandwidth)
    inter_node_alpha_s: float | None = None  # latency of a collective across nodes (None: as above)
    inter_node_bandwidth: float | None = None  # bytes/s per rank across nodes (None: as above)

    def alpha_beta(self, kind: str, group_size: int, level: str = "intra") -> tuple[float, float]:
        """``(α, β)`` of a collective of ``kind`` over ``group_size`` ranks: the same for all here;
        a measured profile (:class:`~.profile.CalibratedProfile`) has one pair per kind. Across
        nodes (``level="inter"``) see :meth:`across_nodes`."""
        return self.across_nodes(self.alpha_s, self.bandwidth, level)

    def across_nodes(self, alpha: float, beta: float, level: str) -> tuple[float, float]:
        """``(α, β)`` of a link inside a node, made the slower of it and the inter-node figures
        when ``level == "inter"`` (a ring across nodes runs at its slowest link)."""
        if level != "inter":
            return alpha, beta
        if self.inter_node_alpha_s is not None:
            alpha = max(alpha, self.inter_node_alpha_s)
        if self.inter_node_bandwidth is not None:
            beta = min(beta, self.inter_node_bandwidth)
        return alpha, beta

    def collective_time(self, kind: str, elements: int, group_size: int,
                        bytes_per_element: int = 4, level: str = "intra") -> float:
        """``α + wire_elements(kind, n, p) · bytes / β`` for one call."""
        return self.comm_time({kind: {"calls": 1, "elements": elements}}, group_size,
                              bytes_per_element, level) if elements > 0 else 0.0

    def comm_time(self, comm: dict, group_size: int, bytes_per_element: int = 4,
                  level: str = "intra") -> float:
        """Time of ``{kind: {"calls", "elements"}}``: ``α`` per call plus the volume term."""
        if group_size <= 1:
            return 0.0
        total = 0.0
        for kind, c in comm.items():
            alpha, beta = self.alpha_beta(kind, group_size, level)
            total += c["calls"] * alpha + wire_elements(kind, c["elements"], group_size) * \
                bytes_per_element / beta
        return total

    def compute_time(self, flops: float) -> float:
        return flops / self.matmul_flops


# Measured 2026-11-29 on the 2-core development VM (one run, machine under load):
# matmul 4.5e10 FLOP/s, α 2.2e-4 s, β 0.94 GB/s.
CPU_GLOO = HardwareProfile("cpu-gloo (2-core dev VM, rough)", matmul_flops=4.5e10, alpha_s=2.2e-4,
                           bandwidth=0.94e9)


# An A100-SXM4 in an NVLink-3 node, for the seed's claims until the planner's catalogue exists.
# Peak dense bf16 312 TFLOP/s (NVIDIA A100 Tensor Core GPU datasheet, 2020); NVLink 3 gives each
# GPU 600 GB/s total, 300 GB/s per direction (same datasheet). Assumed here, not measured: 70% of
# peak on large GEMMs and 80% of the per-direction link bandwidth in ring collectives, and ~10 µs
# latency per NCCL collective inside a node.
A100_NVLINK = HardwareProfile("A100-SXM4 + NVLink3 (datasheet, assumed efficiencies)",
                              matmul_flops=0.7 * 312e12, alpha_s=10e-6, bandwidth=0.8 * 300e9)
