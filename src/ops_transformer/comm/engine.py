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
* ``staged`` — the same two stages over the PCIe islands of one node (GPUs behind different PCIe
  switches or sockets, ``ranks_per_island``): inside each island, then between islands, so that
  only ``1/k`` of the data crosses the shared link between islands;
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


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _by(ranks, key) -> list[list[int]] | None:
    """``ranks`` grouped by ``key`` (keys in order), or ``None`` unless every group holds the same
    number of them."""
    parts: dict[int, list[int]] = {}
    for r in sorted(ranks):
        parts.setdefault(key(r), []).append(r)
    counts = {len(v) for v in parts.values()}
    return [parts[k] for k in sorted(parts)] if len(counts) == 1 else None


@dataclass(frozen=True)
class NodeLayout:
    """``world_size`` ranks, ``ranks_per_node`` on each node, numbered node by node (as ``torchrun``
    numbers them: ``RANK = GROUP_RANK · LOCAL_WORLD_SIZE + LOCAL_RANK``); inside each node,
    ``ranks_per_island`` consecutive ranks per PCIe island (``None``: the node is one island)."""

    world_size: int
    ranks_per_node: int
    ranks_per_island: int | None = None

    def __post_init__(self):
        rpn, world, rpi = self.ranks_per_node, self.world_size, self.ranks_per_island
        _positive("ranks_per_node", rpn)
        if world % rpn:
            raise ValueError(f"ranks_per_node ({rpn}) must divide the world size ({world}): "
                             f"every node runs the same number of ranks")
        if rpi is not None:
            _positive("ranks_per_island", rpi)
            if rpn % rpi:
                raise ValueError(f"ranks_per_island ({rpi}) must divide the ranks per node "
                                 f"({rpn}): every PCIe island of a node holds the same number "
                                 f"of ranks")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def islands_per_node(self) -> int:
        return self.ranks_per_node // (self.ranks_per_island or self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def island_of(self, rank: int) -> int:
        """The island's index over the whole job (islands numbered node by node)."""
        return rank // (self.ranks_per_island or self.ranks_per_node)

    def level(self, ranks) -> str:
        """``"intra"`` when all ``ranks`` are in one island of one node, ``"inter_island"`` when
        they are on one node but in several of its islands, else ``"inter"``."""
        if len({self.node_of(r) for r in ranks}) > 1:
            return "inter"
        return "intra" if len({self.island_of(r) for r in ranks}) == 1 else "inter_island"

    def split(self, ranks) -> list[list[int]] | None:
        """The group's ranks by node (nodes in order), or ``None`` unless every node it touches
        holds the same number of them (the hierarchical algorithms need that)."""
        return _by(ranks, self.node_of)

    def split_islands(self, ranks) -> list[list[int]] | None:
        """The ranks of a group inside one node by island (islands in order), or ``None`` unless
        the group lies in one node and every island it touches holds the same number of them
        (the staged algorithms need that)."""
        if len({self.node_of(r) for r in ranks}) > 1:
            return None
        return _by(ranks, self.island_of)


@dataclass(frozen=True)
class Stages:
    """How a two-stage collective runs on one group: ``parts × per_part`` ranks (``per_part``
    ranks in each of ``parts`` nodes or islands), this rank's part (``inner``, its ranks
    ``inner_ranks``) and the ranks at its position in every part (``outer``, ``outer_ranks``),
    with the ledger's level of each stage; ``flows``: the outer sub-groups that run at once over
    the link between parts (one per rank of a part)."""

    per_part: int
    parts: int
    inner: object
    outer: object
    inner_ranks: tuple[int, ...]
    outer_ranks: tuple[int, ...]
    inner_level: str = "intra"
    outer_level: str = "inter"

    @property
    def flows(self) -> int:
        return self.per_part if self.outer_level == "inter_island" else 1


@dataclass(eq=False)
class GroupAlgorithms:
    """One group's shape over the nodes and the algorithm choice for its collectives.

    ``group``: the process group; ``rank``: this rank (global); ``ranks``: the group's global ranks
    (group order); ``per_node × nodes`` of them; ``level``:
    ``"intra"``, ``"inter_island"`` or ``"inter"``; ``intra`` / ``inter``: this rank's sub-groups
    (its node's ranks of the group; the ranks at its position on every node), ``None`` where a
    hierarchical algorithm is impossible or could never win on this profile (then they were not
    created). A group inside one node that spans ``islands`` PCIe islands evenly has ``island``
    / ``cross`` likewise (its island's ranks of the group; the ranks at its position in every
    island), for the staged algorithms.
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
    islands: int = 1
    island: object | None = None
    cross: object | None = None
    island_ranks: tuple[int, ...] = ()
    cross_ranks: tuple[int, ...] = ()
    _choices: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def peer(self, rank: int) -> int:
        """The other rank of a group of two."""
        return self.ranks[1] if rank == self.ranks[0] else self.ranks[0]

    def stages(self, algorithm: str) -> Stages:
        """The two stages of ``"hierarchical"`` (nodes) or ``"staged"`` (PCIe islands)."""
        if algorithm == "hierarchical":
            return Stages(self.per_node, self.nodes, self.intra, self.inter, self.intra_ranks,
                          self.inter_ranks, "intra", "inter")
        return Stages(self.per_node // self.islands, self.islands, self.island, self.cross,
                      self.island_ranks, self.cross_ranks, "intra", "inter_island")

    def choose(self, kind: str, elements: int, dtype: torch.dtype) -> str:
        """``"flat"``, ``"hierarchical"``, ``"staged"`` or ``"p2p"`` for one collective
        (cached)."""
        key = (kind, elements, dtype)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._decide(kind, elements, torch.empty((), dtype=dtype).element_size())
            self._choices[key] = choice
        return choice

    def _decide(self, kind: str, elements: int, element_size: int) -> str:
        choice, _ = choose_algorithm(self.profile, kind, elements, self.per_node, self.nodes,
                                     element_size, islands=self.islands)
        if choice == "hierarchical" and self.intra is None:
            return "flat"  # sub-groups were not built: see hierarchy_can_win
        if choice == "staged" and self.island is None:
            return "flat"  # sub-groups were not built: see staging_can_win
        if choice == "p2p" and self.size != 2:
            return "flat"
        return choice

    def describe(self) -> dict:
        return {"ranks": list(self.ranks), "per_node": self.per_node, "nodes": self.nodes,
                "level": self.level, "intra_ranks": list(self.intra_ranks),
                "inter_ranks": list(self.inter_ranks), "islands": self.islands,
                "island_ranks": list(self.island_ranks), "cross_ranks": list(self.cross_ranks),
                "profile": self.profile.name}


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


def staging_can_win(profile: HardwareProfile, per_island: int, islands: int) -> bool:
    """Whether the staged form over PCIe islands beats flat for some all-reduce, all-gather or
    reduce-scatter of up to 1 GiB of fp32 on this profile (if not, its sub-groups need not
    exist): as for :func:`hierarchy_can_win`, the two ends decide."""
    if islands < 2 or per_island < 2:
        return False
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for elements in (per_island * islands, 1 << 28):
            times = algorithm_times(profile, kind, elements, per_island * islands, 1,
                                    islands=islands)
            if times["staged"] < times["flat"]:
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
