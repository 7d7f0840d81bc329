"""What a parallelised model carries: ``model.parallel_state``.

:func:`~ops_transformer.parallelize` leaves one attribute on the model, a :class:`ParallelState`:
the plan it applied, the options it ran with, and the ordered gradient reducers
(:class:`GradReducers`: data-parallel averaging, then the sums of partial gradients; the reducers
themselves are in :mod:`.grad_reduce`). ``model.parallel_plan`` is the same plan, kept for readers
of the earlier attribute. ZeRO (:mod:`ops_transformer.memory.zero`) swaps the averaging in the
chain for its reduce-scatter, and :func:`no_sync` pauses every reducer in it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .grad_reduce import BucketedReducer, GradSums


class GradReducers:
    """A model's reducers in the order they finish; one end-of-backward callback for all."""

    def __init__(self, reducers=()):
        self._reducers: list[BucketedReducer] = []
        self._queued = False
        self._model, self._covered, self._adopt = None, set(), None
        for r in reducers:
            self.append(r)

    def watch(self, model: nn.Module, adopt) -> None:
        """Cover every parameter of ``model`` trainable now; one whose ``requires_grad`` is turned
        on later (a norm unfrozen after ``ot.lora``: PEFT's ``modules_to_save``) is handed, at the
        end of the first backward that gives it a gradient, to ``adopt(params) -> [reducers]``:
        they reduce that gradient at once and join the chain (or ``adopt`` raises, naming it) —
        never left silently local."""
        self._model, self._adopt = weakref.ref(model), adopt
        self._cover()

    def _late(self) -> list:
        model = self._model() if self._model is not None else None
        if model is None:
            return []
        return [p for p in dict.fromkeys(model.parameters())
                if p.requires_grad and p.grad is not None and p not in self._covered]

    def append(self, reducer: BucketedReducer) -> None:
        reducer.chain = self
        self._reducers.append(reducer)

    def get(self, name: str) -> BucketedReducer | None:
        return next((r for r in self._reducers if r.name == name), None)

    def insert(self, at: int, new: list[BucketedReducer]) -> None:
        for r in new:
            r.chain = self
        self._reducers[at:at] = new
        self._cover()  # a preparation step (ZeRO, FSDP2) changed the chain: what trains now

    def _cover(self) -> None:
        model = self._model() if self._model is not None else None
        if model is not None:
            self._covered = {p for p in model.parameters() if p.requires_grad}

    def replace(self, old: BucketedReducer, new: list[BucketedReducer]) -> None:
        """Put ``new`` where ``old`` was (``old``'s hooks are removed)."""
        at = self._reducers.index(old)
        old.remove()
        self._reducers.remove(old)
        self.insert(at, new)

    def replace_averaging(self, new: list[BucketedReducer]) -> None:
        """Put ``new`` (ZeRO-2's or FSDP2's reducers) where the data-parallel averaging was
        (``dp``, and ``dp_experts`` with experts), or first in the chain when there is none
        (dp = 1): the step :func:`~ops_transformer.zero_optimizer` and
        :func:`~ops_transformer.shard_parameters` take on a model prepared without them."""
        old = [r for r in (self.get("dp"), self.get("dp_experts")) if r is not None]
        if not old:
            self.insert(0, new)
            return
        self.replace(old[0], new)
        for extra in old[1:]:
            self.replace(extra, [])

    def __iter__(self):
        return iter(list(self._reducers))

    def __len__(self) -> int:
        return len(self._reducers)

    def schedule(self) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True

    def _finish(self) -> None:
        self._queued = False
        late = self._late()
        for r in list(self._reducers):
            r.finish_backward()
        if late:
            self._covered.update(late)
            for r in self._adopt(late):
                self.append(r)
                r.finish()  # this backward's gradients (and any accumulated under no_sync)

    def __repr__(self) -> str:
        return f"GradReducers({', '.join(repr(r) for r in self._reducers)})"


@dataclass(frozen=True)
class DataSharding:
    """What :func:`~ops_transformer.memory.fsdp.shard_parameters` applied: ``units``, the FSDP2
    modules in the order they were sharded (each layer's experts, each layer, the LM head, the
    root last);
    ``unsharded``, the parameters left whole (their gradients reduced by the chain's own
    reducers); the ``reshard_after_forward`` and ``mixed_precision`` it ran with."""

    units: tuple
    unsharded: tuple
    reshard_after_forward: bool = True
    mixed_precision: object = None


@dataclass
class ParallelState:
    """``plan``: the applied :class:`~ops_transformer.parallelize.Plan` (``None`` for a model
    prepared by hand); ``options``: the :class:`~ops_transformer.parallelize.ParallelOptions`;
    ``reducers``: the gradient reducers, in the order they finish at the end of backward;
    ``sharding``: the parameters' data-parallel sharding (:class:`DataSharding`, ZeRO-3), or
    ``None``; ``zero``: the ZeRO-1/2 buckets (:class:`~ops_transformer.memory.zero.ZeroLayout`),
    or ``None``; ``lora``: the :class:`~ops_transformer.parallelize.lora.LoRAConfig` of the adapters
    :func:`~ops_transformer.lora` added (``None``: none)."""

    plan: object = None
    options: object = None
    reducers: GradReducers = field(default_factory=GradReducers)
    sharding: DataSharding | None = None
    lora: object = None
    zero: object = None  # the ZeroLayout of ZeRO 1/2 (memory.zero): its buckets, its optimizer
    context_parallel: object = None  # the ContextParallelChoice at cp > 1 (strategy, reason)
    pipeline_stages: tuple[int, ...] | None = None  # the stages this rank holds (pp > 1)
    pipeline_modules: tuple = ()  # their modules (GPTStage / HFStage): ZeRO-3's roots under pp


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
