"""Where a group's members sit, and the α and β its collectives get (SPEC F10, F11).

Ranks are laid out as in :class:`~ops_transformer.parallel.context.ParallelContext`: ``tp`` is the
fastest-varying axis, then ``ep``, then ``dp``, filling nodes of ``gpus_per_node`` in order. A
group is described by its size and its **members per node**.

Bandwidth of a group that crosses nodes. NCCL runs one ring (channel) per NIC it can use, and every
ring carries its share of the data across each node boundary, so a ring collective over nodes moves
at the NICs' combined rate. The NICs of a node are shared by the groups of the same kind that run
at the same time (e.g. the ``tp`` data-parallel groups of a node all reduce their gradients at
once): a group with ``m`` members in a node of ``g`` GPUs and ``n`` NICs gets ``n·m/g`` of them::

    β = min(β_intra, β_nic · n · m / g)

With one NIC per GPU this is one NIC when a node holds one member (TP 8 × DP across nodes) and
eight when it holds eight (TP 1) — the case where charging one NIC was ~8× too slow. α: the
catalogue's per-step latency of the slower link, times :func:`~.cost.ring_steps`.

A collective over nodes may also run hierarchically (:func:`~.cost.hierarchical_time`);
:func:`group_time` prices both with the one formula and takes the cheaper, as the communication
engine chooses.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import collective_time, hierarchical_time, link_alpha


@dataclass(frozen=True)
class Placement:
    """A group of ``size`` ranks with ``per_node`` of them in each of ``nodes`` nodes."""

    size: int
    per_node: int
    nodes: int


def placement(cluster, size: int, stride: int) -> Placement:
    """The group of ``size`` ranks ``stride`` apart (``stride = tp·ep`` for a data-parallel group,
    1 for a tensor-parallel one)."""
    per_node_slots = max(1, cluster.gpus_per_node // stride) if stride < cluster.gpus_per_node \
        else 1
    per_node = min(size, per_node_slots)
    return Placement(size, per_node, -(-size // per_node))


def intra_alpha_beta(cluster):
    """``(kind, p) -> (α, β)`` inside one node."""
    link = cluster.intra_link
    return lambda kind, p: (link_alpha(kind, p, link.latency_s), link.bandwidth)


def inter_alpha_beta(cluster, per_node: int):
    """``(kind, p) -> (α, β)`` of a ring that crosses nodes with ``per_node`` members in each."""
    intra, nic = cluster.intra_link, cluster.inter_link
    share = cluster.nics_per_node * per_node / cluster.gpus_in_node
    beta = min(intra.bandwidth, nic.bandwidth * share)
    latency = max(intra.latency_s, nic.latency_s)
    return lambda kind, p: (link_alpha(kind, p, latency), beta)


def group_alpha_beta(cluster, where: Placement):
    """α, β of a flat ring over the group."""
    if where.nodes <= 1 or cluster.inter_link is None:
        return intra_alpha_beta(cluster)
    return inter_alpha_beta(cluster, where.per_node)


def p2p_alpha_beta(cluster, where: Placement):
    """α, β of the point-to-point transfers between neighbours of the group (the CP ring's
    exchanges, the pipeline's sends). Inside a node: the node's link. Across nodes only the
    transfers at a node boundary leave it, each through one NIC (its GPU's rail; NCCL runs a
    send/recv on the NIC nearest the GPU, not on a ring per NIC as a collective does), and every
    step of the exchange waits for them: ``β = min(β_intra, β_nic · min(1, n·m/g))`` — the
    collectives' share of the node's NICs (:func:`inter_alpha_beta`) capped at one NIC."""
    if where.nodes <= 1 or cluster.inter_link is None:
        return intra_alpha_beta(cluster)
    intra, nic = cluster.intra_link, cluster.inter_link
    share = min(1.0, cluster.nics_per_node * where.per_node / cluster.gpus_in_node)
    beta = min(intra.bandwidth, nic.bandwidth * share)
    latency = max(intra.latency_s, nic.latency_s)
    return lambda kind, p: (link_alpha(kind, p, latency), beta)


def group_time(cluster, comm: dict, where: Placement, bytes_per_element: int) -> float:
    """Seconds for the collectives ``comm`` (a :class:`~.cost.Comm`) on the group: each kind flat
    or hierarchical (intra-node stages on the node's link, the inter-node stage with one member
    per node), whichever the formula prices lower."""
    if where.size <= 1:
        return 0.0
    flat = group_alpha_beta(cluster, where)
    total = 0.0
    for kind, c in comm.items():
        alpha, beta = flat(kind, where.size)
        t = collective_time(kind, c["elements"], where.size, alpha_s=alpha, bandwidth=beta,
                            bytes_per_element=bytes_per_element, calls=c["calls"])
        if where.nodes > 1 and where.per_node > 1 and cluster.inter_link is not None:
            per_call = c["elements"] / c["calls"]
            staged = hierarchical_time(kind, per_call, nodes=where.nodes, per_node=where.per_node,
                                       intra=intra_alpha_beta(cluster),
                                       inter=inter_alpha_beta(cluster, 1),
                                       bytes_per_element=bytes_per_element)
            t = min(t, c["calls"] * staged)
        total += t
    return total
