"""Gradients of replicated parameters used on sequence slices: one coalesced all-reduce per backward.

Under sequence parallelism a norm's weight (or a row-parallel bias, or the final norm) is the same
on every TP rank but sees only this rank's ``s/t`` tokens, so its gradient is a partial sum.
:class:`SequenceParallelGradSync` completes them:

1. a tensor hook on each such parameter takes the gradient this backward produces for it and
   hands autograd zeros instead (so a partial sum is never accumulated into ``.grad``);
2. at the end of backward (a callback queued on the autograd engine), the captured gradients are
   flattened and summed over the TP group in **one** all-reduce, then added to ``.grad``;
3. when data parallelism is on (and not suspended by :func:`no_sync`), the accumulated ``.grad`` of
   these parameters is averaged over ``dp`` in one more all-reduce — they are kept out of the
   data-parallel buckets, whose all-reduce starts before step 2 could run.

Gradient accumulation stays exact: each backward sums only what it produced.

The seam for a general coalescer of small collectives (``comm/bucketing.py``): both reductions go
through :func:`coalesced_all_reduce` — a list of tensors in, one recorded all-reduce, the reduced
tensors out. Routing them through a shared bucket only means replacing that one function.
"""

from __future__ import annotations

import functools

import torch

from ..comm import collectives as C


def coalesced_all_reduce(tensors: list[torch.Tensor], group, *, label: str,
                         divide_by: int = 1) -> list[torch.Tensor]:
    """Sum ``tensors`` over ``group`` in one all-reduce per dtype (pre-divided by ``divide_by``,
    as data-parallel averaging does); returns new tensors of the same shapes."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        if divide_by != 1:
            flat.div_(divide_by)
        C.all_reduce(flat, group, label=label)
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            out[i] = piece.view_as(tensors[i])
    return out


class SequenceParallelGradSync:
    """Completes the partial gradients of ``params`` over ``tp_group`` (and averages them over
    ``dp_group`` while ``dp_enabled()``) at the end of every backward."""

    def __init__(self, params, tp_group, dp_group=None, *, dp_enabled=lambda: True):
        self.params = list(dict.fromkeys(params))
        self.tp_group, self.dp_group, self.dp_enabled = tp_group, dp_group, dp_enabled
        self._captured: dict[int, torch.Tensor] = {}
        self._queued = False
        self._hooks = [p.register_hook(functools.partial(self._capture, i))
                       for i, p in enumerate(self.params)]

    def _capture(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        previous = self._captured.get(index)
        self._captured[index] = grad if previous is None else previous + grad
        return torch.zeros_like(grad)

    def _finish(self) -> None:
        grads = [self._captured.get(i, torch.zeros_like(p)) for i, p in enumerate(self.params)]
        summed = coalesced_all_reduce(grads, self.tp_group, label="sequence_parallel_grads")
        for p, g in zip(self.params, summed):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.add_(g)
        dp = C.group_size(self.dp_group)
        if dp > 1 and self.dp_enabled():
            averaged = coalesced_all_reduce([p.grad for p in self.params], self.dp_group,
                                            label="sequence_parallel_dp_grads", divide_by=dp)
            for p, g in zip(self.params, averaged):
                p.grad.copy_(g)
        self._captured.clear()
        self._queued = False

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
