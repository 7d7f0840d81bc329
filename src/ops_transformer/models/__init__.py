"""Reference models: plain single-device PyTorch with no knowledge of parallelism.

The names below are imported from their modules when first used (PEP 562), so that
``models.config`` (``GPTConfig``, ``PRESETS``: torch-free) imports without the models."""

from __future__ import annotations

import importlib

EXPORTS = {"GPT": "gpt", "GPTConfig": "config", "PRESETS": "config", "preset": "config",
           "MoE": "moe", "Router": "moe", "moe_stats": "moe"}
__all__ = list(EXPORTS)


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(EXPORTS))
