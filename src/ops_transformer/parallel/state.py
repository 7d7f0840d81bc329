"""What a parallelised model carries: ``model.parallel_state``.

:func:`~ops_transformer.parallelize` leaves one attribute on the model, a :class:`ParallelState`:
the plan it applied, the options it ran with, and the ordered gradient reducers
(:class:`~.grad_reduce.GradReducers`: data-parallel averaging, then the sums of partial
gradients). ``model.parallel_plan`` is the same plan, kept for readers of the earlier attribute.
ZeRO (:mod:`ops_transformer.memory.zero`) swaps the averaging in this chain for its
reduce-scatter, and :func:`no_sync` pauses every reducer in it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .grad_reduce import BucketedReducer, GradReducers, GradSums


@dataclass
class ParallelState:
    """``plan``: the applied :class:`~ops_transformer.parallelize.Plan` (``None`` for a model
    prepared by hand); ``options``: the :class:`~ops_transformer.parallelize.ParallelOptions`;
    ``reducers``: the gradient reducers, in the order they finish at the end of backward."""

    plan: object = None
    options: object = None
    reducers: GradReducers = field(default_factory=GradReducers)


def parallel_state_of(model: nn.Module, *, create: bool = False) -> ParallelState | None:
    """``model.parallel_state``; with ``create``, a plan-less one is made for a module prepared by
    hand that has none yet."""
    state = getattr(model, "parallel_state", None)
    if state is None and create:
        state = model.parallel_state = ParallelState()
    return state


def add_grad_reducer(model: nn.Module, reducer: BucketedReducer) -> None:
    """Append an end-of-backward gradient reducer to ``model``'s chain (created, plan-less, for a
    module prepared by hand), so that it finishes after those before it and :func:`no_sync`
    pauses it."""
    parallel_state_of(model, create=True).reducers.append(reducer)


def attach_grad_sums(module: nn.Module, *, dtype: torch.dtype | None = None) -> GradSums | None:
    """Sum the marked partial gradients of a module built by hand (``parallelize`` does this for
    the models it prepares); call it after any data-parallel averaging is attached."""
    sums = GradSums.of_module(module, dtype=dtype)
    if sums is not None:
        add_grad_reducer(module, sums)
    return sums


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally inside this context: no data-parallel averaging and no
    end-of-backward sums of partial gradients; the first backward outside it reduces everything
    accumulated."""
    state = parallel_state_of(model)
    reducers = list(state.reducers) if state is not None else []
    previous = [r.enabled for r in reducers]
    for r in reducers:
        r.enabled = False
    try:
        yield
    finally:
        for r, enabled in zip(reducers, previous):
            r.enabled = enabled
