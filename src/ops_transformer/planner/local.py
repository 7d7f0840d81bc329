"""This machine as a "cluster" for the planner (``plan --gpu local``): its CPU ranks over loopback.

Throughput and link figures come from the profile it is given (the command line passes the calibrated
one, ``ops-transformer calibrate``, when it exists), else from the rough
:data:`~ops_transformer.planner.hardware.CPU_GLOO`; memory is this machine's RAM shared by the
ranks; the topology is the one the caller detected
(:func:`~ops_transformer.comm.topology.detect_topology`: the command line runs it), so the planner
itself probes nothing.
"""

from __future__ import annotations

import os

from .catalogue import GPU, Link
from .hardware import CPU_GLOO
from .specs import ClusterSpec


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def local_profile(profile=None):
    """``profile`` (the command line passes the calibrated one when it exists), else the rough
    built-in :data:`CPU_GLOO`."""
    return profile if profile is not None else CPU_GLOO


def local_cluster(ranks: int, profile=None, *, topology) -> ClusterSpec:
    """``ranks`` local processes: the link of ``topology`` (a detected
    :class:`~ops_transformer.comm.topology.Topology`; loopback on a CPU machine) with the
    profile's α and β, the profile's matmul rate, and the RAM shared by the ranks."""
    if ranks < 1:
        raise ValueError(f"--gpus must be at least 1, got {ranks}")
    profile = local_profile(profile)
    flops = profile.matmul_flops
    device = GPU(f"local-{topology.kind} ({topology.source})", bf16_flops=flops, fp16_flops=flops, fp32_flops=flops,
                 memory_bytes=_ram_bytes() // ranks, memory_bandwidth=10e9, intra_link="loopback",
                 gpus_per_node=ranks, vendor="cpu")
    # a ring all-reduce over 2 ranks has 2 steps: the measured α is split over them
    link = Link(topology.intra_link_name(), bandwidth=profile.bandwidth,
                latency_s=profile.alpha_s / 2)
    return ClusterSpec(gpu=device, count=ranks, gpus_per_node=ranks, intra_link=link,
                       inter_link=None)
