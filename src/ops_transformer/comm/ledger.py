"""The communication ledger: one recorder for every collective the library issues.

Every collective in ``ops_transformer`` goes through :mod:`ops_transformer.comm.primitives`, which
reports it here. A :class:`CommLedger` is a context manager; while it is open it records each call
issued **by this process** (this rank). Ledgers nest: every open ledger sees every call.

Element convention (``elements`` in a record and in :meth:`CommLedger.summary`) — the size of the
*full logical tensor* the collective works on, seen from this rank:

============== ==========================================================================
kind           elements counted
============== ==========================================================================
all_reduce     the tensor reduced (what this rank contributes, equal to what it receives)
all_gather     the gathered output (``group_size`` × this rank's shard)
reduce_scatter the unscattered input (``group_size`` × this rank's output shard)
all_to_all     the elements this rank sends
broadcast      the tensor broadcast
send / recv    the tensor sent / received
send_recv      the tensor sent to the next rank of a ring (as many elements arrive from the
               previous one): one step of context parallelism's ring (labels ``cp.*``)
============== ==========================================================================

With this convention a sequence-parallel reduce-scatter + all-gather pair reports the same volume as
the all-reduce it replaces (``b·s·h`` each), as Korthikanti et al. (2022) count it. The bytes that a
ring algorithm actually moves per rank are given by :func:`~ops_transformer.planner.cost.wire_elements`.

What ran: a collective that the communication engine (:mod:`.engine`) runs in several steps —
hierarchically across nodes, staged over the PCIe islands of a node, or as a point-to-point
exchange in a group of two — is still **one** record of its logical kind, group and elements (so
:meth:`CommLedger.summary` and the cost formulas keep counting logical collectives), with
``algorithm`` naming how it ran and ``steps`` listing each step: its kind, elements, sub-group and
level (``"intra"`` inside a node — inside one island when islands are declared —,
``"inter_island"`` between the islands of one node, ``"inter"`` across nodes).
:meth:`CommLedger.executed`, :meth:`CommLedger.by_level` and :meth:`CommLedger.by_algorithm` read
them; a flat record is its own single step.

The registry of open ledgers is the one piece of process-wide state in the package: collectives in
backward run on autograd's threads, where a context variable would not be visible. When no ledger is
open, recording is a single truthiness test.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..planner.cost import wire_elements  # the ring volumes: a cost-model formula

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv",
         "send_recv")

_open_ledgers: list[CommLedger] = []
_lock = threading.Lock()


@dataclass(frozen=True)
class CommStep:
    """One collective that actually ran, as part of a :class:`CommRecord`: its kind, the elements
    (same convention as the record), the sub-group's global ranks and its level (``"intra"``: all
    on one node — in one PCIe island when islands are declared —, ``"inter_island"``: several
    islands of one node, ``"inter"``: across nodes, ``""``: unknown, the group was not made by a
    ``ParallelContext``); ``flows``: how many sub-groups run this step at once over the link
    between islands (the cross-island stage of a staged collective: one per rank of an island),
    which share its bandwidth."""

    kind: str
    elements: int
    bytes: int
    group_ranks: tuple[int, ...]
    level: str = ""
    flows: int = 1


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by this rank: its logical kind, group and size, the algorithm
    the communication engine ran it with (``"flat"``, ``"hierarchical"``, ``"staged"`` or
    ``"p2p"``), the level
    of its group, and, for a multi-step algorithm, the steps that ran."""

    kind: str
    elements: int
    bytes: int
    dtype: torch.dtype
    group_size: int
    group_ranks: tuple[int, ...]
    label: str = ""
    algorithm: str = "flat"
    level: str = ""
    steps: tuple[CommStep, ...] = ()

    def executed(self) -> tuple[CommStep, ...]:
        """The collectives that ran: the steps, or the record itself when it ran flat."""
        return self.steps or (CommStep(self.kind, self.elements, self.bytes, self.group_ranks,
                                       self.level),)


class CommLedger:
    """Records the collectives issued by this rank while it is open.

    >>> with CommLedger() as ledger:
    ...     y = mlp(x)
    >>> ledger.summary()["all_reduce"]
    {'calls': 1, 'elements': 4096, 'bytes': 16384}
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommLedger:
        with _lock:
            _open_ledgers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _open_ledgers.remove(self)

    def reset(self) -> None:
        self.records.clear()

    def add(self, record: CommRecord, tensor: torch.Tensor) -> None:
        """Keep ``record``; ``tensor`` is the collective's input, before the call runs (a
        subclass may look at it: :mod:`ops_transformer.profiler.watch` fingerprints it)."""
        self.records.append(record)

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls", "elements", "bytes"}}`` for every kind that was called."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            entry = out.setdefault(r.kind, {"calls": 0, "elements": 0, "bytes": 0})
            entry["calls"] += 1
            entry["elements"] += r.elements
            entry["bytes"] += r.bytes
        return out

    def by_group(self) -> dict[tuple[int, ...], dict[str, dict[str, int]]]:
        """The summary split by the ranks of the group each collective ran on."""
        grouped: dict[tuple[int, ...], CommLedger] = defaultdict(CommLedger)
        for r in self.records:
            grouped[r.group_ranks].records.append(r)
        return {ranks: ledger.summary() for ranks, ledger in grouped.items()}

    def executed(self) -> list[CommStep]:
        """Every collective that ran, in order, steps of multi-step algorithms expanded."""
        return [step for r in self.records for step in r.executed()]

    def by_level(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{level: {kind: {"calls", "elements", "bytes"}}}`` of what ran (steps expanded), with
        ``"intra"`` for collectives inside a node (one island), ``"inter_island"`` for those
        between the PCIe islands of a node and ``"inter"`` for those across nodes."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for step in self.executed():
            entry = out.setdefault(step.level, {}).setdefault(
                step.kind, {"calls": 0, "elements": 0, "bytes": 0})
            entry["calls"] += 1
            entry["elements"] += step.elements
            entry["bytes"] += step.bytes
        return out

    def by_algorithm(self) -> dict[str, dict[str, dict[str, int]]]:
        """The summary of logical collectives split by the algorithm that ran them."""
        grouped: dict[str, CommLedger] = defaultdict(CommLedger)
        for r in self.records:
            grouped[r.algorithm].records.append(r)
        return {algorithm: ledger.summary() for algorithm, ledger in grouped.items()}

    def by_dtype(self) -> dict[str, dict[str, int]]:
        """Calls and bytes per dtype (e.g. to check that gradients travel in fp32)."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            entry = out.setdefault(str(r.dtype).replace("torch.", ""), {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += r.bytes
        return out

    @property
    def calls(self) -> int:
        return len(self.records)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def wire_bytes(self) -> float:
        """Bytes this rank sends with ring algorithms (see :func:`wire_elements`)."""
        return sum(
            wire_elements(r.kind, r.elements, r.group_size) * r.bytes / max(r.elements, 1)
            for r in self.records
        )

    def __repr__(self) -> str:
        return f"CommLedger(calls={self.calls}, bytes={self.total_bytes})"


def ledger_active() -> bool:
    return bool(_open_ledgers)


def record(kind: str, tensor: torch.Tensor, elements: int, group_ranks: tuple[int, ...],
           label: str = "", *, algorithm: str = "flat", level: str = "",
           steps: tuple[CommStep, ...] = ()) -> None:
    """Report one collective to every open ledger (call only when :func:`ledger_active`)."""
    rec = CommRecord(kind, int(elements), int(elements) * tensor.element_size(), tensor.dtype,
                     len(group_ranks), group_ranks, label, algorithm, level, steps)
    with _lock:
        for ledger in _open_ledgers:
            ledger.add(rec, tensor)


# Under ``torch.compile`` the ledger cannot record in Python while the graph is traced (that would
# count once, at trace time, with fake tensors): the collectives report through this custom op,
# which the compiled graph keeps (it is marked side-effecting) and calls on every run. Its fake
# (tracing) form records nothing; its real form is :func:`record`, on the real tensor.

# ``seq`` makes every record of a graph a node of its own: AOTAutograd's common-subexpression
# pass merges calls with equal arguments even when they are marked side-effecting, and two chunks'
# all-gathers record equal arguments (fresh output buffers of one shape, one label) — measured:
# half the chunked all-gathers went unrecorded before it.

@torch.library.custom_op("ops_transformer::ledger_record", mutates_args=())
def _ledger_record(tensor: torch.Tensor, kind: str, elements: int, group_ranks: list[int],
                   label: str, level: str, seq: int) -> None:
    if ledger_active():
        record(kind, tensor, elements, tuple(group_ranks), label, level=level)


@_ledger_record.register_fake
def _(tensor, kind, elements, group_ranks, label, level, seq) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.ops_transformer.ledger_record.default)

_TRACED = [0]  # records traced so far in this process


@torch.compiler.assume_constant_result
def _next_traced() -> int:
    """A number no other record of any graph has: evaluated once, while Dynamo traces, and kept
    in the graph as a constant (no guard, no recompile)."""
    _TRACED[0] += 1
    return _TRACED[0]


def record_compiled(kind: str, tensor: torch.Tensor, elements: int, group_ranks: tuple[int, ...],
                    label: str = "", level: str = "") -> None:
    """:func:`record` from inside a compiled graph: one call of the graph, one record (the op
    runs on every call; the collectives of a compiled graph run flat)."""
    torch.ops.ops_transformer.ledger_record(tensor, kind, int(elements), list(group_ranks),
                                            label, level, _next_traced())
