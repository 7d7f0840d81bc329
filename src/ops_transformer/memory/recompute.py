"""Activation recompute, applied from outside the model (Chen et al. 2016; Korthikanti et al. 2022).

* ``full``: each Transformer layer keeps only its inputs; backward replays the layer — its
  forward collectives included (the ledger shows them a second time, in backward) — and then
  differentiates it. The replay stops at the last tensor backward needs (torch's checkpoint stops
  early), so a layer's final all-reduce / reduce-scatter, which only feeds the residual add, is not
  repeated. Activation memory per layer drops to the layer input (``2sbh`` 16-bit bytes,
  ``2sbh/t`` with sequence parallelism) for one extra forward pass of compute.
* ``selective``: only the attention core — scores, softmax, dropout, weighted sum — is replayed.
  It holds the ``as²`` terms of eager attention and needs no communication, so it costs
  ``4bs²h`` FLOPs per layer.

Both use :func:`torch.utils.checkpoint.checkpoint` (non-reentrant, so data-parallel gradient hooks
see one backward; ``preserve_rng_state=True``, so dropout draws the same masks when replayed) and are
exact: the same losses and gradients as no recompute. Without autograd (inference) nothing is
checkpointed.

The reference GPT exposes its attention core as ``Attention.core``; Hugging Face models go through
their attention-function registry (``AttentionInterface``) for ``selective`` and through their own
``gradient_checkpointing_enable`` for ``full``.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers.regions import wrap_own_forward
from ..models.hf import is_hf, transformer_layers

from ..schema.choices import RECOMPUTE


def checkpointed(fn):
    """``fn`` whose intermediate tensors are not kept but recomputed in backward."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return run


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def apply_recompute(model: nn.Module, recompute: str) -> None:
    """Make ``model`` recompute activations in backward (in place): ``"none"``, ``"selective"``
    (the attention core) or ``"full"`` (every Transformer layer)."""
    check_recompute(recompute)
    if recompute == "none":
        return
    if is_hf(model):
        _apply_hf(model, recompute)
        return
    for block in transformer_layers(model):
        if recompute == "full":  # (a region's collectives stay outside the checkpoint)
            wrap_own_forward(block, checkpointed)
            continue
        attn = getattr(block, "attn", None)
        if not callable(getattr(attn, "core", None)):
            raise ValueError(
                f"recompute='selective' replays the attention core alone; "
                f"{type(attn).__name__} has none to replay (attention='kv_split' spreads it over "
                f"the ranks with communication): use recompute='full' or attention='heads'")
        attn.core = checkpointed(attn.core)


def _apply_hf(model: nn.Module, recompute: str) -> None:
    if recompute == "full":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"recompute='full': {type(model).__name__} does not support gradient "
                             f"checkpointing")
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    model.config._attn_implementation = _selective_attention(model.config._attn_implementation)


def _selective_attention(implementation: str | None) -> str:
    """Register (once) an attention function that checkpoints ``implementation`` and return its
    name in Hugging Face's registry."""
    from transformers import AttentionInterface

    implementation = implementation or "eager"
    name = f"ops_transformer_recompute_{implementation}"
    if name in AttentionInterface._global_mapping:
        return name

    def attention(module, query, key, value, attention_mask, **kwargs):
        inner = hf_attention_function(module, implementation)
        return checkpointed(inner)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    return name


def hf_attention_function(module: nn.Module, implementation: str):
    if implementation == "eager":  # each model file defines its own eager attention
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping[implementation]
