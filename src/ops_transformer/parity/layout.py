"""What a module's tensor looks like on a tensor-parallel rank, and the way back to dense.

A module of the parallel model hands its caller a tensor in one of these layouts. The plan decides
which; the shapes against the dense run's and the producing layer's shard metadata
(:class:`~ops_transformer.parallel.sharding.ShardSpec`) tell which, so that like is compared with
like:

============== ============================================ ==========================================
layout         where (plan style)                           compared as
============== ============================================ ==========================================
``replicated`` the output of ``rowwise`` (after its          rank 0's own copy, as it is
               all-reduce), ``vocab``, ``embed_colwise``,
               ``reduce_out``, ``sequence`` (gather), gathered
               columns; every replicated module (norms,
               residual streams without sequence
               parallelism, routers, rotary tables)
``split``      ``colwise`` outputs (features; fused          all-gathered over TP and put in dense
               sub-blocks, replicated KV heads and padding   order by the producing layer's
               as the layer's ``ShardSpec`` says),           ``ShardSpec``; another tensor split along
               vocab-parallel logits, per-head tensors       one dimension: by contiguous rank blocks
               (attention weights, per-head norms)           (a shorter last block: padding)
``tokens``     sequence parallelism (``sequence`` scatter/  all-gathered over TP along the b·s tokens
               partial, ``rowwise`` reduce_scatter exit):    (each rank holds a contiguous share)
               this rank's share of the tokens
``partial``    inside a ``reduce_out`` module, a tensor of   as it is and summed over TP: the one
               the dense shape (a partial sum before the     that matches counts
               module's all-reduce, or a replicated one)
``unknown``    a shape that none of the above maps onto      not compared (listed as such)
               the reference's
============== ============================================ ==========================================

The same layouts hold for the gradient of a module's output, where a tensor held by several
replicas (KV heads fewer than ranks) may also match as the sum over its replicas (each saw only its
own query heads). Integer tensors are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm import collectives as C
from ..parallel.sharding import ShardSpec, gather_full, shard_spec


@dataclass(frozen=True)
class Layout:
    """``kind`` (the table above); ``spec``: for ``split``, the dense tensor's split on this rank;
    ``why``: for ``unknown``, the shapes that did not map."""

    kind: str
    spec: ShardSpec | None = None
    why: str = ""

    def describe(self) -> str:
        if self.kind != "split":
            return self.why or self.kind
        s = self.spec
        extras = [f"blocks {list(s.sub_blocks)}" if s.sub_blocks else "",
                  f"×{s.replicas} replicas" if s.replicas > 1 else "",
                  f"padded to {s.padded_size}" if s.padded_size else ""]
        return f"split dim {s.split_dim}" + "".join(f", {e}" for e in extras if e)


REPLICATED = Layout("replicated")


def output_hint(module: nn.Module) -> ShardSpec | None:
    """The ``ShardSpec`` of a layer's output features: a 2-D ``weight [out, in]`` split along its
    output dimension (column-parallel linears, vocab-parallel LM heads)."""
    weight = getattr(module, "weight", None)
    spec = shard_spec(weight) if isinstance(weight, torch.Tensor) else None
    if spec is None or weight.dim() != 2 or spec.split_dim != 0:
        return None
    return spec


def infer_layout(local: tuple[int, ...], ref: tuple[int, ...], tp_rank: int, tp_size: int, *,
                 hint: ShardSpec | None = None, sequence_parallel: bool = False,
                 partial_region: bool = False) -> Layout:
    """The layout of a tensor of shape ``local`` on TP rank ``tp_rank`` whose dense counterpart
    has shape ``ref`` (pure: no communication). ``hint``: the producing layer's output
    ``ShardSpec`` (:func:`output_hint`)."""
    local, ref = tuple(local), tuple(ref)
    if local == ref:
        return Layout("partial") if partial_region and tp_size > 1 else REPLICATED
    diffs = [d for d in range(len(ref)) if len(local) == len(ref) and local[d] != ref[d]]
    if len(diffs) != 1 or tp_size == 1:
        return Layout("unknown", why=f"shape {list(local)} vs dense {list(ref)}")
    d = diffs[0]
    n, full = local[d], ref[d]
    if hint is not None and d == len(ref) - 1 and hint.full_shape[0] == full and \
            hint.local_shape[0] == n:
        return Layout("split", ShardSpec(ref, d, tp_rank, tp_size, hint.sub_blocks,
                                         hint.padded_size, hint.replicas))
    if sequence_parallel and len(ref) == 3 and d == 1 and n * tp_size == full:
        return Layout("tokens")
    if n and full % n == 0 and tp_size % (full // n) == 0:
        return Layout("split", ShardSpec(ref, d, tp_rank, tp_size,
                                         replicas=tp_size // (full // n)))
    if n and -(-full // tp_size) == n:  # the last rank's block is shorter: padding
        return Layout("split", ShardSpec(ref, d, tp_rank, tp_size, padded_size=n * tp_size))
    return Layout("unknown", why=f"shape {list(local)} vs dense {list(ref)}")


def _all_shards(t: torch.Tensor, dim: int, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on each), in TP-rank order (collective)."""
    local = t.detach().movedim(dim, 0).contiguous()
    out = local.new_empty((C.group_size(group) * local.shape[0], *local.shape[1:]))
    C.all_gather_into(out, local, group, label="parity.gather")
    return [s.movedim(0, dim) for s in out.chunk(C.group_size(group), 0)]


def dense_candidates(t: torch.Tensor, layout: Layout, group, *, gradient: bool = False,
                     partial_tail: int = 0) -> list[torch.Tensor]:
    """The dense tensor(s) ``t`` stands for on every rank of ``group`` (collective for ``split``,
    ``tokens`` and ``partial``; every rank of the group must call it with the same layout): one
    tensor, or two where either may be right — for ``partial``, ``t`` itself and its sum over the
    group; for the ``gradient`` of a tensor held by several replicas (KV heads fewer than ranks),
    one replica's and their sum (each replica saw only its own query heads); with
    ``partial_tail=k`` (``mla_kv_a``'s gradient), a replicated tensor as is and with its last
    ``k`` features summed over the group."""
    if layout.kind == "replicated":
        if not partial_tail or C.group_size(group) == 1:
            return [t]
        tail = t[..., -partial_tail:].detach().contiguous()
        C.all_reduce(tail, group, label="parity.partial")
        return [t, torch.cat([t[..., :-partial_tail], tail], -1)]
    if layout.kind == "split":
        spec = layout.spec
        if not (gradient and spec.replicas > 1):
            shard = t.detach().contiguous()
            shard.shard_spec = spec
            return [gather_full(shard, group)]
        shards = _all_shards(t, spec.split_dim, group)
        summed = [sum(shards[i:i + spec.replicas]) for i in range(0, len(shards), spec.replicas)]
        return [spec.unshard(shards), spec.unshard(summed)]
    if layout.kind == "tokens":
        b, s, h = t.shape
        tp = C.group_size(group)
        tokens = t.detach().reshape(-1, h).contiguous()
        tokens.shard_spec = ShardSpec((b * s * tp, h), 0, C.group_rank(group), tp)
        return [gather_full(tokens, group).view(b, s * tp, h)]
    if layout.kind == "partial":
        total = t.detach().clone()
        C.all_reduce(total, group, label="parity.partial")
        return [t, total]
    return []
