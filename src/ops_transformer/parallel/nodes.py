"""The set-up every rank agrees on: ranks per node and per PCIe island, the hardware profile, the
engine's sub-groups.

:func:`~ops_transformer.parallel.init_parallel` calls :func:`agree_setup` once: rank 0 resolves
``ranks_per_node`` (declared, else ``torchrun``'s ``LOCAL_WORLD_SIZE``), ``ranks_per_island``
(declared, else — on a GPU node — detected from the topology, :func:`detect_islands`) and the
hardware profile (an object, or a path that rank 0 alone reads), and broadcasts them — a profile
file present on some nodes only, or different on each, cannot make ranks decide differently. A problem on rank 0 (a
corrupt profile, a ``ranks_per_node`` that does not divide the world) is raised on every rank, so
none waits for the others. Every automatic choice below (attention strategy, vocabulary split,
collective algorithm) is then derived from these agreed values.

:func:`build_engine` then gives each group of the context's mesh, and the world group, its
:class:`~ops_transformer.comm.engine.GroupAlgorithms`, creating the intra- and inter-node sub-groups
of the groups that span nodes — only where the profile says a hierarchical collective can win — and
the island and cross-island sub-groups of the groups that span the PCIe islands of one node (only
where a staged collective can win). Every rank creates every sub-group, in the same order
(``new_group`` is collective).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ..comm import collectives as C
from ..comm.engine import (GroupAlgorithms, NodeLayout, hierarchy_can_win, register,
                           staging_can_win)
from ..comm.topology import detect_topology, ranks_per_island as topology_ranks_per_island
from ..planner.calibrated import load_profile
from ..planner.hardware import A100_NVLINK, CPU_GLOO, HardwareProfile

log = logging.getLogger("ops_transformer")


def default_profile(backend: str | None) -> HardwareProfile:
    """The built-in profile when none is given: the GPU reference for ``nccl``, else the CPU one."""
    return A100_NVLINK if backend == "nccl" else CPU_GLOO


def resolve_profile_source(profile, backend: str | None) -> HardwareProfile:
    """A :class:`HardwareProfile` from ``profile``: itself, the file it names (read here), or the
    built-in default for ``None``."""
    if profile is None:
        return default_profile(backend)
    if isinstance(profile, HardwareProfile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return load_profile(Path(profile).expanduser())
    raise ValueError(f"profile must be a HardwareProfile, a path to a calibrated profile or None, "
                     f"got {type(profile).__name__}")


def detect_islands(ranks_per_node: int, backend: str | None, topology=None) -> int | None:
    """``ranks_per_island`` read from this node's topology (``topology``, default: detected with
    NVML or ``nvidia-smi``): GPUs behind different PCIe switches or sockets
    (:func:`~ops_transformer.comm.topology.ranks_per_island`). ``None`` off ``nccl``, with one
    island, or when the node's devices are not one per local rank."""
    if backend != "nccl" and topology is None:
        return None
    topology = topology or detect_topology()
    if topology.kind != "gpu" or topology.devices != ranks_per_node:
        return None
    found = topology_ranks_per_island(topology)
    if found is not None:
        log.info("init_parallel: %d PCIe islands of %d GPUs each detected (%s)",
                 ranks_per_node // found, found, topology.source)
    return found


def agree_setup(rank: int, world_size: int, ranks_per_node: int | None, profile,
                backend: str | None, *, declared: bool = True,
                ranks_per_island: int | None = None
                ) -> tuple[NodeLayout, HardwareProfile]:
    """Rank 0's node layout and profile, on every rank (one broadcast over the world).

    ``ranks_per_node``: this rank's value, or ``None`` for all ranks on one node; when not
    ``declared`` (read from ``torchrun``) and not a divisor of the world size (nodes of different
    sizes), a warning and one node. ``ranks_per_island``: declared, or ``None`` to detect it from
    the topology on a GPU node (:func:`detect_islands`; one island per node otherwise). Only rank
    0's arguments count; its errors are raised everywhere (with ``on rank 0`` appended)."""
    message = None
    if rank == 0:
        if not declared and ranks_per_node is not None and world_size % ranks_per_node:
            log.warning("init_parallel: LOCAL_WORLD_SIZE (%d) does not divide the world size "
                        "(%d): nodes of different sizes are not modelled, every collective runs "
                        "flat", ranks_per_node, world_size)
            ranks_per_node = None
        try:
            per_node = world_size if ranks_per_node is None else ranks_per_node
            if ranks_per_island is None and isinstance(per_node, int) and per_node > 0:
                ranks_per_island = detect_islands(per_node, backend)
            layout = NodeLayout(world_size, per_node, ranks_per_island)
            message = ("ok", layout, resolve_profile_source(profile, backend))
        except ValueError as exc:
            message = ("error", str(exc))
    if world_size > 1:
        message = C.broadcast_object(message, 0, dist.group.WORLD)
    if message[0] == "error":
        raise ValueError(message[1] + ("" if rank == 0 else " (on rank 0)"))
    _, layout, agreed = message
    return layout, agreed


def axis_groups(mesh, axes) -> list[list[int]]:
    """Every group of global ranks along ``axes`` of the mesh (one name, or several flattened
    together), in a fixed order."""
    names = tuple(mesh.mesh_dim_names)
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    dims = [names.index(a) for a in axes]
    ranks = mesh.mesh.movedim(dims, list(range(-len(dims), 0)))
    size = 1
    for d in dims:
        size *= mesh.mesh.shape[d]
    return [sorted(g) for g in ranks.reshape(-1, size).tolist()]


def tp_groups_within_nodes(mesh, layout: NodeLayout) -> bool:
    """Whether every tensor-parallel group of the mesh lies inside one node."""
    return all(layout.level(g) == "intra" for g in axis_groups(mesh, "tp"))


def build_engine(mesh, layout: NodeLayout, profile: HardwareProfile, rank: int,
                 timeout: timedelta, dp_ep_group=None) -> dict[str, GroupAlgorithms]:
    """Register a :class:`GroupAlgorithms` for this rank's group on each axis of ``mesh`` (of more
    than one rank), for the flattened ``dp × ep`` group when given, and for the world group;
    returns them by name (axis, ``"dp_ep"``, ``"world"``)."""
    families = [(axis, axis_groups(mesh, axis), mesh.get_group(axis))
                for axis in mesh.mesh_dim_names if mesh[axis].size() > 1]
    if dp_ep_group is not None:
        families.append(("dp_ep", axis_groups(mesh, ("dp", "ep")), dp_ep_group))
    if layout.world_size > 1:
        families.append(("world", [list(range(layout.world_size))], dist.group.WORLD))
    mine: dict[str, GroupAlgorithms] = {}
    for name, all_groups, group in families:
        subgroups = {}
        for ranks in all_groups:  # every rank creates every sub-group, in this order
            subgroups.update(_subgroups(ranks, layout, profile, timeout))
        mine[name] = _describe(group, rank, layout, profile, subgroups)
        register(group, mine[name])
    if layout.islands_per_node > 1:
        log.info("init_parallel: %d PCIe islands of %d ranks per node; groups that span them may "
                 "run staged", layout.islands_per_node, layout.ranks_per_island)
    if not tp_groups_within_nodes(mesh, layout):
        log.info("init_parallel: tensor-parallel groups span nodes (tp=%d, %d ranks per node); "
                 "their collectives may run hierarchically", mesh["tp"].size(),
                 layout.ranks_per_node)
    return mine


def _describe(group, rank: int, layout: NodeLayout, profile: HardwareProfile,
              subgroups: dict) -> GroupAlgorithms:
    """This rank's view of ``group``: its shape over the nodes and islands and its sub-groups."""
    ranks = tuple(dist.get_process_group_ranks(group))
    split = layout.split(ranks)
    even = split is not None
    intra, inter = _mine(split, rank)
    islands = layout.split_islands(ranks)
    island, cross = _mine(islands, rank)
    return GroupAlgorithms(
        group=group, rank=rank, ranks=ranks,
        per_node=len(split[0]) if even else len(ranks),
        nodes=len(split) if even else len({layout.node_of(r) for r in ranks}),
        level=layout.level(ranks), profile=profile,
        intra=subgroups.get(tuple(intra)), inter=subgroups.get(tuple(inter)),
        intra_ranks=tuple(intra), inter_ranks=tuple(inter),
        islands=(len({layout.island_of(r) for r in ranks}) if layout.level(ranks) != "inter"
                 else 1),
        island=subgroups.get(("island",) + tuple(island)),
        cross=subgroups.get(("cross",) + tuple(cross)),
        island_ranks=tuple(island), cross_ranks=tuple(cross))


def _mine(parts: list[list[int]] | None, rank: int) -> tuple[list[int], list[int]]:
    """This rank's part and the ranks at its position in every part (empty without parts)."""
    if not parts:
        return [], []
    part = next((p for p in parts if rank in p), [])
    return part, ([p[part.index(rank)] for p in parts] if part else [])


def _subgroups(ranks: list[int], layout: NodeLayout, profile: HardwareProfile,
               timeout: timedelta) -> dict[tuple, object]:
    """The sub-groups of one group: intra- and inter-node ones if a hierarchical collective can
    ever win on it, island and cross-island ones (keys prefixed ``"island"``, ``"cross"``) if a
    staged one can; ``{ranks: group}`` (this rank's groups; non-members get no entry)."""
    out = {}
    islands = layout.split_islands(ranks)
    if (islands is not None and len(islands) > 1
            and staging_can_win(profile, len(islands[0]), len(islands))):
        for prefix, sub in ([("island", i) for i in islands]
                            + [("cross", list(c)) for c in zip(*islands)]):
            group = dist.new_group(sub, timeout=timeout)
            if dist.get_rank() in sub:
                out[(prefix,) + tuple(sub)] = group
    split = layout.split(ranks)
    if split is None or not hierarchy_can_win(profile, len(split[0]), len(split)):
        return out
    for sub in split + [list(column) for column in zip(*split)]:
        group = dist.new_group(sub, timeout=timeout)
        if dist.get_rank() in sub:
            out[tuple(sub)] = group
    return out
