"""Which algorithm the communication engine runs a collective with, priced by the cost model
(SPEC F11).

A group of ``p = k·m`` ranks, ``k`` on each of ``m`` nodes, a message of ``n`` elements (the
ledger's count). Both forms are priced by the one collective-time formula
(:func:`~.cost.collective_time`): ``flat`` as one ring over all ``p`` ranks — at the inter-node
figures when it crosses nodes (:meth:`~.hardware.HardwareProfile.inter_alpha_beta`, the slower of
the profile's intra- and inter-node α and β) — and ``hierarchical`` as
:func:`~.cost.hierarchical_time`'s stages (intra-node reduce-scatter → inter-node all-reduce of the
``n/k`` shard → intra-node all-gather; all-gather and reduce-scatter likewise).

Across nodes the flat ring pays the inter-node link for all ``(p−1)/p`` of its volume; the
hierarchical form sends only ``1/k`` of it between nodes, for two more latencies. With equal links
(a profile measured on one machine) flat always wins; the slower the inter-node link, the smaller the
message from which hierarchical wins (the reasoning of Horovod's hierarchical all-reduce, Sergeev &
Del Balso 2018, and of NCCL's tree/ring choice).

**Staged over PCIe islands.** Inside one node, GPUs behind different PCIe switches or CPU sockets
form *islands* (``k`` ranks of the group in each of ``m`` islands); the path between two islands
(host bridge, CPU interconnect) is slower and shared. ``flat`` is one ring in island order: it
crosses each boundary once per direction (one flow on the shared link,
:meth:`~.hardware.HardwareProfile.island_alpha_beta`) with the ring's whole volume; ``staged`` runs
:func:`~.cost.hierarchical_time`'s stages over islands — inside each island at the profile's own
figures, then between islands with its ``k`` sub-groups crossing at once (``k`` flows share the
link) but only ``1/k`` of the data each. On bandwidth alone a staged all-reduce of ``n`` elements
costs ``2(k−1)/k·n/B_in + 2(m−1)/m·n/B_x`` against flat's ``2(p−1)/p·n/B_x``: it wins exactly
when the island links are more than ``m`` times faster than the link between islands
(``B_in/B_x > p/k = m``), by more than its two extra latencies. Equal links: flat, always.

Point-to-point: in a group of two, both ranks swap what the other needs with one send/recv pair
(all-reduce: the whole tensor, all-gather: the shard, reduce-scatter: the other's half) and combine
locally. ``calibrate`` measures where a swap beats an all-gather of the same bytes
(``p2p_threshold_bytes``, ``p2p_small_messages``); :func:`p2p_faster` reads that measurement. A
profile without it (the built-in ones) never chooses point-to-point.

What ran is priced by the same formula: :func:`executed_time` takes the ledger's steps
(:meth:`~ops_transformer.comm.ledger.CommLedger.executed`: kind, elements, sub-group, level) and
charges each at its level — so the time the engine predicted for its choice and the time of what
the ledger says ran are one number (tested).
"""

from __future__ import annotations

from .cost import collective_time, comm_time, hierarchical_time
from .hardware import HardwareProfile

ALGORITHMS = ("flat", "hierarchical", "staged", "p2p")
HIERARCHICAL_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _crossing(profile: HardwareProfile, flows: int):
    """``(kind, p) -> (α, β)`` between PCIe islands with ``flows`` transfers sharing the link."""
    return lambda kind, group_size: profile.island_alpha_beta(kind, group_size, flows)


def flat_time(profile: HardwareProfile, kind: str, elements: int, per_node: int, nodes: int,
              bytes_per_element: int = 4, islands: int = 1) -> float:
    """One ring over all ``per_node × nodes`` ranks, at the inter-node figures when ``nodes > 1``;
    in one node over ``islands > 1`` PCIe islands, at the figures of the link between islands with
    one flow (the ring visits the islands in order)."""
    alpha_beta = (profile.inter_alpha_beta if nodes > 1 else
                  _crossing(profile, 1) if islands > 1 else profile.alpha_beta)
    return comm_time({kind: {"calls": 1, "elements": elements}}, per_node * nodes, alpha_beta,
                     bytes_per_element)


def staged_time(profile: HardwareProfile, kind: str, elements: int, per_node: int, nodes: int,
                bytes_per_element: int = 4) -> float:
    """The hierarchical form: :func:`~.cost.hierarchical_time` with the profile's intra- and
    inter-node α and β."""
    return hierarchical_time(kind, elements, nodes=nodes, per_node=per_node,
                             intra=profile.alpha_beta, inter=profile.inter_alpha_beta,
                             bytes_per_element=bytes_per_element)


def island_staged_time(profile: HardwareProfile, kind: str, elements: int, per_island: int,
                       islands: int, bytes_per_element: int = 4) -> float:
    """The staged form over ``islands`` PCIe islands of ``per_island`` ranks each:
    :func:`~.cost.hierarchical_time`'s stages, inside each island at the profile's figures, between
    islands with ``per_island`` flows sharing the link (one sub-group per rank of an island)."""
    return hierarchical_time(kind, elements, nodes=islands, per_node=per_island,
                             intra=profile.alpha_beta, inter=_crossing(profile, per_island),
                             bytes_per_element=bytes_per_element)


def exchanged_bytes(kind: str, elements: int, bytes_per_element: int = 4) -> int:
    """Bytes each rank of a group of two sends in the point-to-point form of ``kind``."""
    return (elements if kind == "all_reduce" else elements // 2) * bytes_per_element


def p2p_faster(profile: HardwareProfile, nbytes: int) -> bool:
    """Whether the profile measured a send/recv swap of ``nbytes`` faster than an all-gather.

    Below ``p2p_threshold_bytes`` the method named ``p2p_small_messages`` is faster, from there on
    the other; no threshold means that method won at every measured size. A profile that never
    measured it (no ``p2p_threshold_bytes`` attribute, or ``p2p_small_messages`` missing) says no.
    """
    threshold = getattr(profile, "p2p_threshold_bytes", None)
    small = getattr(profile, "p2p_small_messages", None)
    if small not in ("send_recv", "all_gather"):
        return False
    below = threshold is None or nbytes < threshold
    return (small == "send_recv") == below


def algorithm_times(profile: HardwareProfile, kind: str, elements: int, per_node: int, nodes: int,
                    bytes_per_element: int = 4, islands: int = 1) -> dict[str, float]:
    """Predicted seconds of each algorithm that can run ``kind`` on this group: ``flat`` always,
    ``hierarchical`` when the group spans nodes with several ranks on each, ``staged`` when it lies
    in one node and spans ``islands > 1`` PCIe islands with several of its ranks on each
    (``per_node // islands``; islands are ignored for a group that spans nodes)."""
    islands = islands if nodes == 1 else 1
    times = {"flat": flat_time(profile, kind, elements, per_node, nodes, bytes_per_element,
                               islands)}
    if kind in HIERARCHICAL_KINDS and nodes > 1 and per_node > 1:
        times["hierarchical"] = staged_time(profile, kind, elements, per_node, nodes,
                                            bytes_per_element)
    if (kind in HIERARCHICAL_KINDS and islands > 1 and per_node % islands == 0
            and per_node // islands > 1):
        times["staged"] = island_staged_time(profile, kind, elements, per_node // islands,
                                             islands, bytes_per_element)
    return times


def choose_algorithm(profile: HardwareProfile, kind: str, elements: int, per_node: int,
                     nodes: int, bytes_per_element: int = 4, islands: int = 1
                     ) -> tuple[str, dict[str, float]]:
    """``(algorithm, predicted seconds per priced algorithm)`` for one collective.

    A group of two whose measured swap beats an all-gather at this size exchanges point to point;
    otherwise the fastest of flat, hierarchical and staged (ties: flat).
    """
    times = algorithm_times(profile, kind, elements, per_node, nodes, bytes_per_element, islands)
    if (per_node * nodes == 2 and kind in HIERARCHICAL_KINDS
            and p2p_faster(profile, exchanged_bytes(kind, elements, bytes_per_element))):
        return "p2p", times
    return min(times, key=lambda a: (times[a], a != "flat")), times


def executed_time(profile: HardwareProfile, steps) -> float:
    """Predicted seconds of collectives as they ran: each of the ledger's steps (``CommStep`` or
    a flat ``CommRecord``'s :meth:`executed`) priced by :func:`~.cost.collective_time` on its own
    group, at the profile's inter-node figures when its level is ``"inter"``, at the figures of the
    link between PCIe islands, shared by the step's ``flows``, when it is ``"inter_island"``. The
    receive of a point-to-point swap runs while its send does: it adds no time of its own."""
    total = 0.0
    for step in steps:
        if step.kind == "recv":
            continue
        group_size = len(step.group_ranks)
        alpha_beta = (profile.inter_alpha_beta if step.level == "inter" else
                      _crossing(profile, step.flows) if step.level == "inter_island" else
                      profile.alpha_beta)
        alpha, beta = alpha_beta(step.kind, group_size)
        total += collective_time(step.kind, step.elements, group_size, alpha_s=alpha,
                                 bandwidth=beta,
                                 bytes_per_element=step.bytes // max(step.elements, 1))
    return total
