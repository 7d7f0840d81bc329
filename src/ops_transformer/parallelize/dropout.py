"""Dropout that matches one device, applied by ``parallelize`` to the reference GPT at every ``tp``
(SPEC F7; the scheme is :mod:`ops_transformer.layers.dropout`).

================================ ============================================================
site of the reference GPT        this rank's part of the one-device mask
================================ ============================================================
``drop`` (after the embedding)   all of it (``replicated``: identical on every TP rank)
``layers.*.drop`` (residual)     all of it; its token share under sequence parallelism
                                 (``tokens``)
attention probabilities          its heads (``heads``, strategies ``heads`` and
(``layers.*.attn.core``)         ``heads_allgather``); all heads (``naive``, replicated);
                                 its query rows (``kv_split``: the strategy's own layer)
================================ ============================================================

The data-parallel rank selects its rows of the global batch. So ``parallelize(model, ctx)`` at
any ``dp × tp`` — with or without sequence parallelism, any recompute — trains with the masks of
``parallelize(model, ctx)`` at ``tp = 1`` on the global batch. With dropout above 0 the attention
core is computed explicitly (scores, causal softmax, this dropout, weighted sum: what
``scaled_dot_product_attention`` does on its math path) instead of by SDPA, whose own mask cannot
be split; with dropout 0, or in eval mode, SDPA runs as before.

Hugging Face models keep their own dropout (:func:`apply_dropout` returns 0 sites): see
``docs/memory.md`` for what that does and does not match.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.dropout import Layout, ParallelDropout, dropout
from ..models.documents import document_mask
from ..models.gpt import GPT, Attention


def _core_with_dropout(attn: Attention):
    """``attn.core`` with the attention probabilities dropped by :func:`dropout`
    (``attn.dropout_layout``: the heads this rank holds, read at each call so that
    :func:`~ops_transformer.layers.dropout.micro_batch_masks` can move it); the original core
    (SDPA) without dropout."""
    fused = attn.core

    def core(q, k, v, document_ids=None):  # (B, nh, T, hd), (B, nkv, T, hd)
        if not attn.training or attn.dropout == 0.0:
            return fused(q, k, v) if document_ids is None else fused(q, k, v, document_ids)
        if k.shape[1] != q.shape[1]:  # GQA: each KV head serves a group of query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        T = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
        # an additive -inf bias above the diagonal (an addition keeps nothing for backward)
        causal = torch.full((T, T), float("-inf"), dtype=scores.dtype, device=q.device).triu(1)
        if document_ids is not None:  # and never across a packed document: (B, 1, T, T)
            causal = causal.masked_fill(~document_mask(document_ids), float("-inf"))
        probs = F.softmax(scores + causal, dim=-1)
        return dropout(probs, attn.dropout, attn.dropout_layout) @ v  # (B, nh, T, hd)

    return core


def apply_dropout(model: nn.Module, ctx, *, attention: str, sequence_parallel: bool) -> int:
    """Give every dropout site of the reference GPT ``model`` (already parallelised by the plan)
    the one-device mask of its part (module docstring); returns the number of sites. A model
    without dropout, and other models, are left as they are (0)."""
    if not isinstance(model, GPT) or model.cfg.dropout == 0.0:
        return 0
    tp, rank, dp, dp_rank = ctx.tp_size, ctx.tp_rank, ctx.dp_ep_size, ctx.dp_ep_rank
    replicated = Layout("replicated", rank, tp, dp_rank, dp)
    residual = Layout("tokens" if sequence_parallel and tp > 1 else "replicated", rank, tp,
                      dp_rank, dp)
    split = attention in ("heads", "heads_allgather") and tp > 1
    heads = Layout("heads", rank, tp, dp_rank, dp) if split else Layout("heads", 0, 1, dp_rank, dp)
    model.drop = ParallelDropout.from_dense(model.drop, replicated)
    sites = 1
    for block in model.layers:
        block.drop = ParallelDropout.from_dense(block.drop, residual)
        sites += 1
        # the reference attention, or a region of it; kv_split's layer draws its rows' mask itself
        if isinstance(block.attn, Attention):
            block.attn.dropout_layout = heads
            block.attn.core = _core_with_dropout(block.attn)
            sites += 1
    return sites
