"""Where the Transformer layers of a model are, and the memory options applied to them."""

from __future__ import annotations

import functools

from torch import nn

ACTIVATION_CACHES = ("none", "int8")


def is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type")


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated Transformer layers, in order: ``model.layers`` for the reference GPT; the
    decoder (``layers``, ``h``) or encoder (``encoder.layer``) blocks of a Hugging Face model."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) if is_hf(model) else None
    for owner in (model, base):
        if owner is None:
            continue
        for path in ("layers", "h", "encoder.layer"):
            try:
                layers = owner.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(layers, nn.ModuleList) and len(layers):
                return list(layers)
    raise ValueError(f"cannot find the Transformer layers of {type(model).__name__}: expected an "
                     f"nn.ModuleList named layers, h or encoder.layer")


def check_activation_cache(activation_cache: str) -> None:
    if activation_cache not in ACTIVATION_CACHES:
        raise ValueError(f"activation_cache must be one of {ACTIVATION_CACHES}, got "
                         f"{activation_cache!r}")


def apply_activation_cache(model: nn.Module, activation_cache: str, block_size: int = 128) -> None:
    """Run every Transformer layer inside one :class:`Int8ActivationCache` (``"int8"``)."""
    check_activation_cache(activation_cache)
    if activation_cache == "none":
        return
    from .int8_cache import Int8ActivationCache

    cache = Int8ActivationCache(block_size=block_size)
    for layer in transformer_layers(model):
        layer.forward = _inside(cache, layer.forward)
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
    from .recompute import apply_recompute

    check_memory_options(recompute, activation_cache)
    apply_recompute(model, recompute)
    apply_activation_cache(model, activation_cache)


def check_memory_options(recompute: str, activation_cache: str) -> None:
    from .recompute import check_recompute

    check_recompute(recompute)
    check_activation_cache(activation_cache)
