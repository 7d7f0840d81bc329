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

Under sequence parallelism (``sequence_parallel=True``):

* :class:`Fp8GatherSequenceRegion` — the region entry all-gathers the tokens as e4m3 bytes by the
  dense scale (:func:`~ops_transformer.precision.fp8.gather_tokens_fp8`); its fp8 column layers
  multiply the gathered e4m3 values as they are (no second cast).
* :class:`Fp8SequenceParallelRowLinear` — the fp8 partial product (weight and split-input amax
  all-reduced) reduce-scattered over the tokens; backward the all-gather of the output gradient,
  which is then whole on every rank (its e5m2 scale needs no collective).

``fp8_backward`` (a layer attribute, set by :func:`convert_to_fp8`): ``"e5m2"`` (default,
torchao's recipe) or ``"fp32"`` (straight-through) — :mod:`ops_transformer.precision.fp8`.

These layers run their collective and their matmul one after the other (no chunked overlap).
:func:`convert_to_fp8` swaps the classes in place (parameters, names and ``state_dict`` stay).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.primitives import copy_to_tp_region, reduce_from_tp_region, reduce_scatter_along
from ..precision.fp8 import check_backward, fp8_linear, gather_tokens_fp8
from .linear import ColumnParallelLinear, RowParallelLinear
from .mixin import mixed_class, mixed_parts
from .regions import GatherSequenceRegion
from .sequence_parallel import SEQ_DIM, SequenceParallelRowLinear


def _group(layer):
    return layer.tp_group if layer.tp_size > 1 else None


def _with_adapter(layer, partial: torch.Tensor, x_local: torch.Tensor) -> torch.Tensor:
    """A row layer's partial output plus its LoRA adapter's partial (:mod:`.lora`: fp32, summed
    by the layer's own collective), where it has one."""
    return partial + layer.adapter(x_local) if hasattr(layer, "adapter") else partial


def _sequence_active(group) -> bool:
    """Whether the sequence-parallel layout is on (as :mod:`.sequence_parallel`: with autograd)."""
    return C.group_size(group) > 1 and torch.is_grad_enabled()


class Fp8Linear(nn.Linear):
    """``nn.Linear`` with its matmul in fp8 (the whole tensors' scales: no group)."""

    fp8_backward = "e5m2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, backward=self.fp8_backward)


class Fp8Conv1D(nn.Module):
    """Mixed into a GPT-2 ``Conv1D`` (``y = x W + b``, ``W [in, out]``; a Hugging Face class, so
    the fp8 class is made from it at conversion): its matmul in fp8, ``W`` cast as ``Wᵀ``."""

    fp8_backward = "e5m2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight.t(), self.bias, backward=self.fp8_backward)


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
        return reduce_from_tp_region(_with_adapter(self, partial, x_local), group)

    def partial_output(self, x_local, weight, bias=None):
        return fp8_linear(x_local, weight, bias, backward=self.fp8_backward)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8 (amax: all-reduce MAX over tp)"


class Fp8SequenceParallelRowLinear(SequenceParallelRowLinear, Fp8RowParallelLinear):
    """:class:`SequenceParallelRowLinear` whose partial matmul is fp8: ``y_share =
    reduce-scatter(Q(x_r) Q(W_r)ᵀ) + b`` (weight and input amax all-reduced MAX over tp)."""

    def exit(self, x_local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not _sequence_active(self.tp_group):
            return Fp8RowParallelLinear.exit(self, x_local, weight)
        group = self.tp_group
        partial = _with_adapter(self, fp8_linear(x_local, weight, weight_group=group,
                                                 input_group=group, backward=self.fp8_backward),
                                x_local)
        y = reduce_scatter_along(partial.reshape(-1, partial.shape[-1]), group, 0)
        return y.view(x_local.shape[0], x_local.shape[SEQ_DIM] // self.tp_size,
                      *x_local.shape[2:-1], weight.shape[0])


class Fp8GatherSequenceRegion(GatherSequenceRegion):
    """:class:`~.regions.GatherSequenceRegion` whose all-gather moves the tokens as e4m3 bytes
    (:func:`~ops_transformer.precision.fp8.gather_tokens_fp8`; backward the fp32 reduce-scatter)."""

    def _gather(self, x):
        if not _sequence_active(self.region_group):
            return x
        if any(hasattr(m, "lora_A") for m in self.modules()):
            raise ValueError("precision='fp8' with sequence_parallel does not combine with LoRA "
                             "yet: the region gathers e4m3 tokens, an adapter needs the fp32 ones; "
                             "drop one of them")
        return gather_tokens_fp8(x, self.region_group)

    def extra_repr(self) -> str:
        mine = (f"input: gather_tokens_fp8 {self._over()} (fwd amax all-reduce MAX and all-gather "
                f"of the tokens as e4m3 bytes, bwd reduce-scatter)")
        inner = super(GatherSequenceRegion, self).extra_repr()
        return f"{mine}, {inner}" if inner else mine


_FP8 = {nn.Linear: Fp8Linear, ColumnParallelLinear: Fp8ColumnParallelLinear,
        RowParallelLinear: Fp8RowParallelLinear,
        SequenceParallelRowLinear: Fp8SequenceParallelRowLinear}
_FP8_MIXINS = {GatherSequenceRegion: Fp8GatherSequenceRegion}
_LINEAR = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def _fp8_class(cls: type) -> type:
    """``cls``'s fp8 form: a linear layer's fp8 class, a mixed class (a region, :mod:`.mixin`)
    with its mixin and its base each in fp8 form; ``cls`` itself where nothing changes."""
    if cls in _FP8:
        return _FP8[cls]
    if cls.__name__ == "Conv1D" and issubclass(cls, nn.Module):
        return mixed_class(Fp8Conv1D, cls, "Fp8{}")
    parts = mixed_parts(cls)
    if parts is None:
        return cls
    mixin, base = parts
    if mixin is Fp8Conv1D:
        return cls
    if issubclass(base, _LINEAR) and mixin not in _FP8_MIXINS:
        return cls  # a chunked, fed or LoRA layer: its own matmul, no fp8 form
    fp8_mixin, fp8_base = _FP8_MIXINS.get(mixin, mixin), _fp8_class(base)
    if fp8_mixin is mixin and fp8_base is base:
        return cls
    name = cls.__name__.replace(base.__name__, "{}").replace(mixin.__name__, fp8_mixin.__name__, 1)
    return mixed_class(fp8_mixin, fp8_base, name)


def convert_to_fp8(blocks, backward: str = "e5m2") -> int:
    """Swap every linear layer inside ``blocks`` for its fp8 class (and a sequence-parallel
    region's entry for its fp8 gather), in place, its backward ``backward`` (``"e5m2"`` or
    ``"fp32"``); returns how many linear layers. A linear-like layer of another class (a chunked,
    fed, LoRA or GPT-2 ``Conv1D`` layer, a re-gathering region) is a ``ValueError`` naming it: it
    has no fp8 form yet."""
    check_backward(backward)
    fp8_layers = (*_FP8.values(), Fp8Conv1D)
    count = 0
    for block in blocks:
        for name, module in block.named_modules():
            cls = type(module)
            fp8 = _fp8_class(cls)
            module.__class__ = fp8
            if isinstance(module, fp8_layers):
                module.fp8_backward = backward
                count += 1
            elif isinstance(module, _LINEAR) or cls.__name__ == "Conv1D":
                raise ValueError(f"precision='fp8': {name} ({cls.__name__}) has no fp8 form yet "
                                 f"(nn.Linear, column and row layers, sequence-parallel ones too, "
                                 f"do)")
            if isinstance(module, GatherSequenceRegion) \
                    and not isinstance(module, Fp8GatherSequenceRegion):
                raise ValueError(f"precision='fp8': {name} ({cls.__name__}) has no fp8 form yet "
                                 f"(the plain sequence-parallel region does)")
    return count
