"""Which device a test run uses, and the checks that hold every tensor to it.

The test suite runs on the CPU by default; ``OT_TEST_DEVICE=cuda`` (or ``pytest --ot-device cuda``)
runs the single-process tests with CUDA as the default device and the multi-rank ones on NCCL, one
rank per GPU (``tests/conftest.py`` reads the setting; this module holds what it and the tests
share, so that spawned ranks can import it).

:class:`DeviceCheck` stands in for a GPU on a machine without one: inside it, every module's
parameters, buffers and tensor inputs, and every tensor handed to a ``torch.distributed``
collective, must live on one expected device (e.g. ``meta``, a device other than the CPU default),
or it raises :class:`WrongDevice` naming the module or collective and both devices. With
``fake_collectives=True`` the collectives only check and record (they move no data), so a
``meta`` run of a multi-rank model needs no communication.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook

__all__ = ["DeviceCheck", "WrongDevice", "cuda_skip_reason", "on_device", "COLLECTIVES"]

# ``isend``/``irecv`` are checked through ``batch_isend_irecv`` (how the library posts them):
# ``P2POp`` accepts the original functions only.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "all_to_all_single", "all_to_all", "broadcast",
               "batch_isend_irecv", "reduce", "gather", "scatter")


class WrongDevice(AssertionError):
    """A tensor met a module or a collective on a device other than the expected one."""


def cuda_skip_reason(mode: str, visible: int, needed: int = 1) -> str | None:
    """Why a CUDA variant cannot run in a test run of ``mode`` (``"cpu"``/``"cuda"``) with
    ``visible`` GPUs, needing ``needed`` of them; ``None`` when it can."""
    if visible == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"CUDA variant: no CUDA device is visible (torch {torch.__version__}, {build}); "
                f"on a GPU machine OT_TEST_DEVICE=cuda runs it")
    if mode != "cuda":
        return (f"CUDA variant: this run is on the CPU (OT_TEST_DEVICE={mode}); "
                f"OT_TEST_DEVICE=cuda runs it on the {visible} visible GPU(s)")
    if visible < needed:
        return (f"CUDA variant: needs {needed} GPUs (one rank per GPU on NCCL), "
                f"{visible} visible")
    return None


def on_device(fn, device_type: str, *args, **kwargs):
    """Run ``fn`` on a local rank with ``device_type`` as the default device: under ``cuda``
    the rank takes GPU ``LOCAL_RANK`` first (what ``init_parallel`` does on NCCL)."""
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    with torch.device(device_type):
        return fn(*args, **kwargs)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, dist.P2POp):
        yield value.tensor


class _DoneWork:
    """What a faked async collective returns: already complete."""

    def wait(self, *_, **__):
        return True

    def is_completed(self):
        return True


class DeviceCheck:
    """Hold every module and collective tensor to ``device`` while the ``with`` block runs.

    ``seen`` counts the tensors checked, by kind (``parameter``, ``buffer``, ``input``,
    ``collective``), and ``collectives`` lists ``(name, device)`` of each collective call, so a
    test can also assert that the check saw what it should.
    """

    def __init__(self, device, fake_collectives: bool = False):
        self.device = torch.device(device)
        self.fake = fake_collectives
        self.seen = {"parameter": 0, "buffer": 0, "input": 0, "collective": 0}
        self.collectives: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}
        self._hook = None

    def _same(self, t: torch.Tensor) -> bool:
        if t.device.type != self.device.type:
            return False
        return self.device.index is None or t.device.index == self.device.index

    def _check(self, t: torch.Tensor, kind: str, where: str) -> None:
        self.seen[kind] += 1
        if not self._same(t):
            raise WrongDevice(f"{where}: a {kind} of shape {tuple(t.shape)} is on {t.device}, "
                              f"expected {self.device}")

    def _pre_hook(self, module, inputs):
        name = type(module).__name__
        for pname, p in module.named_parameters(recurse=False):
            self._check(p, "parameter", f"{name}.{pname}")
        for bname, b in module.named_buffers(recurse=False):
            self._check(b, "buffer", f"{name}.{bname}")
        for t in _tensors(inputs):
            self._check(t, "input", f"the input of {name}")

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def checked(*args, **kwargs):
            tensors = list(_tensors(args)) + list(_tensors(kwargs))
            for t in tensors:
                self._check(t, "collective", f"dist.{name}")
            self.collectives.append((name, str(tensors[0].device) if tensors else "-"))
            if not self.fake:
                return original(*args, **kwargs)
            if name == "batch_isend_irecv":
                return [_DoneWork() for _ in args[0]]
            return _DoneWork() if kwargs.get("async_op") else None
        return checked

    def __enter__(self) -> DeviceCheck:
        self._hook = register_module_forward_pre_hook(self._pre_hook)
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc_info) -> None:
        self._hook.remove()
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()
