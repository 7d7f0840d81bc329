"""The fused entry of a region and its column layers (SPEC F4, overlap; issue 33): what
:class:`~.regions.CopyToTPRegion` and :class:`~.regions.GatherSequenceRegion` run when a plan gives
them ``columns`` — the column layers that read their input (Q, K and V; gate and up), computed as
**one** collective matmul with the entry (:mod:`.collective_matmul`), the chunk count from the
region's :class:`~.overlap_policy.OverlapPolicy` (one without). Each child, a :class:`FedColumn`
(:func:`as_variant`), returns that op's output when called with the region's input (anything else
it computes itself, which stays exact). See :mod:`.overlap_regions` for the table.
"""

from __future__ import annotations

import contextlib

import torch

from .collective_matmul import copy_matmul, gather_matmul
from .linear import ColumnParallelLinear, _autocast_dtype
from .mixin import mix_into
from .overlap_policy import OverlapPolicy


def as_variant(module, mixin: type, **settings):
    """Turn ``module`` (in place) into ``mixin``'s variant of its class, named
    ``<prefix><class>`` (``FedColumnParallelLinear``: still a ``ColumnParallelLinear``), with
    ``settings`` as attributes (:func:`~.mixin.mix_into`); returns it."""
    return mix_into(module, mixin, mixin.prefix + "{}", **settings)


class FedColumn:
    """A column-parallel layer inside an entry region (:func:`as_variant`: ``FedColumnParallel
    Linear``): called with the region's input, it returns the output the region's collective
    matmul computed for it."""

    prefix = "Fed"
    fed = None  # (input, output) while its region's own forward runs

    def forward(self, x):
        fed = self.fed
        if fed is not None and x is fed[0]:
            return fed[1]
        return super().forward(x)

    def extra_repr(self) -> str:
        return (super().extra_repr() + ", output: from its region's collective matmul when called "
                "with the region's input")


@contextlib.contextmanager
def _feeding(columns, x, outputs):
    for column, y in zip(columns, outputs):
        if isinstance(column, FedColumn):
            column.fed = (x, y)
    try:
        yield
    finally:
        for column in columns:
            if isinstance(column, FedColumn):
                column.fed = None


def _with_adapters(columns, x_region, outputs) -> list:
    """Each column's output plus its LoRA adapter's (:mod:`.lora`), computed on the tensor the
    fused op returned for the region's input: the adapter's partial input gradient then joins the
    op's own all-reduce / reduce-scatter of the input gradient — no collective of its own."""
    return [y + c.adapter(x_region) if hasattr(c, "adapter") else y
            for c, y in zip(columns, outputs)]


class _ChunkedEntry:
    """What both entry regions share: finding their column layers and feeding them. A chunked
    entry is its unchunked region (``replaces``) with the collective done by the fused op."""

    columns: tuple[str, ...] = ()  # none: the plain region (its entry op without weights)
    overlap: OverlapPolicy = None  # none: one chunk (overlap="none")
    region_name = ""  # the planner formula's region kind
    replaces: type = None  # the region whose collective this one's fused op performs
    regather = False  # (a sequence entry) keep the share, all-gather it again in backward

    def _columns(self) -> list[ColumnParallelLinear]:
        found = [self if name == "" else self.get_submodule(name) for name in self.columns]
        for name, c in zip(self.columns, found):
            if not isinstance(c, ColumnParallelLinear) or c.gather_output:
                raise ValueError(f"{type(self).__name__}: column {name or '(itself)'!r} is a "
                                 f"{type(c).__name__}; a chunked entry computes column-parallel "
                                 f"layers without a gathered output")
        return found

    def _run(self, args, kwargs, x_region, columns, outputs):
        """The region's forward past its collective: ``outputs`` (the fused op's 2-D ones) shaped
        as ``x_region``, each with its column's adapter added."""
        lead = x_region.shape[:-1]
        outputs = _with_adapters(columns, x_region, [y.view(*lead, y.shape[-1]) for y in outputs])
        if self.columns == ("",):
            return outputs[0]
        if args:
            args = (x_region, *args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": x_region}
        with _feeding(columns, x_region, outputs):  # past the replaced region's collective
            return super(self.replaces, self).forward(*args, **kwargs)

    def _chunks(self, tokens: int, in_features: int, columns, dtype) -> int:
        if self.overlap is None:
            return 1
        out = sum(c.weight.shape[0] for c in columns)
        return self.overlap.chunks_for(self.region_name, tokens, in_features, out,
                                       self.region_group.size(), dtype)

    def _first_input(self, args, kwargs) -> torch.Tensor:
        if args:
            return args[0]
        if "hidden_states" in kwargs:
            return kwargs["hidden_states"]
        raise ValueError(f"{type(self).__name__}: {self._wrapped_name()} was called without a "
                         f"positional input or a hidden_states keyword")

    def _names(self) -> str:
        return ", ".join(n or "itself" for n in self.columns)

    def _copy_forward(self, args, kwargs):
        """A tensor-parallel entry as one op for its column layers (:func:`copy_matmul`):
        forward their matmuls, backward the all-reduce of the input gradient in chunks, each
        running while the next chunk's input gradient is computed (the last ones behind the
        weight gradients)."""
        x = self._first_input(args, kwargs)
        columns = self._columns()
        dtype = _autocast_dtype(x) or x.dtype  # the all-reduce runs in the compute dtype
        chunks = (self._chunks(x.numel() // x.shape[-1], x.shape[-1], columns, dtype)
                  if torch.is_grad_enabled() else 1)  # (its only collective is in backward)
        x_same, outputs = copy_matmul(x.reshape(-1, x.shape[-1]), [c.weight for c in columns],
                                      [c.bias for c in columns], self.region_group, chunks)
        return self._run(args, kwargs, x_same.view(x.shape), columns, outputs)

    def _copy_repr(self) -> str:
        return (f"input: copy_to_tp_region {self._over()} (fwd identity, bwd all-reduce of the "
                f"input gradient) as copy_matmul with {self._names()}: the all-reduce in "
                f"chunks, overlapped with the input-gradient matmuls, {self.overlap!r}")

    def _gather_forward(self, args, kwargs):
        """A tensor-parallel region entered from the sequence-parallel layout, as one op for its
        column layers (:func:`gather_matmul`): the all-gather of the tokens in chunks, each chunk
        multiplied while the next arrives; backward the reduce-scatter of the input gradient in
        chunks (``regather``: the share kept and all-gathered again)."""
        x = self._first_input(args, kwargs)
        b, s, h, t = x.shape[0], x.shape[1], x.shape[-1], self.region_group.size()
        columns = self._columns()
        chunks = self._chunks(x.numel() // h * t, h, columns, x.dtype)
        x_full, outputs = gather_matmul(x.reshape(-1, h), [c.weight for c in columns],
                                        [c.bias for c in columns], self.region_group, chunks,
                                        regather=self.regather)
        return self._run(args, kwargs, x_full.view(b, s * t, *x.shape[2:]), columns, outputs)

    def _gather_repr(self) -> str:
        kept = ("; keeps this rank's share, all-gathered again in backward (regather)"
                if self.regather else "")
        return (f"input: gather_sequence_region {self._over()} (fwd all-gather of the tokens, bwd "
                f"reduce-scatter{kept}) as gather_matmul with {self._names()}: each chunk "
                f"multiplied while the next arrives, {self.overlap!r}")
