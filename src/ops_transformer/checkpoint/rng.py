"""Random-number-generator states of one process: torch (CPU, and the rank's own CUDA device),
Python's ``random`` and, when the process uses it, NumPy's global generator. Plain tensors, tuples
and lists only, so they load with ``torch.load(weights_only=True)``.

A rank saves the generator of its device only (``device``, its ``ctx.device``), and restores it to
its current device: a checkpoint saved with one GPU per rank loads where each rank sees another GPU
or fewer GPUs. Checkpoints of earlier versions hold every visible device's state (a list); the
entry of the rank's own device index is used, or none, with a warning, when it is past the list."""

from __future__ import annotations

import random
import sys
import warnings

import torch


def rng_state(device: torch.device | str | None = None) -> dict:
    """This process's generator states; ``device``: the CUDA device whose generator is saved
    (default: the current one, when CUDA is initialised)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    device = _cuda_device(device)
    if device is not None:
        state["cuda"] = torch.cuda.get_rng_state(device)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    return state


def set_rng_state(state: dict, device: torch.device | str | None = None) -> None:
    """Restore ``state``; its CUDA generator goes to ``device`` (default: the current CUDA device,
    when CUDA is initialised)."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    device = _cuda_device(device)
    saved = state.get("cuda")
    if device is not None and saved is not None:
        if isinstance(saved, (list, tuple)):  # every device's state (earlier versions)
            index = device.index or 0
            if index >= len(saved):
                warnings.warn(f"the checkpoint holds CUDA generator states of {len(saved)} "
                              f"device(s), none for {device}: its CUDA generator is not restored",
                              stacklevel=2)
                saved = None
            else:
                saved = saved[index]
        if saved is not None:
            torch.cuda.set_rng_state(saved.cpu(), device)
    elif device is not None:
        warnings.warn(f"the checkpoint holds no CUDA generator state (saved on a CPU): the "
                      f"generator of {device} is not restored, so dropout draws other masks",
                      stacklevel=2)
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss,
                                cached))


def _cuda_device(device) -> torch.device | None:
    """The CUDA device whose generator is meant, or ``None`` (a CPU device, or CUDA unused)."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        return device if device.index is not None else \
            torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None
