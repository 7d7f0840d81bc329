"""Context parallelism's K/V exchange per layer, and how much of it attention hides (SPEC F18).

The ``cp`` ranks each hold ``s/cp`` of the sequence (head-tail balanced for causal attention, so
each rank computes ``1/cp`` of the attention core). Per layer and micro-batch of ``b`` sequences,
with ``h_kv = kv_heads · head_dim`` divided over ``tp`` where the KV heads are split (a rank
holds at least one KV head):

* ``ring``: forward ``cp − 1`` point-to-point exchanges, each of ``2·b·(s/cp)·h_kv`` elements
  (a K and a V block); backward the same exchanges again plus the returns of dK and dV (as many
  more). Each step's transfer runs under the previous block's attention: only what exceeds the
  attention time is exposed.
* ``allgather_kv``: forward one all-gather of K and V (``2·b·s·h_kv`` gathered elements),
  backward one reduce-scatter of dK and dV (the same); not overlapped.

This module is the planner's pricing; ``planner/context_parallel.py`` (issue #36) holds the
runtime's exact formulas, which these volumes must equal.
"""

from __future__ import annotations

from .cost import Comm

CP_STRATEGIES = ("ring", "allgather_kv")


def kv_width(kv_heads: int, head_dim: int, tp: int) -> int:
    """``h_kv`` per rank: the KV heads split over ``tp`` (at least one head per rank)."""
    return max(1, kv_heads // tp) * head_dim


def cp_layer_comm(strategy: str, micro_batch: int, seq: int, kv_heads: int, head_dim: int,
                  cp: int, tp: int = 1) -> dict[str, Comm]:
    """``{"forward": Comm, "backward": Comm}`` of one layer on one rank of the CP group."""
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"cp strategy must be one of {CP_STRATEGIES}, got {strategy!r}")
    if cp == 1:
        return {"forward": Comm(), "backward": Comm()}
    if seq % cp:
        raise ValueError(f"cp ({cp}) must divide the sequence length ({seq})")
    h_kv = kv_width(kv_heads, head_dim, tp)
    block = 2 * micro_batch * (seq // cp) * h_kv
    if strategy == "ring":
        return {"forward": Comm().add("send_recv", block * (cp - 1), cp - 1),
                "backward": Comm().add("send_recv", 2 * block * (cp - 1), 2 * (cp - 1))}
    gathered = 2 * micro_batch * seq * h_kv
    return {"forward": Comm().add("all_gather", gathered),
            "backward": Comm().add("reduce_scatter", gathered)}


def exposed_cp_time(strategy: str, comm_s: float, attention_s: float) -> float:
    """The part of a pass's exchange (``comm_s``) that its attention (``attention_s``) does not
    hide: the ring overlaps, the all-gather does not."""
    if strategy == "ring":
        return max(0.0, comm_s - attention_s)
    return comm_s
