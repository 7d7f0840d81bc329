"""Watching one step for :func:`~.diagnose.diagnose`: host synchronisations, what each all-reduce
reduces, and what runs between collectives.

:class:`StepWatch` is a context manager around one call of the step. Inside it:

- a ``TorchFunctionMode`` sees every host synchronisation a tensor method makes (``.item()``,
  ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``/``float()``/``int()`` of a tensor, printing
  one) and ``torch.cuda.synchronize``, each attributed to the module whose forward is running
  (forward hooks on every submodule) or to the autograd node running it (backward). Outside the
  model only reads of accelerator tensors count: the optimizer's ``.item()`` on its CPU step
  counters is no synchronisation; nor are the library's CPU-only input checks
  (``check_token_range``, skipped on a GPU). A read the library needs (the dropless MoE's token
  counts, which size its all-to-all) is kept with the reason (:func:`_needed_codes`);
- a :class:`~ops_transformer.comm.CommLedger` of its own sees each collective of the package as
  the ledger records it (one entry per logical collective, whatever algorithm runs it: flat,
  hierarchical or point-to-point), keeps for an all-reduce a fingerprint of its input (shape,
  dtype and two float64 sums; zero tensors have none), with the module or node that issued it;
- a ``TorchDispatchMode`` counts the matrix products between collectives;
- a forward pre-hook on the model keeps the shape of its first input (batch × sequence).

A synchronisation nested in another (``print`` calls ``.item()``) counts once.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.ledger import CommLedger
from ..layers.embedding import check_token_range
from ..layers.moe import ParallelExperts
from ..layers.moe_overlap import gather_counts

SYNC_METHODS = {"item": ".item()", "tolist": ".tolist()", "cpu": ".cpu()", "numpy": ".numpy()",
                "__bool__": "bool(tensor)", "__float__": "float(tensor)", "__int__": "int(tensor)",
                "__index__": "int(tensor)", "__repr__": "printing a tensor",
                "__format__": "printing a tensor"}
GEMMS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm",
         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention_for_cpu_backward", "convolution")
OUTSIDE = "(outside the model)"
BACKWARD = "backward: "  # what autograd's backward issued: "backward: <node>"


def _deliberate_codes() -> frozenset:
    """Library checks that read CPU tensors only (they return early on an accelerator), so on a
    GPU they cost no synchronisation: the token-range check of the embeddings and the loss."""
    return frozenset({check_token_range.__code__})


def _needed_codes() -> dict:
    """Library code whose synchronisation is the price of what it does, with the reason: the
    dropless expert-parallel all-to-all sizes its messages from the per-expert token counts, which
    the host must read (Megatron-Core's dropless MoE reads them the same way)."""
    reason = ("the dropless expert-parallel all-to-all needs the per-expert token counts on the "
              "host to size its messages: one read per MoE layer and step is its price; a "
              "fixed-capacity (padded) all-to-all would avoid it, at the cost of padding or "
              "dropped tokens")
    # the same read, in the chunked dispatch of overlap="chunked"/"auto" (layers/moe_overlap.py)
    return {ParallelExperts._routes.__code__: reason, gather_counts.__code__: reason}


def _caller_in(codes, depth: int = 6):
    """The first of ``codes`` among the callers of the caller's caller (``None``: none)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code in codes:
            return frame.f_code
        frame = frame.f_back
    return None


@dataclass
class Sync:
    what: str
    where: str
    on_device: bool  # the tensor lives on an accelerator (outside the model, only those count)
    needed: str | None = None  # why the library's code that did it cannot avoid it


@dataclass
class Collective:
    """One collective as the ledger records it: its kind, the fingerprint of an all-reduce's input
    (``None`` for a zero tensor or another kind), the module or node that issued it, and the
    matrix products since the previous collective."""

    op: str
    fingerprint: tuple | None
    where: str
    gemms_before: int


@dataclass
class WatchResult:
    syncs: list[Sync] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    input_shape: tuple | None = None
    forwards: int = 0  # calls of the model's forward in the step (gradient accumulation: N)


def fingerprint(t: torch.Tensor) -> tuple | None:
    """Shape, dtype and two float64 sums (plain and position-weighted) of ``t``; ``None`` when it
    is all zeros (a zero gradient is reduced legitimately everywhere)."""
    flat = t.detach().reshape(-1).double()
    if flat.numel() == 0 or not bool(flat.ne(0).any()):
        return None
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).sqrt()
    return (tuple(t.shape), str(t.dtype), float(flat.sum()), float((flat * weights).sum()))


class _Where:
    """The module whose forward is running (a stack kept by hooks), or the autograd node."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            label = name or type(module).__name__
            self.handles.append(module.register_forward_pre_hook(
                lambda m, a, label=label: self.stack.append(label)))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _leave(self, module, args, output) -> None:  # returns None: the output is unchanged
        if self.stack:
            self.stack.pop()

    def __call__(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            return f"{BACKWARD}{node.name()}"
        return self.stack[-1] if self.stack else OUTSIDE

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _SyncMode(TorchFunctionMode):
    def __init__(self, where: _Where, out: list[Sync]):
        super().__init__()
        self.where, self.out, self.depth = where, out, 0
        self.deliberate = _deliberate_codes()
        self.needed = _needed_codes()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = SYNC_METHODS.get(getattr(func, "__name__", ""))
        if what is None or self.depth or _caller_in(self.deliberate):
            return func(*args, **(kwargs or {}))
        device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        self.out.append(Sync(what, self.where(), device,
                             self.needed.get(_caller_in(self.needed))))
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


class _GemmCount(TorchDispatchMode):
    """Counts the matrix products since the last collective."""

    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and getattr(func, "_opname", "") in GEMMS:
            self.gemms += 1
        return func(*args, **(kwargs or {}))


class _CollectiveLedger(CommLedger):
    """A ledger that also notes, for each collective, what :class:`Collective` holds."""

    def __init__(self, where: _Where, out: list[Collective], gemms: _GemmCount, syncs: _SyncMode):
        super().__init__()
        self.where, self.out, self.count, self.syncs = where, out, gemms, syncs

    def add(self, record, tensor) -> None:
        super().add(record, tensor)
        self.syncs.depth += 1  # the fingerprint's own reads are not the step's
        try:
            print_ = fingerprint(tensor) if record.kind == "all_reduce" else None
        finally:
            self.syncs.depth -= 1
        self.out.append(Collective(record.kind, print_, self.where(), self.count.gemms))
        self.count.gemms = 0


@contextlib.contextmanager
def _cuda_synchronize_watched(where: _Where, out: list[Sync]):
    if not torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize

    def watched(*args, **kwargs):
        out.append(Sync("torch.cuda.synchronize()", where(), True))
        return original(*args, **kwargs)

    torch.cuda.synchronize = watched
    try:
        yield
    finally:
        torch.cuda.synchronize = original


class StepWatch:
    """``with StepWatch(model) as result: step_fn()`` (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.result = WatchResult()

    def __enter__(self) -> WatchResult:
        self._where = _Where(self.model)
        self._shape = self.model.register_forward_pre_hook(self._record_shape)
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_cuda_synchronize_watched(self._where, self.result.syncs))
        syncs = _SyncMode(self._where, self.result.syncs)
        gemms = self._stack.enter_context(_GemmCount())
        self._stack.enter_context(_CollectiveLedger(self._where, self.result.collectives, gemms,
                                                    syncs))
        self._stack.enter_context(syncs)
        return self.result

    def _record_shape(self, module, args):
        self.result.forwards += 1
        if self.result.input_shape is None and args and isinstance(args[0], torch.Tensor):
            self.result.input_shape = tuple(args[0].shape)

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._shape.remove()
        self._where.remove()
