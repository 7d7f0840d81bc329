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

The volumes are :func:`.context_parallel.layer_comm`'s (the runtime's exact formula, equal to
the ledger): this module adds the planner's view — the KV width a rank holds under tensor
parallelism and the part of the exchange attention does not hide. The ring's backward counts
``2·cp − 1`` exchanges: ``cp − 1`` of K/V and ``cp`` of dK/dV travelling back to their owner.
"""

from __future__ import annotations

from .context_parallel import CP_STRATEGIES, check_strategy, layer_comm
from .cost import Comm

__all__ = ["CP_STRATEGIES", "kv_width", "cp_layer_comm", "exposed_cp_time"]


def kv_width(kv_heads: int, head_dim: int, tp: int) -> int:
    """``h_kv`` per rank: the KV heads split over ``tp`` (at least one head per rank)."""
    return max(1, kv_heads // tp) * head_dim


def cp_layer_comm(strategy: str, micro_batch: int, seq: int, kv_heads: int, head_dim: int,
                  cp: int, tp: int = 1) -> dict[str, Comm]:
    """``{"forward": Comm, "backward": Comm}`` of one layer on one rank of the CP group."""
    check_strategy(strategy)
    if cp > 1 and seq % cp:
        raise ValueError(f"cp ({cp}) must divide the sequence length ({seq})")
    comm = layer_comm(strategy, batch=micro_batch, seq=seq,
                      kv_dim=kv_width(kv_heads, head_dim, tp), cp=cp)
    return {"forward": comm["fwd"], "backward": comm["bwd"]}


def exposed_cp_time(strategy: str, comm_s: float, attention_s: float) -> float:
    """The part of a pass's exchange (``comm_s``) that its attention (``attention_s``) does not
    hide: the ring overlaps, the all-gather does not."""
    if strategy == "ring":
        return max(0.0, comm_s - attention_s)
    return comm_s
