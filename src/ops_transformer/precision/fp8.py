"""FP8 matmuls with tensorwise dynamic scaling that every tensor-parallel rank agrees on (SPEC F20).

A tensor ``t`` is cast to ``float8_e4m3fn`` as ``t · s`` with one scale per tensor,
``s = 448 / amax(|t|)`` (448: e4m3's largest finite value), and the product of two such tensors
is ``torch._scaled_mm(a8, b8, 1/s_a, 1/s_b)`` (which runs on a CPU too), accumulated and returned
in a higher precision. The scale is *dynamic*: taken from the tensor of this step, not from a
history (torchao's "tensorwise dynamic" recipe).

Under tensor parallelism a rank holds only part of a split tensor (a column-parallel weight's
rows); its own amax would give each rank a different scale, and the product would differ from
the dense model's. :func:`tp_amax` all-reduces the amax with MAX over the tensor's TP group
(one scalar per tensor and step, recorded in the ledger as ``fp8.amax``), so every rank scales
by the dense tensor's amax: a column-parallel fp8 output is then the same columns of the tp 1
fp8 output (bit for bit where the CPU kernel's blocking of the output columns agrees; tested).

The backward runs in fp32 from the saved fp8 operands (dequantised): ``∂L/∂x = ∂L/∂y · Q(W)``,
``∂L/∂W = ∂L/∂yᵀ · Q(x)`` — the gradient of the product the forward computed, with the cast
taken as the identity (straight-through). ``train --precision fp8`` swaps the Transformer blocks'
linear layers for the fp8 ones of :mod:`ops_transformer.layers.fp8_linear`.

Not done yet: fp8 gathers under sequence parallelism, the backward in fp8 (e5m2 gradients), the
cost model's fp8 bytes.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_EPS = 1e-12  # the amax of an all-zero tensor: any scale is exact, keep it finite


def tp_amax(t: torch.Tensor, group: C.ProcessGroup | None = None) -> torch.Tensor:
    """``max |t|`` in fp32, all-reduced with MAX over ``group`` (``None``: this rank's tensor
    is the whole tensor): the amax of the dense tensor that ``t`` is a shard of."""
    amax = t.detach().abs().amax().float().clamp_min(_EPS).reshape(1)
    C.all_reduce(amax, group, op=C.ReduceOp.MAX, label="fp8.amax")
    return amax


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The tensorwise scale that maps ``amax`` to e4m3's largest value."""
    return (FP8_MAX / amax).float()


def to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t · scale`` saturated to e4m3's range and cast to ``float8_e4m3fn``."""
    return (t.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class _Fp8Matmul(torch.autograd.Function):
    """Forward: ``Q(x) Q(W)ᵀ`` by ``torch._scaled_mm`` (fp32 out). Backward: fp32 products with
    the dequantised operands (no communication: the caller's regions reduce)."""

    @staticmethod
    def forward(ctx, x2d, weight, scale_x, scale_w, out_dtype):
        x8, w8 = to_fp8(x2d, scale_x), to_fp8(weight, scale_w)
        inv_x, inv_w = scale_x.reciprocal().squeeze(), scale_w.reciprocal().squeeze()
        ctx.save_for_backward(x8, w8, inv_x, inv_w)
        ctx.dtypes = (x2d.dtype, weight.dtype)
        return torch._scaled_mm(x8, w8.t(), scale_a=inv_x, scale_b=inv_w, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x8, w8, inv_x, inv_w = ctx.saved_tensors
        grad_y = grad_y.float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_y @ (w8.float() * inv_w)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y.t() @ (x8.float() * inv_x)).to(ctx.dtypes[1])
        return grad_x, grad_w, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               weight_group: C.ProcessGroup | None = None,
               input_group: C.ProcessGroup | None = None,
               out_dtype: torch.dtype = torch.float32, return_scales: bool = False):
    """``F.linear(x, weight, bias)`` as an fp8 matmul (differentiable: :class:`_Fp8Matmul`): ``x`` and ``weight`` each scaled by its dense tensor's amax — ``weight_group`` is
    the group ``weight`` is split over (a column- or row-parallel weight's TP group),
    ``input_group`` the group ``x`` is split over (a row-parallel layer's input), ``None`` where
    the tensor is whole on this rank. ``return_scales``: also ``(scale_x, scale_w)``."""
    scale_x, scale_w = fp8_scale(tp_amax(x, input_group)), fp8_scale(tp_amax(weight, weight_group))
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scale_x, scale_w, out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return (y, (scale_x, scale_w)) if return_scales else y
