"""The cost model's two shared pieces: the ``{kind: {calls, elements}}`` type and the one formula
that turns it into time.

:class:`Comm` is what every count of collectives in the package is: the strategies' per-layer
costs (:mod:`.strategies`), the split of a standalone linear
(:func:`.strategies.split_comm`) and the predicted communication in the training
metrics. It is a ``dict`` (JSON and ``==`` with the ledger's summaries work unchanged) that can be
added, scaled and priced. Elements follow the ledger's convention (the full logical tensor: the
gathered output of an all-gather, the unscattered input of a reduce-scatter).

**One collective-time formula** (Hockney's α–β model with the per-rank volumes of ring algorithms,
Patarasuk & Yuan 2009)::

    t = calls · α(kind, p) + wire_elements(kind, n, p) · bytes / β(kind, p)

:func:`collective_time` is that formula and nothing else; where α and β come from is the caller's
affair: a measured profile gives α per call at the measured world size
(:class:`~.hardware.HardwareProfile`), a catalogue link gives α per ring step and
:func:`link_alpha` multiplies it by :func:`ring_steps`, and :mod:`.network` gives β for a group
that spans nodes. A hierarchical collective (:func:`hierarchical_time`) is three flat ones priced by
the same formula.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def wire_elements(kind: str, elements: int, group_size: int) -> float:
    """Elements each rank sends with bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009).

    all-reduce ``2(p-1)/p·n``; all-gather and reduce-scatter ``(p-1)/p·n``; all-to-all ``(p-1)/p·n``
    (the part of its input a rank keeps is not sent); broadcast/send/recv ``n``.
    """
    p = group_size
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (p - 1) / p * elements
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p * elements
    return float(elements)


AlphaBeta = Callable[[str, int], "tuple[float, float]"]  # (kind, group size) -> (α s, β bytes/s)


class Comm(dict):
    """``{kind: {"calls": int, "elements": int}}``: collectives issued by one rank.

    >>> Comm.of(("all_reduce", 1024), ("all_reduce", 512))
    {'all_reduce': {'calls': 2, 'elements': 1536}}
    """

    @classmethod
    def of(cls, *calls: tuple[str, int]) -> Comm:
        """One call per ``(kind, elements)`` pair; pairs with no elements are left out."""
        out = cls()
        for kind, elements in calls:
            if elements > 0:
                out.add(kind, elements)
        return out

    @classmethod
    def total(cls, parts: Iterable[dict]) -> Comm:
        out = cls()
        for part in parts:
            for kind, c in part.items():
                out.add(kind, c["elements"], c["calls"])
        return out

    def add(self, kind: str, elements: int, calls: int = 1) -> Comm:
        entry = self.setdefault(kind, {"calls": 0, "elements": 0})
        entry["calls"] += calls
        entry["elements"] += elements
        return self

    def __add__(self, other: dict) -> Comm:
        return Comm.total((self, other))

    def minus(self, other: dict) -> Comm:
        """What is left after taking ``other`` out (kinds with no call left are dropped)."""
        out = Comm()
        for kind, c in self.items():
            o = other.get(kind, {"calls": 0, "elements": 0})
            if c["calls"] - o["calls"]:
                out.add(kind, c["elements"] - o["elements"], c["calls"] - o["calls"])
        return out

    def scaled(self, factor: int) -> Comm:
        """``factor`` repetitions (e.g. one entry per layer × the number of layers)."""
        return Comm({k: {"calls": c["calls"] * factor, "elements": c["elements"] * factor}
                     for k, c in self.items()})

    @property
    def calls(self) -> int:
        return sum(c["calls"] for c in self.values())

    def wire_elements(self, group_size: int) -> float:
        """Elements one rank sends with ring algorithms (:func:`wire_elements` per kind)."""
        return sum(wire_elements(k, c["elements"], group_size) for k, c in self.items())


def ring_steps(kind: str, group_size: int) -> int:
    """Latency-bound steps of a ring collective: ``2(p−1)`` for an all-reduce, ``p−1`` for an
    all-gather, reduce-scatter or all-to-all, 1 for a send (0 on a group of one)."""
    p = group_size
    if p <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (p - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return p - 1
    return 1


def link_alpha(kind: str, group_size: int, step_latency_s: float) -> float:
    """α of one call on a link whose latency is given per ring step (the catalogue's links)."""
    return ring_steps(kind, group_size) * step_latency_s


def collective_time(kind: str, elements: float, group_size: int, *, alpha_s: float,
                    bandwidth: float, bytes_per_element: int = 4, calls: int = 1) -> float:
    """``calls · α + wire_elements(kind, elements, p) · bytes / β`` seconds; 0 on a group of one
    or with nothing to send. ``elements`` is the total over the ``calls`` (ledger convention);
    elements with no call are a share of a coalesced collective whose call is counted once
    elsewhere (the per-layer gradient sums): their bytes, no latency."""
    if group_size <= 1 or (calls <= 0 and elements <= 0):
        return 0.0
    wire = wire_elements(kind, elements, group_size)
    return calls * alpha_s + wire * bytes_per_element / bandwidth


def comm_time(comm: dict, group_size: int, alpha_beta: AlphaBeta,
              bytes_per_element: int = 4) -> float:
    """:func:`collective_time` summed over a :class:`Comm` run on one group."""
    total = 0.0
    for kind, c in comm.items():
        alpha, beta = alpha_beta(kind, group_size)
        total += collective_time(kind, c["elements"], group_size, alpha_s=alpha, bandwidth=beta,
                                 bytes_per_element=bytes_per_element, calls=c["calls"])
    return total


def hierarchical_time(kind: str, elements: float, *, nodes: int, per_node: int,
                      intra: AlphaBeta, inter: AlphaBeta, bytes_per_element: int = 4) -> float:
    """One collective over ``nodes × per_node`` ranks run in stages, each priced by
    :func:`collective_time` on its own group (``intra``/``inter`` give α, β per kind and size):

    * all-reduce: reduce-scatter ``n`` inside the node, all-reduce of the ``n/per_node`` shard
      across nodes, all-gather ``n`` inside the node;
    * all-gather: all-gather of ``n/per_node`` across nodes, then ``n`` inside the node;
    * reduce-scatter: ``n`` inside the node, then ``n/per_node`` across nodes.

    Other kinds, and groups inside one node or with one rank per node, run flat."""
    def one(k, n, p, ab):
        alpha, beta = ab(k, p)
        return collective_time(k, n, p, alpha_s=alpha, bandwidth=beta,
                               bytes_per_element=bytes_per_element)

    if nodes <= 1:
        return one(kind, elements, per_node, intra)
    if per_node <= 1 or kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        return one(kind, elements, nodes * per_node, inter)
    shard = elements / per_node
    if kind == "all_reduce":
        return (one("reduce_scatter", elements, per_node, intra)
                + one("all_reduce", shard, nodes, inter)
                + one("all_gather", elements, per_node, intra))
    if kind == "all_gather":
        return one("all_gather", shard, nodes, inter) + one("all_gather", elements, per_node, intra)
    return one("reduce_scatter", elements, per_node, intra) + one("reduce_scatter", shard, nodes,
                                                                   inter)
