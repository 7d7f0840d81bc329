"""One way to give a module a behaviour in place: :func:`mix_into`.

A region (:mod:`.regions`), a LoRA adapter (:mod:`.lora`), a fed column (:mod:`.overlap_regions`)
and global MoE statistics (:mod:`.moe_stats`) each turn a module into a small subclass of its own
class with a mixin first (as FSDP2's ``fully_shard`` does): names, parameters, state-dict keys and
``isinstance`` stay, ``print(model)`` shows the new class name. The subclass is made once per
(mixin, class) pair.
"""

from __future__ import annotations

from torch import nn

_CLASSES: dict[tuple[type, type], type] = {}


def mix_into(module: nn.Module, mixin: type, name: str, **settings) -> nn.Module:
    """Turn ``module`` (in place) into ``(mixin, type(module))``'s subclass, named ``name`` with
    ``{}`` standing for the module's class name (``"LoRA[{}]"``), with ``settings`` as attributes;
    returns it."""
    module.__class__ = mixed_class(mixin, type(module), name)
    for key, value in settings.items():
        setattr(module, key, value)
    return module


def mixed_class(mixin: type, base: type, name: str) -> type:
    """The subclass ``(mixin, base)`` (made once), named ``name.format(base.__name__)``."""
    sub = _CLASSES.get((mixin, base))
    if sub is None:
        sub = type(name.format(base.__name__), (mixin, base), {"__module__": mixin.__module__})
        _CLASSES[(mixin, base)] = sub
    return sub


def mixed_parts(cls: type) -> tuple[type, type] | None:
    """``(mixin, base)`` of a class :func:`mix_into` made; ``None`` for any other class."""
    return next((pair for pair, sub in _CLASSES.items() if sub is cls), None)
