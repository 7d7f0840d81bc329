"""Moved to :mod:`ops_transformer.comm.topology`: the detected topology is the communication engine's
input. This module keeps the old import path working for existing callers."""

from ..comm.topology import (Topology, cpu_topology, detect_topology,  # noqa: F401
                             parse_nvidia_smi_topo)

__all__ = ["Topology", "cpu_topology", "detect_topology", "parse_nvidia_smi_topo"]
