"""What every module computes during one forward and backward: the record a parity check compares.

:class:`Recorder` hooks every module of a model. While :meth:`Recorder.recording` is open (one
forward), each module call becomes a :class:`Call` — in the order the calls **finish** their forward,
so a module comes after everything it contains — holding detached copies of its floating-point
inputs and outputs; in the backward that follows, each output's gradient is added as it arrives.
A call also notes which earlier calls produced its inputs (by tensor identity), so that a gradient
that goes wrong can be traced to the module whose backward made it.

Outside the window (later steps, the replays of activation recompute in backward) the hooks do
nothing. The recorder also keeps the stack of modules running, so that an exception raised in the
middle of a forward names the innermost module it came from (:attr:`Recorder.running`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

ROOT = "(model)"  # the name of the whole model in the record


def floating_tensors(obj, path: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every floating-point tensor in a nested output (tuples, lists,
    dicts, Hugging Face ``ModelOutput``); ``path`` joins the indices and keys (``"0"``,
    ``"logits"``)."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)] if obj.is_floating_point() else []
    if depth > 4:
        return []
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (tuple, list)) else ()
    found = []
    for key, value in items:
        found += floating_tensors(value, f"{path}.{key}" if path else str(key), depth + 1)
    return found


@dataclass
class Call:
    """One call of one module: its name, the how-many-th call of it this is, and detached copies
    of what went in and came out (``paths`` say where each output sat), and the gradients of
    the outputs by path."""

    name: str
    index: int
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # by output path
    producers: list[int] = field(default_factory=list)  # finish numbers of the calls it read
    finish: int = -1
    grad_arrival: int | None = None  # order in which the first output gradient arrived

    @property
    def key(self) -> str:
        return self.name if self.index == 0 else f"{self.name}#{self.index + 1}"


class Recorder:
    """Hooks on every module of ``model``; ``keep=False`` only tracks the running stack (ranks
    whose records are not compared)."""

    def __init__(self, model: nn.Module, *, keep: bool = True):
        self.keep, self.active = keep, False
        self.calls: list[Call] = []  # finished calls, in finish order
        self.running: list[tuple[str, Call]] = []
        self._counts: dict[str, int] = {}
        self._producer: dict[int, tuple[weakref.ref, int]] = {}
        self._grad_arrivals = 0
        self.last_gradient: str | None = None  # the call whose output gradient arrived last
        self._handles = []
        for name, module in model.named_modules():
            name = name or ROOT
            self._handles.append(module.register_forward_pre_hook(
                self._pre(name), prepend=True, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_raw(name),
                                                              prepend=True))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def recording(self, enabled: bool = True):
        """Record the calls of the forward run inside (and the gradients of its backward)."""
        if enabled:  # a new record
            self.calls, self.running, self._counts = [], [], {}
        self.active = enabled
        try:
            yield self
        finally:
            self.active = False
            self._producer.clear()

    @property
    def innermost(self) -> str | None:
        """The innermost module still running (after an exception: the one that raised)."""
        return self.running[-1][0] if self.running else None

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if not self.active:
                return None
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            call = Call(name, index)
            if self.keep:
                for _, t in floating_tensors((args, kwargs)):
                    call.inputs.append(t.detach().clone())
                    found = self._producer.get(id(t))
                    if found is not None and found[0]() is t:
                        call.producers.append(found[1])
            self.running.append((name, call))
            return None

        return hook

    def _post_raw(self, name: str):
        """Before the plan's own forward hooks: the gradients are taken of the module's raw
        output, which — unlike a hooked one (``mla_kv_a`` wraps part of it in a region whose
        backward all-reduce runs after) — holds the whole gradient."""
        def hook(module, args, output):
            call = self._current(name)
            if call is None or not self.keep:
                return None
            for path, t in floating_tensors(output):
                if t.requires_grad:
                    t.register_hook(self._grad_hook(call, path))
            return None

        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            call = self._current(name)
            if call is None:
                return None
            position = next(i for i in range(len(self.running) - 1, -1, -1)
                            if self.running[i][1] is call)
            del self.running[position:]  # and calls that raised inside, caught by the model
            call.finish = len(self.calls)
            self.calls.append(call)
            if self.keep:
                for path, t in floating_tensors(output):
                    call.paths.append(path)
                    call.outputs.append(t.detach().clone())
                    self._producer[id(t)] = (weakref.ref(t), call.finish)
            return None

        return hook

    def _current(self, name: str) -> Call | None:
        """The innermost running call of module ``name`` (while recording)."""
        if not self.active:
            return None
        return next((c for n, c in reversed(self.running) if n == name), None)

    def _grad_hook(self, call: Call, path: str):
        def hook(grad):
            call.grads.setdefault(path, grad.detach().clone())
            if call.grad_arrival is None:
                call.grad_arrival = self._grad_arrivals
                self._grad_arrivals += 1
            self.last_gradient = call.name
            return None

        return hook
