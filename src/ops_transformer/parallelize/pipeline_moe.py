"""MoE layers inside pipeline stages: each stage adds its layers' load-balancing loss to the
step's objective, and reports their statistics, per micro-batch.

Like Megatron-LM and torchtitan, a pipelined MoE routes every micro-batch by itself: its
capacity and its load-balancing loss are over the micro-batch's tokens, so the reference is one
device running the same micro-batches (``train --grad-accum m``), not one pass over the batch.
One device's objective of micro-batch ``i`` is ``(CE_i + c · Σ_layers aux_i) / (n·m)``. Under
pipelining the ``CE_i`` term lives on the last stage while each ``aux_i`` lives on the stage
holding its layer, so a stage hands its aux term to the backward through :class:`AddAuxLoss`:
the identity on the stage's output in forward; in backward it passes the output's gradient on
and gives the aux loss the gradient ``c · scale / (n·m)`` — exactly what ``loss.backward()`` of
the one-device objective gives it. No communication: the term stays on its stage.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..models.moe import moe_aux_loss, moe_stat_tensors


class AddAuxLoss(torch.autograd.Function):
    """``y = x`` in forward; in backward ``dx = dy`` and ``d aux = weight``: the stage's output
    carries its aux loss ``weight · aux`` into the objective without changing the activation
    sent on. No collective in either direction."""

    @staticmethod
    def forward(ctx, x, aux, weight: float):
        ctx.weight, ctx.aux_shape = weight, aux.shape
        return x.clone()  # not a view: zero-bubble's split backward detaches outputs in place

    @staticmethod
    def backward(ctx, grad):
        d_aux = torch.full(ctx.aux_shape, ctx.weight, dtype=torch.float32, device=grad.device)
        return grad, d_aux, None


class StageAux:
    """One stage's MoE bookkeeping for a step: ``weight`` (``c · scale / (n·m)``, set by
    ``Pipeline.step``) and the per-micro-batch statistics of its layers (load-balancing loss
    before the coefficient, dropped and routed token-slots), summed over its forwards."""

    def __init__(self, coef: float):
        self.coef, self.weight = coef, 0.0
        self.totals: torch.Tensor | None = None  # (aux, dropped, slots) summed over forwards
        self.forwards = 0
        self.active = False  # inside a schedule's forward of a micro-batch (counting)

    @contextlib.contextmanager
    def counting(self):
        """Record the statistics of the forwards inside (``RecordedStage.forward_one_chunk``):
        pipelining's one-time shape inference also runs the stage's forward, outside it."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def begin(self, weight: float) -> None:
        self.weight, self.totals, self.forwards = weight, None, 0

    def add(self, stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the aux loss of ``stage``'s last forward in its backward; the statistics
        recorded. Outside :meth:`counting` (shape inference), or in a stage without an MoE layer,
        ``x`` itself."""
        stats = moe_stat_tensors(stage)
        if stats is None or not self.active:
            return x
        row = torch.stack([stats["aux_loss"], stats["dropped"].double(),
                           torch.tensor(float(stats["slots"]), dtype=torch.float64,
                                        device=stats["aux_loss"].device)])
        self.totals = row if self.totals is None else self.totals + row
        self.forwards += 1
        aux = moe_aux_loss(stage)
        if not torch.is_grad_enabled() or not aux.requires_grad:
            return x
        return AddAuxLoss.apply(x, aux.float(), self.weight)

    def metrics(self, micro_batches: int) -> dict:
        """The stage's statistics as one device's ``_moe_metrics`` means over ``micro_batches``
        (its layers only): ``moe_aux_loss``, ``moe_dropped``, ``moe_slots``."""
        if self.totals is None:
            zero = torch.zeros((), dtype=torch.float64)
            return {"moe_aux_loss": zero, "moe_dropped": zero, "moe_slots": zero}
        aux, dropped, slots = (self.totals / micro_batches).unbind()
        return {"moe_aux_loss": aux, "moe_dropped": dropped, "moe_slots": slots}
