"""The memory options applied to a model's Transformer layers: recompute, then the int8 cache."""

from __future__ import annotations

import functools

from torch import nn

from ..layers.regions import wrap_own_forward
from ..models.hf import transformer_layers
from .int8_cache import Int8ActivationCache
from .recompute import apply_recompute, check_recompute

from ..schema.choices import ACTIVATION_CACHES


def check_activation_cache(activation_cache: str) -> None:
    if activation_cache not in ACTIVATION_CACHES:
        raise ValueError(f"activation_cache must be one of {ACTIVATION_CACHES}, got "
                         f"{activation_cache!r}")


def apply_activation_cache(model: nn.Module, activation_cache: str, block_size: int = 128) -> None:
    """Run every Transformer layer inside one :class:`Int8ActivationCache` (``"int8"``)."""
    check_activation_cache(activation_cache)
    if activation_cache == "none":
        return
    cache = Int8ActivationCache(block_size=block_size)
    for layer in transformer_layers(model):  # (a region's collectives stay outside the cache)
        wrap_own_forward(layer, functools.partial(_inside, cache))
    model.activation_cache = cache  # its .stats count what it quantised


def _inside(cache, forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with cache:
            return forward(*args, **kwargs)

    return run


def apply_memory_options(model: nn.Module, *, recompute: str = "none",
                         activation_cache: str = "none") -> None:
    """Recompute first, then the cache around it: with ``full`` recompute the cache then stores
    each layer's checkpointed input as int8."""
    check_memory_options(recompute, activation_cache)
    apply_recompute(model, recompute)
    apply_activation_cache(model, activation_cache)


def check_memory_options(recompute: str, activation_cache: str) -> None:
    check_recompute(recompute)
    check_activation_cache(activation_cache)
