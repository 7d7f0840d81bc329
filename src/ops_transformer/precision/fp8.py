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

The backward (``backward=``, :data:`BACKWARDS`):

* ``"e5m2"`` (the default, as torchao's tensorwise recipe: ``torchao.float8.Float8LinearConfig``
  casts ``grad_output`` to ``float8_e5m2`` for both backward matmuls): the output gradient ``G``
  cast to e5m2 with its own tensorwise scale ``57344 / amax(|G|)`` (57344: e5m2's largest
  value; 2 mantissa bits, 5 exponent bits for the gradients' range), then
  ``∂L/∂x = Q₅(G) · Q(W)`` and ``∂L/∂W = Q₅(G)ᵀ · Q(x)`` by ``torch._scaled_mm`` from the saved
  e4m3 operands. Where ``G`` is split over the TP group (a column-parallel output: each rank
  holds its columns) its amax is all-reduced (MAX) over that group too (``fp8.grad_amax``), so
  every rank scales by the dense gradient's amax.
* ``"fp32"``: fp32 products with the dequantised saved operands, ``∂L/∂x = G · Q(W)``,
  ``∂L/∂W = Gᵀ · Q(x)`` (the cast taken as the identity: straight-through).

``train --precision fp8`` swaps the Transformer blocks' linear layers for the fp8 ones of
:mod:`ops_transformer.layers.fp8_linear`.

Under sequence parallelism (:func:`gather_tokens_fp8`) a region's entry all-gathers the tokens
as e4m3 bytes: each rank casts its share by the dense tensor's scale (its amax all-reduced MAX,
one fp32 scalar) and the all-gather moves 1-byte values; the scale is the same on every rank, so
only the values travel. The gathered e4m3 tensor and its scale ride with the dequantised tokens
(the tensor attribute ``fp8_cast``) into the region's fp8 column layers, which multiply them as
they are: the operands the dense fp8 model computes. Backward: the reduce-scatter of the fp32
input gradient (straight-through), as without fp8.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..comm.primitives import all_gather_along, reduce_scatter_along
from ..schema.choices import FP8_BACKWARDS as BACKWARDS  # the vocabulary, defined once

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_GRAD = torch.float8_e5m2  # the gradients' format (backward="e5m2")
FP8_GRAD_MAX = torch.finfo(FP8_GRAD).max  # 57344
_EPS = 1e-12  # the amax of an all-zero tensor: any scale is exact, keep it finite


def tp_amax(t: torch.Tensor, group: C.ProcessGroup | None = None,
            label: str = "fp8.amax") -> torch.Tensor:
    """``max |t|`` in fp32, all-reduced with MAX over ``group`` (``None``: this rank's tensor
    is the whole tensor): the amax of the dense tensor that ``t`` is a shard of."""
    amax = t.detach().abs().amax().float().clamp_min(_EPS).reshape(1)
    C.all_reduce(amax, group, op=C.ReduceOp.MAX, label=label)
    return amax


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """The tensorwise scale that maps ``amax`` to the largest value of ``dtype`` (e4m3: 448)."""
    return (torch.finfo(dtype).max / amax).float()


def to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """``t · scale`` saturated to the range of ``dtype`` (e4m3 unless told) and cast to it."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out column-major (``_scaled_mm``'s second operand on a GPU)."""
    return t.t().contiguous().t()


def check_backward(backward: str) -> str:
    if backward not in BACKWARDS:
        raise ValueError(f"fp8_backward must be one of {BACKWARDS} (e5m2: the gradients cast to "
                         f"float8_e5m2, torchao's recipe; fp32: straight-through fp32), got "
                         f"{backward!r}")
    return backward


class _Fp8Matmul(torch.autograd.Function):
    """Forward: ``Q(x) Q(W)ᵀ`` by ``torch._scaled_mm`` (fp32 out). Backward: ``backward="e5m2"``
    — the output gradient in e5m2 (its amax all-reduced over ``grad_group``, the group the
    output is split over), both products by ``torch._scaled_mm``; ``"fp32"`` — fp32 products with
    the dequantised operands. No other communication: the caller's regions reduce."""

    @staticmethod
    def forward(ctx, x2d, weight, scale_x, scale_w, out_dtype, backward, grad_group, x8=None):
        # x8: x2d already cast (a gathered fp8 input, gather_tokens_fp8)
        x8 = to_fp8(x2d, scale_x) if x8 is None else x8
        w8 = to_fp8(weight, scale_w)
        inv_x, inv_w = scale_x.reciprocal().squeeze(), scale_w.reciprocal().squeeze()
        ctx.save_for_backward(x8, w8, inv_x, inv_w)
        ctx.dtypes, ctx.backward, ctx.grad_group = (x2d.dtype, weight.dtype), backward, grad_group
        return torch._scaled_mm(x8, w8.t(), scale_a=inv_x, scale_b=inv_w, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x8, w8, inv_x, inv_w = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        if ctx.backward == "e5m2":
            grad_x, grad_w = _e5m2_grads(grad_y, x8, w8, inv_x, inv_w, ctx.grad_group,
                                         want_x, want_w)
        else:  # fp32 straight-through
            grad_y = grad_y.float()
            grad_x = grad_y @ (w8.float() * inv_w) if want_x else None
            grad_w = grad_y.t() @ (x8.float() * inv_x) if want_w else None
        return (None if grad_x is None else grad_x.to(ctx.dtypes[0]),
                None if grad_w is None else grad_w.to(ctx.dtypes[1]), None, None, None, None, None,
                None)


def _e5m2_grads(grad_y, x8, w8, inv_x, inv_w, group, want_x: bool, want_w: bool):
    """``(Q₅(G) Q(W), Q₅(G)ᵀ Q(x))`` in fp32, ``G`` cast to e5m2 by the dense gradient's amax."""
    scale_g = fp8_scale(tp_amax(grad_y, group, label="fp8.grad_amax"), FP8_GRAD)
    g8, inv_g = to_fp8(grad_y, scale_g, FP8_GRAD), scale_g.reciprocal().squeeze()
    grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=inv_g, scale_b=inv_w,
                              out_dtype=torch.float32) if want_x else None
    grad_w = torch._scaled_mm(g8.t().contiguous(), _column_major(x8), scale_a=inv_g,
                              scale_b=inv_x, out_dtype=torch.float32) if want_w else None
    return grad_x, grad_w


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               weight_group: C.ProcessGroup | None = None,
               input_group: C.ProcessGroup | None = None,
               grad_group: C.ProcessGroup | None = None, backward: str = "e5m2",
               out_dtype: torch.dtype = torch.float32, return_scales: bool = False):
    """``F.linear(x, weight, bias)`` as an fp8 matmul (differentiable: :class:`_Fp8Matmul`):
    ``x`` and ``weight`` each scaled by its dense tensor's amax — ``weight_group`` is the group
    ``weight`` is split over (a column- or row-parallel weight's TP group), ``input_group`` the
    group ``x`` is split over (a row-parallel layer's input), ``grad_group`` the group the output
    (hence its gradient) is split over (a column-parallel layer's), ``None`` where the tensor is
    whole on this rank. ``backward``: ``"e5m2"`` or ``"fp32"`` (:data:`BACKWARDS`).
    ``return_scales``: also ``(scale_x, scale_w)``. An ``x`` from :func:`gather_tokens_fp8`
    brings its e4m3 values and scale (``x.fp8_cast``): they are used as they are."""
    check_backward(backward)
    x8, scale_x = getattr(x, "fp8_cast", (None, None))
    if x8 is None:
        scale_x = fp8_scale(tp_amax(x, input_group))
    scale_w = fp8_scale(tp_amax(weight, weight_group))
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scale_x, scale_w, out_dtype,
                         backward, grad_group, x8)
    if bias is not None:
        y = y + bias.to(out_dtype)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return (y, (scale_x, scale_w)) if return_scales else y


class _GatherTokensFp8(torch.autograd.Function):
    """Forward: this rank's tokens cast to e4m3 by the dense scale, all-gathered as bytes;
    returns the dequantised tokens and the gathered e4m3 tensor. Backward: reduce-scatter of the
    tokens' gradient (fp32, straight-through through the cast)."""

    @staticmethod
    def forward(ctx, x_share, group, scale):
        x8 = to_fp8(x_share, scale)
        full8 = all_gather_along(x8.view(torch.uint8), group, 0, label="fp8.gather").view(FP8)
        ctx.group = group
        ctx.mark_non_differentiable(full8)
        return full8.float() * scale.reciprocal(), full8

    @staticmethod
    def backward(ctx, grad_full, _grad_full8):
        return reduce_scatter_along(grad_full.contiguous(), ctx.group, 0), None, None


def gather_tokens_fp8(x_share: torch.Tensor, group: C.ProcessGroup) -> torch.Tensor:
    """Sequence parallelism's region entry in fp8: ``x_share`` ``(b, s/t, h)`` (this rank's
    tokens) → the ``(b, s, h)`` gathered tokens, dequantised, carrying ``fp8_cast = (e4m3 tokens
    (b·s, h), scale)`` for the fp8 layers that read them. One all-reduce (MAX) of one fp32 scalar
    (``fp8.amax``) and one all-gather of ``b·s·h`` bytes (``fp8.gather.fwd``); backward one
    reduce-scatter (fp32)."""
    t = C.group_size(group)
    scale = fp8_scale(tp_amax(x_share, group))
    full, full8 = _GatherTokensFp8.apply(x_share.reshape(-1, x_share.shape[-1]), group, scale)
    full = full.view(x_share.shape[0], x_share.shape[1] * t, *x_share.shape[2:])
    full.fp8_cast = (full8, scale)
    return full
