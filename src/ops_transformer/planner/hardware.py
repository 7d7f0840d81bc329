"""A hardware profile for the α–β cost model, and the profile of this kind of machine.

Collective time is the cost model's one formula (:func:`~.cost.collective_time`: Hockney's α–β
model with the per-rank volumes of ring algorithms); a profile only says which α and β a collective
of a given kind and group size gets. Compute time: ``FLOPs / achieved FLOP/s``. Between nodes
(:meth:`HardwareProfile.inter_alpha_beta`) a collective gets the slower of those figures and the
profile's ``inter_node_alpha_s`` / ``inter_node_bandwidth`` (``None``: the same as inside a node,
which is all a measurement on one machine can say).

Between the PCIe islands of one node (GPUs behind different PCIe switches or CPU sockets,
:meth:`HardwareProfile.island_alpha_beta`) a collective gets the slower of those figures and
``inter_island_alpha_s`` / ``inter_island_bandwidth``: the latency and the bandwidth of the path
that joins two islands (host bridge, CPU interconnect), *shared* by the transfers that cross it at
the same time — ``flows`` of them get ``1/flows`` each (:mod:`.collective_algorithms`).

``CPU_GLOO`` are rough figures of the development machine (2 shared cores, gloo over loopback, one
thread per rank) from one early measurement (medians of 1-element and 4M-element all-reduces at 2
ranks, 512² matmuls). They are the fallback when ``ops-transformer calibrate`` has not written a
measured profile (:mod:`.profile`), which every cost-model choice prefers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import comm_time


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    matmul_flops: float  # achieved FLOP/s of one rank on large matmuls
    alpha_s: float  # latency of one collective, seconds
    bandwidth: float  # bytes/s one rank sends in a collective (bus bandwidth)
    inter_node_alpha_s: float | None = None  # latency of a collective across nodes (None: as above)
    inter_node_bandwidth: float | None = None  # bytes/s per rank across nodes (None: as above)
    inter_island_alpha_s: float | None = None  # latency across PCIe islands (None: as inside)
    inter_island_bandwidth: float | None = None  # bytes/s of the link between islands, shared
    # η: the fraction of a collective's time that running it beside compute really hides (1:
    # communication has engines of its own; 0: overlapping gains nothing). planner/overlap.py
    overlap_efficiency: float = 1.0

    def alpha_beta(self, kind: str, group_size: int) -> tuple[float, float]:
        """``(α, β)`` of a collective of ``kind`` over ``group_size`` ranks: the same for all here;
        a measured profile (:class:`~.profile.CalibratedProfile`) has one pair per kind."""
        return self.alpha_s, self.bandwidth

    def inter_alpha_beta(self, kind: str, group_size: int) -> tuple[float, float]:
        """``(α, β)`` of a collective whose ranks sit on different nodes: the slower of
        :meth:`alpha_beta` and the inter-node figures (a ring runs at its slowest link)."""
        alpha, beta = self.alpha_beta(kind, group_size)
        if self.inter_node_alpha_s is not None:
            alpha = max(alpha, self.inter_node_alpha_s)
        if self.inter_node_bandwidth is not None:
            beta = min(beta, self.inter_node_bandwidth)
        return alpha, beta

    def island_alpha_beta(self, kind: str, group_size: int, flows: int = 1
                          ) -> tuple[float, float]:
        """``(α, β)`` of a collective whose ranks sit in different PCIe islands of one node while
        ``flows`` transfers cross between the islands at once (a ring in island order: 1; the
        cross-island stage of a staged collective: one per rank of an island): the slower of
        :meth:`alpha_beta` and the link between islands, whose bandwidth they share."""
        alpha, beta = self.alpha_beta(kind, group_size)
        if self.inter_island_alpha_s is not None:
            alpha = max(alpha, self.inter_island_alpha_s)
        if self.inter_island_bandwidth is not None:
            beta = min(beta, self.inter_island_bandwidth / max(flows, 1))
        return alpha, beta

    def collective_time(self, kind: str, elements: int, group_size: int,
                        bytes_per_element: int = 4) -> float:
        """One call: :func:`~.cost.collective_time` with this profile's α and β."""
        return self.comm_time({kind: {"calls": 1, "elements": elements}}, group_size,
                              bytes_per_element) if elements > 0 else 0.0

    def comm_time(self, comm: dict, group_size: int, bytes_per_element: int = 4) -> float:
        """Time of a :class:`~.cost.Comm` (``{kind: {"calls", "elements"}}``) on one group."""
        return comm_time(comm, group_size, self.alpha_beta, bytes_per_element)

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
