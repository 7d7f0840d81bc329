"""What one collective costs with each algorithm the communication engine can run (SPEC F11).

A group of ``p = k·m`` ranks, ``k`` on each of ``m`` nodes. Every step is priced by the profile's
one collective-time formula, :meth:`~.hardware.HardwareProfile.collective_time`
(``α + wire_elements · bytes / β``), at its level: ``"intra"`` inside a node, ``"inter"`` across
nodes (the slower of the two links, see :meth:`~.hardware.HardwareProfile.across_nodes`).
``n`` is the ledger's element count (the full logical tensor).

============== ============================ ==================================================
kind           flat (one ring)              hierarchical (three / two steps)
============== ============================ ==================================================
all_reduce     AR(p, n) at the node level   RS(k, n) intra → AR(m, n/k) inter → AG(k, n) intra
all_gather     AG(p, n)                     AG(m, n/k) inter → AG(k, n) intra
reduce_scatter RS(p, n)                     RS(k, n) intra → RS(m, n/k) inter
============== ============================ ==================================================

Across nodes the flat ring pays the inter-node link for all ``(p−1)/p`` of its volume; the
hierarchical form sends only ``1/k`` of it between nodes, for two more latencies. With equal links
(a profile measured on one machine) flat always wins; the slower the inter-node link, the smaller the
message from which hierarchical wins (as in NCCL's tree/ring choice, or Horovod's hierarchical
all-reduce, Sergeev & Del Balso 2018).

Point-to-point: in a group of two, both ranks swap what the other needs with one send/recv pair
(all-reduce: the whole tensor, all-gather: the shard, reduce-scatter: the other's half) and combine
locally. ``calibrate`` measures where a swap beats an all-gather of the same bytes
(``p2p_threshold_bytes``, ``p2p_small_messages``); :func:`p2p_faster` reads that measurement. A
profile without it (the built-in ones) never chooses point-to-point.
"""

from __future__ import annotations

from .hardware import HardwareProfile

ALGORITHMS = ("flat", "hierarchical", "p2p")
HIERARCHICAL_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def flat_time(profile: HardwareProfile, kind: str, elements: int, per_node: int, nodes: int,
              bytes_per_element: int = 4) -> float:
    """One ring over all ``per_node × nodes`` ranks, at the inter-node level when ``nodes > 1``."""
    level = "inter" if nodes > 1 else "intra"
    return profile.collective_time(kind, elements, per_node * nodes, bytes_per_element, level)


def hierarchical_time(profile: HardwareProfile, kind: str, elements: int, per_node: int,
                      nodes: int, bytes_per_element: int = 4) -> float:
    """The steps of the module docstring's table, each priced at its level."""
    k, m, n, b = per_node, nodes, elements, bytes_per_element
    shard = -(-n // k)  # the part of the tensor one local rank carries between nodes
    t = profile.collective_time
    if kind == "all_reduce":
        return (t("reduce_scatter", shard * k, k, b) + t("all_reduce", shard, m, b, "inter")
                + t("all_gather", shard * k, k, b))
    if kind == "all_gather":
        return t("all_gather", shard, m, b, "inter") + t("all_gather", n, k, b)
    if kind == "reduce_scatter":
        return t("reduce_scatter", n, k, b) + t("reduce_scatter", shard, m, b, "inter")
    raise ValueError(f"no hierarchical algorithm for {kind!r}; known: {HIERARCHICAL_KINDS}")


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
                    bytes_per_element: int = 4) -> dict[str, float]:
    """Predicted seconds of each algorithm that can run ``kind`` on this group: ``flat`` always,
    ``hierarchical`` when the group spans nodes with several ranks on each."""
    times = {"flat": flat_time(profile, kind, elements, per_node, nodes, bytes_per_element)}
    if kind in HIERARCHICAL_KINDS and nodes > 1 and per_node > 1:
        times["hierarchical"] = hierarchical_time(profile, kind, elements, per_node, nodes,
                                                  bytes_per_element)
    return times


def choose_algorithm(profile: HardwareProfile, kind: str, elements: int, per_node: int,
                     nodes: int, bytes_per_element: int = 4) -> tuple[str, dict[str, float]]:
    """``(algorithm, predicted seconds per priced algorithm)`` for one collective.

    A group of two whose measured swap beats an all-gather at this size exchanges point to point;
    otherwise the faster of flat and hierarchical (ties: flat).
    """
    times = algorithm_times(profile, kind, elements, per_node, nodes, bytes_per_element)
    if (per_node * nodes == 2 and kind in HIERARCHICAL_KINDS
            and p2p_faster(profile, exchanged_bytes(kind, elements, bytes_per_element))):
        return "p2p", times
    return min(times, key=lambda a: (times[a], a != "flat")), times
