"""The communication engine: which algorithm runs each collective of a group (SPEC F11).

Input: where every rank runs (:class:`NodeLayout`, declared or read from ``torchrun`` by
:func:`~ops_transformer.parallel.init_parallel`) and the hardware profile every rank agreed on.
For each group of a :class:`~ops_transformer.parallel.ParallelContext` it keeps a
:class:`GroupAlgorithms`: the group's shape over the nodes (``per_node`` ranks on each of ``nodes``
nodes), this rank's intra- and inter-node sub-groups, and the choice, per collective kind and message
size, between

* ``flat`` — one ``torch.distributed`` collective over the whole group;
* ``hierarchical`` — for a group spanning nodes with several ranks on each: intra-node
  reduce-scatter → inter-node all-reduce of the shards → intra-node all-gather (all-gather and
  reduce-scatter likewise, :mod:`.algorithms`);
* ``p2p`` — for a group of two: one send/recv swap and a local combine.

The choice is :func:`~ops_transformer.planner.collective_algorithms.choose_algorithm` — the cost
model on the agreed profile — never a constant, and it depends only on data every rank of the group
shares (the layout and profile agreed at ``init_parallel``, the kind and the message size), so all
ranks of a group run the same algorithm. It is computed once per (kind, dtype, size) and cached.

The registry from group to :class:`GroupAlgorithms` is, with the ledger's list of open ledgers, the
only process-wide state of the package: every layer holds a plain ``ProcessGroup``, and the
algorithm belongs to that group. It is written only when a ``ParallelContext`` is built, holds its
groups weakly (an entry goes with its group) and is read by :mod:`.collectives`. A group without an
entry (made by hand with ``dist.new_group``) runs flat.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..planner.collective_algorithms import algorithm_times, choose_algorithm
from ..planner.hardware import HardwareProfile

_registry: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@dataclass(frozen=True)
class NodeLayout:
    """``world_size`` ranks, ``ranks_per_node`` on each node, numbered node by node (as ``torchrun``
    numbers them: ``RANK = GROUP_RANK · LOCAL_WORLD_SIZE + LOCAL_RANK``)."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        rpn, world = self.ranks_per_node, self.world_size
        if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, got {rpn!r}")
        if world % rpn:
            raise ValueError(f"ranks_per_node ({rpn}) must divide the world size ({world}): "
                             f"every node runs the same number of ranks")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def level(self, ranks) -> str:
        """``"intra"`` when all ``ranks`` are on one node, else ``"inter"``."""
        return "intra" if len({self.node_of(r) for r in ranks}) == 1 else "inter"

    def split(self, ranks) -> list[list[int]] | None:
        """The group's ranks by node (nodes in order), or ``None`` unless every node it touches
        holds the same number of them (the hierarchical algorithms need that)."""
        by_node: dict[int, list[int]] = {}
        for r in sorted(ranks):
            by_node.setdefault(self.node_of(r), []).append(r)
        counts = {len(v) for v in by_node.values()}
        return [by_node[n] for n in sorted(by_node)] if len(counts) == 1 else None


@dataclass(eq=False)
class GroupAlgorithms:
    """One group's shape over the nodes and the algorithm choice for its collectives.

    ``group``: the process group; ``rank``: this rank (global); ``ranks``: the group's global ranks
    (group order); ``per_node × nodes`` of them; ``level``:
    ``"intra"`` or ``"inter"``; ``intra`` / ``inter``: this rank's sub-groups (its node's ranks of the
    group; the ranks at its position on every node), ``None`` where a hierarchical algorithm is
    impossible or could never win on this profile (then they were not created).
    """

    group: object
    rank: int
    ranks: tuple[int, ...]
    per_node: int
    nodes: int
    level: str
    profile: HardwareProfile
    intra: object | None = None
    inter: object | None = None
    intra_ranks: tuple[int, ...] = ()
    inter_ranks: tuple[int, ...] = ()
    _choices: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, rank: int) -> int:
        """The other rank of a group of two."""
        return self.ranks[1] if rank == self.ranks[0] else self.ranks[0]

    def choose(self, kind: str, elements: int, dtype: torch.dtype) -> str:
        """``"flat"``, ``"hierarchical"`` or ``"p2p"`` for one collective (cached)."""
        key = (kind, elements, dtype)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._decide(kind, elements, torch.empty((), dtype=dtype).element_size())
            self._choices[key] = choice
        return choice

    def _decide(self, kind: str, elements: int, element_size: int) -> str:
        choice, _ = choose_algorithm(self.profile, kind, elements, self.per_node, self.nodes,
                                     element_size)
        if choice == "hierarchical" and self.intra is None:
            return "flat"  # sub-groups were not built: see hierarchy_can_win
        if choice == "p2p" and self.size != 2:
            return "flat"
        return choice

    def describe(self) -> dict:
        return {"ranks": list(self.ranks), "per_node": self.per_node, "nodes": self.nodes,
                "level": self.level, "intra_ranks": list(self.intra_ranks),
                "inter_ranks": list(self.inter_ranks), "profile": self.profile.name}


def hierarchy_can_win(profile: HardwareProfile, per_node: int, nodes: int) -> bool:
    """Whether hierarchical beats flat for some all-reduce, all-gather or reduce-scatter of up to
    1 GiB of fp32 on this profile (if not, its sub-groups need not exist). Both costs are linear
    in the size beyond the latencies, so the two ends decide."""
    if nodes < 2 or per_node < 2:
        return False
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for elements in (per_node * nodes, 1 << 28):
            times = algorithm_times(profile, kind, elements, per_node, nodes)
            if times["hierarchical"] < times["flat"]:
                return True
    return False


def register(group, algorithms: GroupAlgorithms) -> None:
    """Attach ``algorithms`` to ``group`` (called while a ``ParallelContext`` is built)."""
    with _lock:
        _registry[group] = algorithms


def lookup(group) -> GroupAlgorithms | None:
    """The algorithms registered for ``group``, or ``None`` (then it runs flat)."""
    try:
        return _registry.get(group)
    except TypeError:  # not weak-referenceable: not one of ours
        return None
