"""A hardware profile for the α–β cost model, and the profile of this kind of machine.

Collective time (Hockney's α–β model, with the per-rank volumes of ring algorithms, Patarasuk & Yuan
2009): ``t = α + wire_elements(kind, n, p) · bytes / β`` where ``wire_elements`` is ``2(p−1)/p·n``
for an all-reduce and ``(p−1)/p·n`` for an all-gather, a reduce-scatter or an all-to-all. Compute
time: ``FLOPs / achieved FLOP/s``.

``CPU_GLOO`` are rough figures of this development machine (2 shared cores, gloo over loopback, one
thread per rank), measured with ``python -m ops_transformer.planner.hardware`` (medians; the
measurement is :func:`measure_profile`). They stand until ``ops-transformer calibrate`` writes a
measured profile (the planner issue).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..comm.ledger import wire_elements


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    matmul_flops: float  # achieved FLOP/s of one rank on large matmuls
    alpha_s: float  # latency of one collective, seconds
    bandwidth: float  # bytes/s one rank sends in a collective (bus bandwidth)

    def collective_time(self, kind: str, elements: int, group_size: int,
                        bytes_per_element: int = 4) -> float:
        if group_size <= 1 or elements <= 0:
            return 0.0
        return self.alpha_s + wire_elements(kind, elements, group_size) * bytes_per_element / \
            self.bandwidth

    def comm_time(self, comm: dict, group_size: int, bytes_per_element: int = 4) -> float:
        """Time of ``{kind: {"calls", "elements"}}``: ``α`` per call plus the volume term."""
        return sum(c["calls"] * self.alpha_s
                   + wire_elements(kind, c["elements"], group_size) * bytes_per_element
                   / self.bandwidth
                   for kind, c in comm.items() if group_size > 1)

    def compute_time(self, flops: float) -> float:
        return flops / self.matmul_flops


# Measured 2026-11-29 on the 2-core development VM (one run of this module, machine under load):
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


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def measure_matmul_flops(n: int = 512, repeats: int = 7) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / _median(times)


def _allreduce_time(elements: int, group, repeats: int) -> float:
    from ..comm import collectives as C

    x = torch.ones(elements)
    C.all_reduce(x, group)
    times = []
    for _ in range(repeats):
        C.barrier(group)
        start = time.perf_counter()
        C.all_reduce(x, group)
        times.append(time.perf_counter() - start)
    return _median(times)


def measure_profile(repeats: int = 15) -> HardwareProfile:
    """Run on every rank of a job (``launch(measure_profile, 2)``): α from 1-element all-reduces,
    β from 4M-element ones, FLOP/s from 512² matmuls."""
    from ..parallel.context import init_parallel

    ctx = init_parallel(tp=1, dp=None)
    group, p = ctx.dp_group, ctx.dp_size
    alpha = _allreduce_time(1, group, repeats)
    n = 1 << 22
    big = _allreduce_time(n, group, max(3, repeats // 3))
    bandwidth = wire_elements("all_reduce", n, p) * 4 / max(big - alpha, 1e-9)
    return HardwareProfile("measured", measure_matmul_flops(), alpha, bandwidth)


if __name__ == "__main__":
    from ..parallel.launch import launch

    print(launch(measure_profile, 2)[0])
