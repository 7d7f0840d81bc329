"""What runs in which dtype: the precision policy behind ``train --precision {fp32,bf16,fp16}``.

Parameters stay float32 — they are the master weights the optimizer updates — and the forward
pass runs under ``torch.autocast`` in the compute dtype: matrix products (linear layers, attention)
take 16-bit inputs and produce 16-bit outputs, so the tensor-parallel activations and their
collectives (the all-reduces of ``b·s·h`` activations and of their gradients, the all-gathers of
strategy B) run in 16 bits, while reductions such as normalisation statistics, softmax and the loss
stay in float32. This is PyTorch's automatic mixed precision, the scheme torchtitan uses for
tensor and data parallelism without FSDP; Megatron-LM instead keeps 16-bit parameters with float32
master copies in its optimizer — the same arithmetic with a different memory layout.

Gradients of float32 parameters are float32, so the data-parallel averaging and the sums of
replicated parameters' gradients run in float32 (``grad_reduce_dtype``); a model whose parameters
are themselves 16-bit gets its gradients cast to ``grad_reduce_dtype`` (float32 unless given) for
those reductions (see :func:`resolve_grad_reduce_dtype`).

fp16 has 5 exponent bits: gradients below 2⁻²⁴ flush to zero, so its loss is multiplied by a
dynamic scale (:class:`~ops_transformer.precision.DynamicLossScaler`, Micikevicius et al. 2018)
and the gradients divided by it before the optimizer step. bf16 has float32's exponent range and
needs no scaling.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..schema.choices import PRECISIONS
from ..schema.parallel_options import check_grad_reduce_dtype  # with the options it checks
# fp8: the blocks' matmuls in fp8 (parallelize's precision="fp8"), everything else in fp32
_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
            "fp8": torch.float32}
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PrecisionPolicy:
    """``name`` (``fp32``, ``bf16``, ``fp16``); ``compute_dtype`` of matrix products and TP
    activations; ``param_dtype`` of the (master) parameters; ``grad_reduce_dtype`` of gradient
    reductions; ``loss_scaling``: whether the loss needs a dynamic scale (fp16 only)."""

    name: str
    compute_dtype: torch.dtype
    param_dtype: torch.dtype = torch.float32
    grad_reduce_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False

    def autocast(self, device: torch.device | str = "cpu"):
        """The context the forward pass runs in: ``torch.autocast`` in ``compute_dtype``, or
        nothing for fp32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.compute_dtype)


def precision_policy(name: str) -> PrecisionPolicy:
    """The policy of ``--precision name``: fp32, bf16 (no loss scaling), fp16 (loss scaling) or
    fp8 (fp32 outside the blocks' fp8 matmuls)."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {name!r}")
    return PrecisionPolicy(name, _COMPUTE[name], loss_scaling=name == "fp16")


def resolve_grad_reduce_dtype(model: nn.Module,
                              grad_reduce_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype gradient reductions run in: ``grad_reduce_dtype`` when given; float32 when any
    floating-point parameter is 16-bit (its gradient is too); otherwise ``None`` — each gradient
    in its own dtype."""
    if grad_reduce_dtype is not None:
        check_grad_reduce_dtype(grad_reduce_dtype)
        return grad_reduce_dtype
    if any(p.dtype in _SIXTEEN_BIT for p in model.parameters()):
        return torch.float32
    return None
