"""The fp8 linear layers of ``--precision fp8`` (SPEC F20): the dense, column- and row-parallel
layers with their matmul in fp8 (:func:`~ops_transformer.precision.fp8.fp8_linear`: tensorwise
dynamic scales, every rank scaling by the dense tensor's amax).

* :class:`Fp8Linear` — ``nn.Linear`` (tp 1, the dense reference).
* :class:`Fp8ColumnParallelLinear` — the weight's amax all-reduced (MAX) over the TP group
  (``fp8.amax``, one fp32 scalar); with the e5m2 backward the amax of the output gradient (split
  by columns) too (``fp8.grad_amax``); the input gradient's all-reduce is ``copy_to_tp_region``.
* :class:`Fp8RowParallelLinear` — the amax of the weight and of the split input all-reduced (MAX);
  the partial outputs summed by ``reduce_from_tp_region``; the bias added after it. Its output
  gradient is whole on every rank: its e5m2 scale needs no collective.

``fp8_backward`` (a layer attribute, set by :func:`convert_to_fp8`): ``"e5m2"`` (default,
torchao's recipe) or ``"fp32"`` (straight-through) — :mod:`ops_transformer.precision.fp8`.

These layers run their collective and their matmul one after the other (no chunked overlap).
:func:`convert_to_fp8` swaps the classes in place (parameters, names and ``state_dict`` stay).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.primitives import copy_to_tp_region, reduce_from_tp_region
from ..precision.fp8 import check_backward, fp8_linear
from .linear import ColumnParallelLinear, RowParallelLinear


def _group(layer):
    return layer.tp_group if layer.tp_size > 1 else None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` with its matmul in fp8 (the whole tensors' scales: no group)."""

    fp8_backward = "e5m2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, backward=self.fp8_backward)


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` whose local matmul is fp8 (weight amax over the TP group)."""

    fp8_backward = "e5m2"

    def entry(self, x: torch.Tensor, weight: torch.Tensor, bias):
        group = _group(self)
        x_same = copy_to_tp_region(x, group) if self.reduce_input_grad else x
        return x_same, fp8_linear(x_same, weight, bias, weight_group=group, grad_group=group,
                                  backward=self.fp8_backward)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8 (amax: all-reduce MAX over tp)"


class Fp8RowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` whose partial matmul is fp8 (weight and input amax over the TP
    group), the partial outputs all-reduced."""

    fp8_backward = "e5m2"

    def exit(self, x_local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        group = _group(self)
        partial = fp8_linear(x_local, weight, weight_group=group, input_group=group,
                             backward=self.fp8_backward)
        return reduce_from_tp_region(partial, group)

    def partial_output(self, x_local, weight, bias=None):
        return fp8_linear(x_local, weight, bias, backward=self.fp8_backward)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8 (amax: all-reduce MAX over tp)"


_FP8 = {nn.Linear: Fp8Linear, ColumnParallelLinear: Fp8ColumnParallelLinear,
        RowParallelLinear: Fp8RowParallelLinear}


def convert_to_fp8(blocks, backward: str = "e5m2") -> int:
    """Swap every linear layer inside ``blocks`` for its fp8 class, in place, its backward
    ``backward`` (``"e5m2"`` or ``"fp32"``); returns how many. A linear-like layer of another
    class (a chunked, fed, LoRA or GPT-2 ``Conv1D`` layer) is a ``ValueError`` naming it: it has
    no fp8 form yet."""
    check_backward(backward)
    count = 0
    for block in blocks:
        for name, module in block.named_modules():
            fp8 = _FP8.get(type(module))
            if fp8 is not None:
                module.__class__ = fp8
                module.fp8_backward = backward
                count += 1
            elif isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) \
                    or type(module).__name__ == "Conv1D":
                if type(module) not in _FP8.values():
                    raise ValueError(f"precision='fp8': {name} ({type(module).__name__}) has no "
                                     f"fp8 form yet (nn.Linear, column and row layers do)")
    return count
