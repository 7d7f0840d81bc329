"""Communicating regions: a module a plan keeps, with the collective around it made part of it.

Some plan styles keep a module as it is and communicate at its edge: Q, K and V behind one
copy-to-region, a replicated module behind an all-gather, a module whose output is a partial sum,
the entry and exit of the sequence-parallel layout. Such a style turns the module into a *region*:
``Region.wrap(module, group)`` gives it a small subclass of its own class (made once per class, as
FSDP2's ``fully_shard`` does) whose ``forward`` runs the collective and then the module's own
forward. Names, parameters, state-dict keys and ``isinstance`` are unchanged, and ``print(model)``
names each region's collective (``extra_repr``)::

    (self_attn): CopyToTPRegion[LlamaAttention](input: copy_to_tp_region over tp=2 (fwd identity,
                 bwd all-reduce of the input gradient)
      (q_proj): ColumnParallelLinear(...)

=========================== ============================= ========================= =============
region                      where                         forward                   backward
=========================== ============================= ========================= =============
:class:`CopyToTPRegion`     first input / hidden_states   identity                  all-reduce
:class:`GatherInput`        first input, last dim         all-gather                keep own chunk
:class:`ReduceOutput`       output                        all-reduce                identity
  (``region_inputs=True``)  every floating-point input    identity                  all-reduce
:class:`RopeGradRegion`     last ``rope_dim`` out features identity                 all-reduce
:class:`ScatterSequence`    first input                   keep own share of tokens  all-gather
:class:`GatherSequenceRegion` first input                 all-gather of tokens      reduce-scatter
:class:`RegatherSequenceRegion` first input               all-gather, keeps only    reduce-scatter
                                                          this rank's share         (the layers
                                                                                    inside gather
                                                                                    the share again)
:class:`GatherSequenceOutput` output                      all-gather of tokens      keep own share
=========================== ============================= ========================= =============

The entries of a tensor-parallel region are the collective-matmul ops of
:mod:`.collective_matmul` with no column weights and one chunk (``CopyToTPRegion``:
``copy_matmul``; ``GatherSequenceRegion``: ``gather_matmul``), the ops the chunked entries of
:mod:`.overlap_regions` run with their column weights — one implementation per entry. Each is the
identity on a group of one rank, as its primitive is. Regions stack (a region of a
region runs the outer collective first); what the module itself computes is ``own_forward``, which
recompute and the activation cache wrap (:func:`wrap_own_forward`) so the region's collectives stay
outside them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.primitives import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region
from .collective_matmul import copy_matmul
from .fused_entry import _ChunkedEntry
from .linear import to_compute_dtype
from .mixin import mix_into
from .sequence_parallel import _active, gather_sequence, gather_sequence_region, scatter_sequence
from .sequence_regather import gather_sequence_regather


class Region(nn.Module):
    """The base of the regions above; never instantiated, only mixed into a module's class."""

    @classmethod
    def wrap(cls, module: nn.Module, group, **settings) -> nn.Module:
        """Turn ``module`` (in place) into this region over ``group`` (:func:`~.mixin.mix_into`:
        ``Region[Module]``); returns it."""
        return mix_into(module, cls, f"{cls.__name__}[{{}}]", region_group=group, **settings)

    def forward(self, *args, **kwargs):  # the innermost region: the module's own computation
        return self.own_forward(*args, **kwargs)

    def own_forward(self, *args, **kwargs):
        return super(Region, self).forward(*args, **kwargs)

    def _wrapped_name(self) -> str:
        return next(c for c in type(self).__mro__ if not issubclass(c, Region)).__name__

    def _over(self) -> str:
        return f"over tp={C.group_size(self.region_group)}"



def _joined(mine: str, inner: str) -> str:
    return f"{mine}, {inner}" if inner else mine


def wrap_own_forward(module: nn.Module, wrapper) -> None:
    """Wrap what ``module`` itself computes with ``wrapper`` (e.g. a checkpoint): its ``forward``,
    or, for a region, its own forward inside the region's collectives."""
    name = "own_forward" if isinstance(module, Region) else "forward"
    setattr(module, name, wrapper(getattr(module, name)))


def _on_first_input(module: Region, args, kwargs, fn):
    """``fn`` applied to the first positional input, or to the ``hidden_states`` keyword."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise ValueError(f"{type(module).__name__}: {module._wrapped_name()} was called without a "
                     f"positional input or a hidden_states keyword")


class CopyToTPRegion(_ChunkedEntry, Region):
    """The column-parallel children that share this module's input (Q, K, V; gate and up) need one
    backward all-reduce of its gradient between them: ``copy_to_tp_region`` on the input, in
    autocast's dtype (so the all-reduce runs in it too). With ``columns`` (a plan's
    ``region(columns=…)``, :mod:`.fused_entry`) the entry and those children are one
    ``copy_matmul``, its all-reduce in the ``overlap`` policy's chunks."""

    region_name = "tp_entry"

    def forward(self, *args, **kwargs):
        if self.columns and C.group_size(self.region_group) > 1:
            return self._copy_forward(args, kwargs)
        args, kwargs = _on_first_input(self, args, kwargs, self._copy_to_region)
        return super().forward(*args, **kwargs)

    def _copy_to_region(self, x):
        if C.group_size(self.region_group) == 1:
            return x
        # the collective matmul of the entry with no column weights, in one chunk
        x_same, _ = copy_matmul(x.reshape(-1, x.shape[-1]), [], [], self.region_group, 1,
                                "copy_to_tp_region.bwd")
        return x_same.view(x.shape)

    def extra_repr(self) -> str:
        mine = self._copy_repr() if self.columns else (
            f"input: copy_to_tp_region {self._over()} (fwd identity, bwd "
            f"all-reduce of the input gradient)")
        return _joined(mine, super().extra_repr())


CopyToTPRegion.replaces = CopyToTPRegion  # (the fused op runs past the region's own collective)


class GatherInput(Region):
    """A replicated module fed by a feature-split input: all-gather it along the last dimension."""

    def forward(self, x, *args, **kwargs):
        return super().forward(gather_from_tp_region(x, self.region_group, -1), *args, **kwargs)

    def extra_repr(self) -> str:
        mine = (f"input: gather_from_tp_region(dim=-1) {self._over()} (fwd "
                f"all-gather, bwd keeps this rank's chunk)")
        return _joined(mine, super().extra_repr())


class ReduceOutput(Region):
    """A module computing a partial sum on each rank: its output is all-reduced. With
    ``region_inputs`` (its parameters are raw sharded tensors) each floating-point input's gradient
    is partial too, and is all-reduced in backward."""

    region_inputs = False

    def forward(self, *args, **kwargs):
        if self.region_inputs:
            args = tuple(self._region(a) for a in args)
            kwargs = {k: self._region(v) for k, v in kwargs.items()}
        out = super().forward(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"reduce_out style: {self._wrapped_name()} returned "
                             f"{type(out).__name__}, expected a tensor")
        return reduce_from_tp_region(out, self.region_group)

    def _region(self, t):
        return (copy_to_tp_region(to_compute_dtype(t), self.region_group)
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t)

    def extra_repr(self) -> str:
        mine = f"output: reduce_from_tp_region {self._over()} (fwd all-reduce, bwd identity)"
        if self.region_inputs:
            mine += ", inputs: copy_to_tp_region (bwd all-reduce of each input gradient)"
        return _joined(mine, super().extra_repr())


class RopeGradRegion(Region):
    """MLA's replicated ``kv_a_proj_with_mqa``: its last ``rope_dim`` output features bypass the
    column-parallel ``kv_b_proj`` and feed this rank's heads directly, so their gradient is
    partial: ``copy_to_tp_region`` on them."""

    rope_dim = 0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        kv, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([kv, copy_to_tp_region(rope, self.region_group)], dim=-1)

    def extra_repr(self) -> str:
        mine = (f"output[..., -{self.rope_dim}:]: copy_to_tp_region "
                f"{self._over()} (fwd identity, bwd all-reduce)")
        return _joined(mine, super().extra_repr())


class ScatterSequence(Region):
    """The first layer under sequence parallelism: keep this rank's share of its input's tokens."""

    def forward(self, *args, **kwargs):
        args, kwargs = _on_first_input(self, args, kwargs, self._scatter)
        return super().forward(*args, **kwargs)

    def _scatter(self, x):
        return scatter_sequence(x, self.region_group)

    def extra_repr(self) -> str:
        mine = (f"input: scatter_sequence {self._over()} (fwd keeps this rank's "
                f"share of the tokens, bwd all-gather)")
        return _joined(mine, super().extra_repr())


class GatherSequenceRegion(_ChunkedEntry, Region):
    """A tensor-parallel region entered from the sequence-parallel layout: all-gather the tokens
    (backward: reduce-scatter of the column layers' partial input gradients). With ``columns``
    (:mod:`.fused_entry`) the entry and those children are one ``gather_matmul``, in the
    ``overlap`` policy's chunks; ``regather`` then keeps only this rank's share for backward.
    Without autograd, plain tensor parallelism."""

    region_name = "sp_entry"

    def forward(self, *args, **kwargs):
        if self.columns and _active(self.region_group):
            return self._gather_forward(args, kwargs)
        args, kwargs = _on_first_input(self, args, kwargs, self._gather)
        return super().forward(*args, **kwargs)

    def _gather(self, x):
        return gather_sequence_region(x, self.region_group)

    def extra_repr(self) -> str:
        mine = self._gather_repr() if self.columns else (
            f"input: gather_sequence_region {self._over()} (fwd all-gather "
            f"of the tokens, bwd reduce-scatter)")
        return _joined(mine, super().extra_repr())


GatherSequenceRegion.replaces = GatherSequenceRegion


class RegatherSequenceRegion(GatherSequenceRegion):
    """:class:`GatherSequenceRegion` with ``regather=True`` and no ``columns``
    (``overlap="none"``): keeps only this rank's share of the tokens for backward; the region's
    :class:`~.sequence_regather.RegatherColumnLinear` layers all-gather it again there (one more
    all-gather per region, :mod:`.sequence_regather`)."""

    regather = True

    def _gather(self, x):
        return gather_sequence_regather(x, self.region_group)

    def extra_repr(self) -> str:
        if self.columns:
            return super().extra_repr()
        mine = (f"input: gather_sequence_regather {self._over()} (fwd all-gather of the tokens, "
                f"keeps this rank's share; bwd reduce-scatter, the share all-gathered again)")
        return _joined(mine, super(GatherSequenceRegion, self).extra_repr())


class GatherSequenceOutput(Region):
    """The final norm under sequence parallelism: runs on this rank's share, its output is
    all-gathered for the replicated LM head (backward: keep this rank's share)."""

    def forward(self, *args, **kwargs):
        return gather_sequence(super().forward(*args, **kwargs), self.region_group)

    def extra_repr(self) -> str:
        mine = (f"output: gather_sequence {self._over()} (fwd all-gather of the "
                f"tokens, bwd keeps this rank's share)")
        return _joined(mine, super().extra_repr())


class FullSequenceRegion(Region):
    """A module that runs on the whole sequence inside the sequence-parallel layout (an MoE layer:
    its router, capacity and experts see the tokens as without SP, its output replicated over TP
    by the experts' own all-reduce): its input all-gathered (backward: this rank's share of the
    gradient, complete on every rank), its output cut back to this rank's share (backward:
    all-gather). Exact; one all-gather more per direction than a reduce-scatter exit would cost."""

    def forward(self, *args, **kwargs):
        args, kwargs = _on_first_input(self, args, kwargs, self._gather)
        return scatter_sequence(super().forward(*args, **kwargs), self.region_group)

    def _gather(self, x):
        return gather_sequence(x, self.region_group)

    def extra_repr(self) -> str:
        mine = (f"input: gather_sequence {self._over()} (fwd all-gather of the tokens, bwd keeps "
                f"this rank's share); output: scatter_sequence (fwd keeps this rank's share, bwd "
                f"all-gather)")
        return _joined(mine, super().extra_repr())
