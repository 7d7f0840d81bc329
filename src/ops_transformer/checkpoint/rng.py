"""Random-number-generator states of one process: torch (CPU and every CUDA device), Python's
``random`` and, when the process uses it, NumPy's global generator. Plain tensors, tuples and lists
only, so they load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import random
import sys

import torch


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss,
                                cached))
