"""Variants of the column- and row-parallel linears for layouts Hugging Face plans use.

* :class:`PaddedColumnParallelLinear` / :class:`PaddedRowParallelLinear`: a feature dimension that
  does not divide by ``tp`` (``intermediate_size=37`` at tp 2) padded with zeros to the next
  multiple, as the vocabulary is. A padded column layer feeding a padded row layer (the
  column→row FFN) computes exactly the dense FFN: the padding rows of the column weight and bias
  are zero, so are the padding columns of the row weight, whatever the activation makes of the
  padding features; their gradients are zeroed in backward (by the layer's forward, not by a
  hook on the parameter) so no optimizer moves them.
* :class:`PackedRowParallelLinear`: the row-parallel dual of a fused (packed) column layer, its
  input features split per sub-block (Hugging Face's ``packed_rowwise``).

Global sizes stay global: ``in_features`` / ``out_features`` are the dense ones; the padded size
is ``*_padded`` and the per-rank size ``*_per_rank``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.sharding import ShardSpec, divide
from .linear import ColumnParallelLinear, RowParallelLinear, _dense_linear, dense_weight


def padded_size(size: int, tp: int) -> int:
    """``size`` rounded up to a multiple of ``tp``."""
    return -(-size // tp) * tp


class _ZeroPaddingGrad(torch.autograd.Function):
    """The identity in forward; in backward the gradient's entries ``start …`` along ``dim`` (this
    rank's padding) are zeroed. Part of the layer's forward rather than a hook on its parameter, so
    it holds for whatever tensor the parameter is (materialised later by ``from_pretrained``, or
    replaced by a sharding wrapper)."""

    @staticmethod
    def forward(ctx, tensor, dim: int, start: int):
        ctx.dim, ctx.start = dim, start
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.narrow(ctx.dim, ctx.start, grad.shape[ctx.dim] - ctx.start).zero_()
        return grad, None, None


def without_padding_grad(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``param``, with a zero gradient on this rank's padding entries along ``spec.split_dim`` (if
    it holds any), so the padding stays zero under any optimizer."""
    start, n = spec.slices()[0]
    real = spec.full_shape[spec.split_dim]
    if start + n <= real:
        return param
    return _ZeroPaddingGrad.apply(param, spec.split_dim, max(real - start, 0))


class PaddedColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` whose ``out_features`` need not divide by ``tp``::

        W (out × in) + zero rows → (⌈out/tp⌉·tp × in), split along the output features

    The last rank(s) hold the padding rows; their outputs are zero before any activation. With
    ``gather_output=True`` the padding columns are sliced off the gathered output. Communication
    as :class:`ColumnParallelLinear` (the all-gather moves the padded width).
    """

    def __init__(self, in_features: int, out_features: int, ctx, *, bias: bool = True,
                 gather_output: bool = False, reduce_input_grad: bool = True, device=None,
                 dtype=None):
        padded = padded_size(out_features, ctx.tp_size)
        super().__init__(in_features, padded, ctx, bias=bias, gather_output=gather_output,
                         reduce_input_grad=reduce_input_grad, device="meta", dtype=dtype)
        self.out_features, self.out_features_padded = out_features, padded
        pad = padded if padded != out_features else None
        self.weight_spec = ShardSpec((out_features, in_features), 0, ctx.tp_rank, ctx.tp_size,
                                     padded_size=pad)
        self.bias_spec = ShardSpec((out_features,), 0, ctx.tp_rank, ctx.tp_size, padded_size=pad)
        self._load_dense(_dense_linear(in_features, out_features, bias, device, dtype))

    @classmethod
    def from_dense(cls, linear: nn.Module, ctx, *, gather_output: bool = False,
                   reduce_input_grad: bool = True) -> PaddedColumnParallelLinear:
        out_features, in_features = dense_weight(linear)[0].shape
        layer = cls(in_features, out_features, ctx, bias=linear.bias is not None,
                    gather_output=gather_output, reduce_input_grad=reduce_input_grad,
                    device="meta", dtype=linear.weight.dtype)
        layer._load_dense(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = without_padding_grad(self.weight, self.weight_spec)
        bias = None if self.bias is None else without_padding_grad(self.bias, self.bias_spec)
        y = self._forward(x, weight, bias)
        return y[..., :self.out_features] if self.gather_output else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", padded_to={self.out_features_padded}"


class PaddedRowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` whose ``in_features`` need not divide by ``tp``::

        W (out × in) + zero columns → (out × ⌈in/tp⌉·tp), split along the input features

    It takes the padded output of a :class:`PaddedColumnParallelLinear` (``input_is_parallel``),
    or the full input, which it pads with zeros before keeping its slice. Communication as
    :class:`RowParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, ctx, *, bias: bool = True,
                 input_is_parallel: bool = True, device=None, dtype=None):
        padded = padded_size(in_features, ctx.tp_size)
        super().__init__(padded, out_features, ctx, bias=bias,
                         input_is_parallel=input_is_parallel, device="meta", dtype=dtype)
        self.in_features, self.in_features_padded = in_features, padded
        self.weight_spec = ShardSpec((out_features, in_features), 1, ctx.tp_rank, ctx.tp_size,
                                     padded_size=padded if padded != in_features else None)
        self._load_dense(_dense_linear(in_features, out_features, bias, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and x.shape[-1] == self.in_features:
            x = F.pad(x, (0, self.in_features_padded - self.in_features))
        return self._forward(x, without_padding_grad(self.weight, self.weight_spec))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", padded_to={self.in_features_padded}"


class PackedRowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` over a packed input ``[a | b | …]`` (``sub_blocks`` sizes)::

        W = [ W_a0 | W_a1 | W_b0 | W_b1 ]  →  rank r holds [ W_ar | W_br ]

    so it consumes the per-rank output of a column layer fused the same way (``sub_blocks``):
    ``[a_r | b_r]``. The input must already be split (``input_is_parallel``). Communication as
    :class:`RowParallelLinear`: forward one all-reduce of the output, backward none.
    """

    def __init__(self, in_features: int, out_features: int, ctx, *,
                 sub_blocks: tuple[int, ...], bias: bool = True, device=None, dtype=None):
        if sum(sub_blocks) != in_features:
            raise ValueError(f"sub_blocks {tuple(sub_blocks)} sum to {sum(sub_blocks)}, expected "
                             f"in_features ({in_features})")
        for i, block in enumerate(sub_blocks):
            divide(block, ctx.tp_size, f"PackedRowParallelLinear: sub-block {i} of in_features")
        super().__init__(in_features, out_features, ctx, bias=bias, device="meta", dtype=dtype)
        self.sub_blocks = tuple(sub_blocks)
        self.weight_spec = ShardSpec((out_features, in_features), 1, ctx.tp_rank, ctx.tp_size,
                                     self.sub_blocks)
        self._load_dense(_dense_linear(in_features, out_features, bias, device, dtype))

    @classmethod
    def from_dense(cls, linear: nn.Module, ctx, *,
                   sub_blocks: tuple[int, ...]) -> PackedRowParallelLinear:
        out_features, in_features = dense_weight(linear)[0].shape
        layer = cls(in_features, out_features, ctx, sub_blocks=sub_blocks,
                    bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype)
        layer._load_dense(linear)
        return layer

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sub_blocks={self.sub_blocks}"
