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

Hugging Face decoders (:func:`apply_hf_dropout`) get the same scheme at every ``tp``: the
attention probabilities through an attention function of ``transformers``' ``AttentionInterface``
(``ops_transformer_dropout_<inner>``, the model's own implementation — SDPA, eager — whenever
its dropout is 0 or it is not training; otherwise the explicit core with :func:`dropout` over this
rank's heads), and each ``nn.Dropout`` module (GPT-2's embedding, attention-output and MLP
dropout) a :class:`ParallelDropout` — ``replicated`` outside the layers, and inside them
``tokens`` under sequence parallelism (they follow a row layer's exit), else ``replicated``.
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
        T = q.shape[-2]
        # an additive -inf bias above the diagonal (an addition keeps nothing for backward)
        causal = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        if document_ids is not None:  # and never across a packed document: (B, 1, T, T)
            causal = causal.masked_fill(~document_mask(document_ids), float("-inf"))
        return _dropped_attention(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]), attn.dropout,
                                  attn.dropout_layout)  # (B, nh, T, hd)

    return core


def apply_dropout(model: nn.Module, ctx, *, attention: str, sequence_parallel: bool) -> int:
    """Give every dropout site of the reference GPT ``model`` (already parallelised by the plan)
    the one-device mask of its part (module docstring); returns the number of sites. Hugging
    Face decoders: :func:`apply_hf_dropout`. A model without dropout, and other models, are left
    as they are (0)."""
    if not isinstance(model, GPT):
        return apply_hf_dropout(model, ctx, sequence_parallel=sequence_parallel)
    if model.cfg.dropout == 0.0:
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


HF_ATTENTION = "ops_transformer_dropout"


def apply_hf_dropout(model: nn.Module, ctx, *, sequence_parallel: bool) -> int:
    """The one-device masks (module docstring) for a Hugging Face decoder ``model`` with dropout
    above 0 anywhere; returns the number of sites (0: left as it is)."""
    from ..models.hf import is_hf, transformer_layers

    config = getattr(model, "config", None)
    try:  # a model whose layers are not found keeps torch's dropout (as every HF model did)
        layers = list(transformer_layers(model)) if is_hf(model) else []
    except ValueError:
        layers = []
    attentions = [m for layer in layers for m in layer.modules() if _attention_p(m) is not None]
    drops = [(n, m) for n, m in model.named_modules()
             if type(m) is nn.Dropout and m.p > 0 and not n.endswith("attn_dropout")]
    if not layers or not (drops or any(_attention_p(m) > 0 for m in attentions)):
        return 0
    tp, rank, dp, dp_rank = ctx.tp_size, ctx.tp_rank, ctx.dp_ep_size, ctx.dp_ep_rank
    heads = Layout("heads", rank, tp, dp_rank, dp)
    inside = {id(m) for layer in layers for m in layer.modules()}
    residual = Layout("tokens" if sequence_parallel and tp > 1 else "replicated", rank, tp,
                      dp_rank, dp)
    replicated = Layout("replicated", rank, tp, dp_rank, dp)
    for name, module in drops:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, ParallelDropout.from_dense(
            module, residual if id(module) in inside else replicated))
    for attention in attentions:
        attention.dropout_layout = heads
    config._attn_implementation = _hf_dropout_attention(config._attn_implementation)
    return len(drops) + len(attentions)


def hf_dropout_sites(model: nn.Module) -> int:
    """How many one-device dropout sites above 0 :func:`apply_hf_dropout` gave ``model``."""
    return sum(1 for m in model.modules()
               if (isinstance(m, ParallelDropout) and m.p > 0)
               or (isinstance(getattr(m, "dropout_layout", None), Layout)
                   and (_attention_p(m) or 0.0) > 0))


def set_hf_dropout(model: nn.Module, p: float) -> int:
    """Set every dropout of a Hugging Face model to ``p`` — its attention modules' probability
    dropout (``attention_dropout``; GPT-2's ``attn_dropout``), every ``nn.Dropout`` module and the
    config's dropout fields (``attention_dropout``, ``attn_pdrop``, ``resid_pdrop``,
    ``embd_pdrop``, ``hidden_dropout``, …: what ``save_pretrained`` writes); before
    ``parallelize``. Returns the number of modules set (``train --model DIR --dropout P``)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = float(p)
            count += 1
        if type(module) is nn.Dropout:
            module.p = float(p)
            count += 1
    for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout",
                "dropout", "summary_first_dropout"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, float(p))
    return count


def _attention_p(module: nn.Module) -> float | None:
    """The attention-probability dropout of a Hugging Face attention module (Llama's
    ``attention_dropout``, GPT-2's ``attn_dropout``), or ``None`` for other modules."""
    if isinstance(getattr(module, "attention_dropout", None), float):
        return module.attention_dropout
    if isinstance(getattr(module, "attn_dropout", None), nn.Dropout):
        return module.attn_dropout.p
    return None


def _hf_dropout_attention(implementation: str | None) -> str:
    """Register (once) the attention function of :func:`apply_hf_dropout` around
    ``implementation`` (its mask built as ``implementation``'s) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    implementation = implementation or "sdpa"
    name = f"{HF_ATTENTION}_{implementation}"
    if name in AttentionInterface._global_mapping:
        return name

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  **kwargs):
        layout = getattr(module, "dropout_layout", None)
        if dropout == 0.0 or not module.training or layout is None:
            from ..memory.recompute import hf_attention_function

            inner = hf_attention_function(module, implementation)
            return inner(module, query, key, value, attention_mask, dropout=dropout,
                         scaling=scaling, **kwargs)
        return _explicit_attention(query, key, value, attention_mask, dropout, scaling,
                                   layout), None

    AttentionInterface.register(name, attention)
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if implementation in masks:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks[implementation])
    return name


def _explicit_attention(q, k, v, mask, p: float, scaling, layout) -> torch.Tensor:
    """Causal attention of this rank's heads with the one-device dropout mask of the
    probabilities: ``(B, nh, T, hd)`` in, ``(B, T, nh, hd)`` out (what ``transformers``' eager
    attention returns); ``mask`` as Hugging Face builds it (``None``: causal; booleans: kept;
    floats: added)."""
    T, S = q.shape[-2], k.shape[-2]
    if mask is None:
        bias = torch.full((T, S), float("-inf"), dtype=q.dtype, device=q.device).triu(S - T + 1)
    elif mask.dtype == torch.bool:
        bias = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(
            ~mask[..., :S], float("-inf"))
    else:
        bias = mask[..., :S]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = _dropped_attention(q, k, v, bias, scale, p, layout, softmax_dtype=torch.float32)
    return out.transpose(1, 2).contiguous()


def _dropped_attention(q, k, v, bias, scale: float, p: float, layout, softmax_dtype=None):
    """``dropout(softmax(q kᵀ · scale + bias)) v`` with the one-device mask of ``layout``'s part
    (the GQA key/value heads repeated for their query heads); ``bias`` added in the scores'
    dtype; the softmax in ``softmax_dtype`` (``transformers``' eager attention: float32, then
    cast back to ``q``'s), else in the scores' dtype."""
    if k.shape[1] != q.shape[1]:  # GQA: each KV head serves a group of query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-2, -1)) * scale
    probs = F.softmax(scores + bias.to(scores.dtype), dim=-1, dtype=softmax_dtype)
    if softmax_dtype is not None:
        probs = probs.to(q.dtype)
    return dropout(probs, p, layout) @ v
