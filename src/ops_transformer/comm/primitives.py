"""Autograd-aware communication primitives, forward and backward side by side.

Each primitive is the dual of another: the backward of one is the forward of its dual. All are the
identity on a group of one rank (no autograd node, no communication).

=========================== ================================ ================================
primitive                   forward                          backward
=========================== ================================ ================================
``copy_to_tp_region``       identity                         all-reduce
``reduce_from_tp_region``   all-reduce                       identity
``scatter_to_tp_region``    keep this rank's chunk of ``dim`` all-gather along ``dim``
``gather_from_tp_region``   all-gather along ``dim``         keep this rank's chunk
``all_gather_along``        all-gather along ``dim``         reduce-scatter along ``dim``
``reduce_scatter_along``    reduce-scatter along ``dim``     all-gather along ``dim``
``all_to_all``              all-to-all along dim 0           all-to-all with the splits swapped
=========================== ================================ ================================

``gather_from_tp_region`` assumes the gradient of its output is the same on every rank (a replicated
consumer), so its backward needs no communication; ``all_gather_along`` assumes each rank holds a
different partial gradient (sequence parallelism), so its backward sums them with a reduce-scatter.
"""

from __future__ import annotations

import torch

from . import collectives as C
from .collectives import ProcessGroup, group_rank, group_size


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> int:
    size = x.shape[dim]
    if size % world != 0:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} has size {size}, "
            f"which does not divide by the group size {world}"
        )
    return size // world


def _gather(x: torch.Tensor, group: ProcessGroup, dim: int, label: str) -> torch.Tensor:
    world = group_size(group)
    x_moved = x.movedim(dim, 0).contiguous()  # (d_k, ...) shard of this rank
    out = x_moved.new_empty((world * x_moved.shape[0], *x_moved.shape[1:]))
    C.all_gather_into(out, x_moved, group, label=label)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup, dim: int, label: str) -> torch.Tensor:
    world = group_size(group)
    chunk = _check_divisible(x, dim, world, "reduce_scatter_along")
    x_moved = x.movedim(dim, 0).contiguous()  # (p * d_k, ...)
    out = x_moved.new_empty((chunk, *x_moved.shape[1:]))
    C.reduce_scatter_into(out, x_moved, group, label=label)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    world = group_size(group)
    chunk = _check_divisible(x, dim, world, "scatter_to_tp_region")
    return x.narrow(dim, group_rank(group) * chunk, chunk).contiguous()


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup, label: str) -> torch.Tensor:
    out = x.contiguous(memory_format=torch.contiguous_format).clone()
    C.all_reduce(out, group, label=label)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_copy(grad, ctx.group, "copy_to_tp_region.bwd"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label="reduce_from_tp_region"):
        return _all_reduce_copy(x, group, f"{label}.fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceFromRegionInplace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        C.all_reduce(x, group, label="reduce_from_tp_region.fwd")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, "scatter_to_tp_region.bwd"), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim, "gather_from_tp_region.fwd")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _AllGatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, label):
        ctx.group, ctx.dim, ctx.label = group, dim, label
        return _gather(x, group, dim, f"{label}.fwd")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim, f"{ctx.label}.bwd"), None, None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim, "reduce_scatter_along.fwd")

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim, "reduce_scatter_along.bwd"), None, None


def _all_to_all(x, group, output_splits, input_splits, label):
    x = x.contiguous()
    rows = x.shape[0] if output_splits is None else sum(output_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    C.all_to_all_into(out, x, group, output_split_sizes=output_splits,
                      input_split_sizes=input_splits, label=label)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, label="all_to_all"):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        ctx.label = label
        return _all_to_all(x, group, output_splits, input_splits, f"{label}.fwd")

    @staticmethod
    def backward(ctx, grad):
        back = _all_to_all(grad, ctx.group, ctx.input_splits, ctx.output_splits,
                           f"{ctx.label}.bwd")
        return back, None, None, None, None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) of the input gradient over ``group``."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup | None, *,
                          inplace: bool = False, label: str = "reduce_from_tp_region"
                          ) -> torch.Tensor:
    """Forward: all-reduce (sum) of partial results. Backward: identity.

    ``inplace=True`` reduces into ``x`` itself (no copy); use it only on a fresh intermediate that no
    autograd node saved, e.g. the output of a matmul.
    """
    if group_size(group) == 1:
        return x
    if inplace and x.is_contiguous() and not torch.compiler.is_compiling():  # a graph: a copy
        return _ReduceFromRegionInplace.apply(x, group)
    return _ReduceFromRegion.apply(x, group, label)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Forward: keep this rank's chunk along ``dim``. Backward: all-gather along ``dim``."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather along ``dim`` (rank-major). Backward: keep this rank's chunk."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, dim)


def all_gather_along(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0, *,
                     label: str = "all_gather_along") -> torch.Tensor:
    """Forward: all-gather along ``dim``. Backward: reduce-scatter along ``dim`` (sequence
    parallel; context parallelism's K/V). The ledger labels them ``{label}.fwd`` / ``.bwd``."""
    return x if group_size(group) == 1 else _AllGatherAlong.apply(x, group, dim, label)


def reduce_scatter_along(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Forward: reduce-scatter along ``dim``. Backward: all-gather along ``dim``."""
    return x if group_size(group) == 1 else _ReduceScatterAlong.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group: ProcessGroup | None, *,
               output_splits: list[int] | None = None,
               input_splits: list[int] | None = None, label: str = "all_to_all") -> torch.Tensor:
    """All-to-all along dim 0; uneven when split sizes are given. Backward swaps the splits.
    The ledger labels the calls ``{label}.fwd`` / ``{label}.bwd``.

    ``input_splits[r]`` rows of ``x`` go to rank ``r``; ``output_splits[r]`` rows arrive from rank
    ``r``. With ``None`` splits, dim 0 must divide by the group size.
    """
    world = group_size(group)
    if world == 1:
        return x
    for name, splits in (("input_splits", input_splits), ("output_splits", output_splits)):
        if splits is not None and len(splits) != world:
            raise ValueError(f"all_to_all: {name} has {len(splits)} entries, expected one per "
                             f"rank of the group ({world})")
    if input_splits is None:
        _check_divisible(x, 0, world, "all_to_all")
    elif sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: input_splits {list(input_splits)} sum to "
                         f"{sum(input_splits)}, but dim 0 of the input has size {x.shape[0]}")
    return _AllToAll.apply(x, group, output_splits, input_splits, label)
