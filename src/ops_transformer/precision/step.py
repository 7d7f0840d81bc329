"""The optimizer step of a training loop, with every small reduction of the step in one collective.

After ``backward`` a step needs up to three small agreements across ranks: whether any rank's fp16
gradients overflowed (MAX over the job), the dense gradient norm for clipping (a sum of per-rank
shares over the job, :mod:`.clip`), and the metrics to log (the loss averaged over the
data-parallel ranks). Issued one by one they are three latency-bound collectives per step;
:func:`optimizer_step` packs them into **one** all-reduce of a few float32 elements over every rank
of the job (:func:`~ops_transformer.comm.bucketing.all_reduce_coalesced`):

=================== ============================================ ===============================
element             this rank contributes                        after the SUM
=================== ============================================ ===============================
overflow count      1 if one of its gradients is inf/NaN, else 0  > 0 ⇔ MAX of the flags is 1
norm share          ``Σ g²`` of what it owns of the dense model   ``‖g‖²`` of the dense model
each metric         ``value / (dp·ep)`` on TP rank 0, else 0      the mean over data shards
=================== ============================================ ===============================

(the overflow flag travels as a count because one all-reduce has one reduction op: a sum of 0/1
flags is positive exactly when their maximum is 1). With one data shard and neither a loss scaler
nor clipping there is nothing to agree on and nothing is communicated. A ZeRO optimizer
(:func:`~ops_transformer.zero_optimizer`) holds each rank's chunk of the gradients: the overflow
flag, the norm share and the clipping are computed on those chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm.bucketing import all_reduce_coalesced
from .clip import (check_max_norm, clip_grads_with_norm_, grad_norm_partial, params_with_grad,
                   total_norm)
from .loss_scaler import DynamicLossScaler


@dataclass(frozen=True)
class StepReport:
    """What :func:`optimizer_step` did: ``stepped`` (False when an overflow skipped the step),
    ``grad_norm`` (the dense gradient norm before clipping; ``None`` without clipping),
    ``loss_scale`` (the scale this step used; ``None`` without a scaler) and ``metrics`` (each
    averaged over the data-parallel ranks)."""

    stepped: bool
    grad_norm: float | torch.Tensor | None = None
    loss_scale: float | None = None
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)

    def read(self) -> StepReport:
        """This report with its numbers on the host (:func:`read_reports` of one)."""
        return read_reports([self])[0]


def read_reports(reports: list[StepReport]) -> list[StepReport]:
    """``reports`` of ``optimizer_step(..., read=False)`` with every device value (metrics and
    gradient norms) read in **one** host transfer: the one synchronisation of a logging interval
    (torchtitan reads its loss once per ``log_freq`` steps the same way)."""
    tensors = [t for r in reports for t in (r.grad_norm, *r.metrics.values())
               if isinstance(t, torch.Tensor)]
    if not tensors:
        return list(reports)
    values = iter(torch.stack([t.detach().reshape(()).float() for t in tensors]).tolist())

    def host(v):
        return next(values) if isinstance(v, torch.Tensor) else v

    return [StepReport(r.stepped, host(r.grad_norm), r.loss_scale,
                       {k: host(v) for k, v in r.metrics.items()}) for r in reports]


def optimizer_step(model, optimizer, ctx, *, scaler: DynamicLossScaler | None = None,
                   max_norm: float | None = None,
                   metrics: dict[str, torch.Tensor | float] | None = None,
                   read: bool = True) -> StepReport:
    """Unscale (with ``scaler``), agree on overflow, clip to ``max_norm`` (the dense model's
    2-norm) and step ``optimizer`` — or skip it on every rank — with one all-reduce over the job,
    which also averages ``metrics`` (e.g. ``{"loss": loss}``) over the data-parallel ranks. Call it
    after ``backward`` on every rank; then ``optimizer.zero_grad()``. ``read=False``: the
    metrics and the gradient norm stay 0-d device tensors, so the step makes no host
    synchronisation (but the loss scaler's overflow flag, which decides the step); read them
    later, many steps at once, with :func:`read_reports`."""
    if max_norm is not None:
        check_max_norm(max_norm, 2.0)
    metrics = {k: torch.as_tensor(v, dtype=torch.float32, device=ctx.device).detach().reshape(1)
               for k, v in (metrics or {}).items()}  # a Python float too joins the device's buffer
    shards = ctx.world_size // ctx.tp_size  # data shards: dp (× ep)
    values: list[torch.Tensor] = []
    zero = hasattr(optimizer, "gather_grad_shards")  # ZeRO (memory.zero): the gradients that
    if zero:  # unscale_, the norm, clipping and step see are this rank's chunks of them
        optimizer.gather_grad_shards()
    if scaler is not None:
        values.append(scaler.unscale_(optimizer))
    params = []
    if max_norm is not None:
        params = params_with_grad([p for g in optimizer.param_groups for p in g["params"]]
                                  if zero else model)
        values.append(optimizer.grad_norm_partial() if zero else grad_norm_partial(params, ctx))
    if shards > 1:
        weight = 1.0 / shards if ctx.tp_rank == 0 else 0.0
        values += [v * weight for v in metrics.values()]
    reduced = all_reduce_coalesced(values, ctx.world_group, dtype=torch.float32,
                                   label="step_stats") if values else []
    found_inf = bool(reduced.pop(0) > 0) if scaler is not None else False
    norm = None
    if max_norm is not None:
        norm = total_norm(reduced.pop(0))
        if not found_inf:
            clip_grads_with_norm_(params, max_norm, norm)
    averaged = dict(zip(metrics, reduced)) if shards > 1 else dict(metrics)
    averaged = {k: v.detach().reshape(()) for k, v in averaged.items()}
    norm = None if norm is None else norm.detach().reshape(())
    if scaler is None:
        optimizer.step()
        report = StepReport(True, norm, None, averaged)
    else:
        scale = scaler.scale_value
        stepped = scaler.step(optimizer, found_inf=found_inf)
        scaler.update()
        report = StepReport(stepped, norm, scale, averaged)
    return report.read() if read else report
