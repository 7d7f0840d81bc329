"""Attention strategy B: Q, K and V split along the feature dimension inside every head.

Rank ``r`` holds features ``[r·d/p, (r+1)·d/p)`` of every head (``d`` = head_dim; with RoPE the two
rotated halves are split separately, so each rank holds matching pairs). Its partial scores
``S_r = Q_r K_rᵀ`` sum to the full scores ``S = Σ_r S_r``::

    Q_r, K_r, V_r = x W_q,r , x W_k,r , x W_v,r          (B, heads, T, d/p)    no communication
    S_rows       = reduce-scatter_r(Q_r K_rᵀ) over query rows    (B, heads, T/p, T)
    P_rows       = softmax(causal(S_rows / √d))                 rows owned by this rank
    V            = all-gather_r(V_r) over features              (B, kv_heads, T, d)
    O_rows       = P_rows V                                     (B, T/p, heads·d)
    y            = all-gather over rows of (O_rows W_oᵀ + b)     (B, T, h)   W_o replicated

Communication per layer — forward: a reduce-scatter of ``b·a·s²`` score elements, an all-gather of
``b·s·kv_dim`` (V) and one of ``b·s·h`` (the output); backward: the all-gather of the score gradient
(``b·a·s²``), the reduce-scatter of the V gradient, the all-reduce of the input gradient (``b·s·h``)
and the all-reduce of the output projection's weight (and bias) gradient, summed over the rows each
rank saw (``h²``). It grows with ``s²`` where strategy A's grows with ``s·h``, but it needs only
``p | head_dim``, so it is the one way to use more ranks than heads. It is exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.bucketing import mark_partial_grad
from ..comm.primitives import (all_gather_along, copy_to_tp_region, gather_from_tp_region,
                               reduce_scatter_along)
from ..models.gpt import apply_rope
from .dropout import Layout, dropout
from .linear import ColumnParallelLinear, to_compute_dtype


def _feature_blocks(heads: int, head_dim: int, rope: bool) -> list[int]:
    """Sub-blocks that give each rank a slice of every head (of each rotated half with RoPE)."""
    return [head_dim // 2] * (2 * heads) if rope else [head_dim] * heads


def check_kv_split(head_dim: int, tp: int, rope: bool) -> None:
    need = 2 * tp if rope else tp
    if head_dim % need:
        raise ValueError(f"attention='kv_split' splits every head's {head_dim} features over tp "
                         f"({tp}) ranks{' in each RoPE half' if rope else ''}: head_dim "
                         f"({head_dim}) must be divisible by {need}")


class FeatureSplitAttention(nn.Module):
    """Drop-in for the reference :class:`~ops_transformer.models.gpt.Attention` (same parameter
    names ``wq, wk, wv, wo``), computing strategy B; ``wo`` stays replicated. Each rank's ``wo``
    gradient covers its query rows only: it is marked as partial
    (:func:`~ops_transformer.comm.bucketing.mark_partial_grad`), and ``parallelize`` sums it over
    the TP group once per backward, coalesced with the other small sums
    (:func:`~ops_transformer.parallel.state.attach_grad_sums` for a module built by hand)."""

    def __init__(self, attn: nn.Module, ctx, *, rope: bool):
        super().__init__()
        tp, d = ctx.tp_size, attn.head_dim
        check_kv_split(d, tp, rope)
        self.head_dim, self.dropout, self.rope = d, attn.dropout, rope
        self.group, self.tp_size, self.tp_rank = ctx.tp_group, tp, ctx.tp_rank
        # this rank's query rows of the one-device probabilities: their dropout mask
        self.dropout_layout = Layout("rows", ctx.tp_rank, tp, ctx.dp_ep_rank, ctx.dp_ep_size)
        heads, kv_heads = attn.wq.out_features // d, attn.wk.out_features // d
        self.wq = ColumnParallelLinear.from_dense(
            attn.wq, ctx, sub_blocks=_feature_blocks(heads, d, rope), reduce_input_grad=False)
        self.wk = ColumnParallelLinear.from_dense(
            attn.wk, ctx, sub_blocks=_feature_blocks(kv_heads, d, rope), reduce_input_grad=False)
        self.wv = ColumnParallelLinear.from_dense(
            attn.wv, ctx, sub_blocks=_feature_blocks(kv_heads, d, False), reduce_input_grad=False)
        self.wo = attn.wo  # replicated; each rank's gradient covers its rows only: summed
        for p in self.wo.parameters():
            mark_partial_grad(p, self.group)

    def _local_rope(self, cos, sin):
        """The cos/sin columns of this rank's features: slice r of each half."""
        half, part = self.head_dim // 2, self.head_dim // 2 // self.tp_size
        cols = torch.cat([torch.arange(s, s + part, device=cos.device) + self.tp_rank * part
                          for s in (0, half)])  # made on the device: no copy per layer per step
        return cos.index_select(-1, cols), sin.index_select(-1, cols)

    def forward(self, x, rope=None, document_ids=None):
        if document_ids is not None:
            raise ValueError("attention='kv_split' has no document mask yet: packed documents "
                             "(document_ids) need attention='heads', 'heads_allgather' or 'naive'")
        B, T, _ = x.shape
        p = self.tp_size
        if T % p:
            raise ValueError(f"attention='kv_split' scatters the {T} query positions over tp ({p}) "
                             f"ranks: the sequence length must be divisible by {p}")
        x = copy_to_tp_region(to_compute_dtype(x), self.group)  # Q, K, V share one all-reduce
        d_local = self.head_dim // p
        q = self.wq(x).view(B, T, -1, d_local).transpose(1, 2)  # (B, nh, T, d/p)
        k = self.wk(x).view(B, T, -1, d_local).transpose(1, 2)  # (B, nkv, T, d/p)
        v = self.wv(x).view(B, T, -1, d_local).transpose(1, 2)  # (B, nkv, T, d/p)
        if rope is not None:
            local = self._local_rope(*rope)
            q, k = apply_rope(q, *local), apply_rope(k, *local)
        group_size = q.shape[1] // k.shape[1]
        if group_size > 1:
            k = k.repeat_interleave(group_size, 1)
        scores = reduce_scatter_along(q @ k.transpose(-1, -2), self.group, 2)  # (B, nh, T/p, T)
        rows = T // p
        first = self.tp_rank * rows
        query_pos = torch.arange(first, first + rows, device=x.device).unsqueeze(1)
        causal = torch.arange(T, device=x.device).unsqueeze(0) > query_pos  # (T/p, T)
        scores = (scores / math.sqrt(self.head_dim)).masked_fill(causal, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        probs = dropout(probs, self.dropout, self.dropout_layout, self.training)
        v_full = all_gather_along(v, self.group, -1)  # (B, nkv, T, d)
        if group_size > 1:
            v_full = v_full.repeat_interleave(group_size, 1)
        out = (probs @ v_full).transpose(1, 2).reshape(B, rows, -1)  # (B, T/p, nh·d)
        return gather_from_tp_region(self.wo(out), self.group, 1)  # (B, T, h)

    def extra_repr(self) -> str:
        return f"strategy=kv_split, head_dim={self.head_dim}, tp={self.tp_size}, rope={self.rope}"
