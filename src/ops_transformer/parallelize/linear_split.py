"""Row or column? The split of a standalone linear, chosen from the cost model (SPEC F3).

Layouts are ``"replicated"`` (every rank holds the whole tensor) or ``"sharded"`` (the last dimension
split across the TP ranks, rank-major). For ``n_in = tokens·in`` and ``n_out = tokens·out``:

====================  ================================  =================================
                      column (weight rows split)        row (weight columns split)
====================  ================================  =================================
input replicated      —                                 slice locally; bwd all-gather n_in
input sharded         fwd all-gather n_in,              —
                      bwd reduce-scatter n_in
(input gradient)      bwd all-reduce n_in (replicated)  —
output replicated     fwd all-gather n_out              fwd all-reduce n_out
output sharded        —                                 slice locally; bwd all-gather n_out
====================  ================================  =================================

Both divide the matmul FLOPs by ``tp``, so the choice is the cheaper communication under the
α–β model of the hardware profile. For replicated in and out, column moves ``(p−1)/p·(n_out +
2·n_in)`` per rank and row ``(p−1)/p·(2·n_out + n_in)``: column wins when ``out > in``, row when
``out < in``; a square matrix is a tie in this model (decided for column), whatever its size.
"""

from __future__ import annotations

from torch import nn

from ..comm.primitives import all_gather_along, scatter_to_tp_region
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, dense_weight
from ..planner.choose import choose_split  # noqa: F401  (its home is the cost model)
from ..planner.hardware import HardwareProfile
from ..planner.strategies import LINEAR_LAYOUTS, split_comm  # noqa: F401

LAYOUTS = LINEAR_LAYOUTS


class _GatherInput(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return all_gather_along(x, self.group, -1)


class _SliceOutput(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return scatter_to_tp_region(x, self.group, -1)


def parallel_linear(linear: nn.Module, ctx, split: str = "auto", *,
                    input_layout: str = "replicated", output_layout: str = "replicated",
                    tokens: int = 2048, profile: HardwareProfile | None = None) -> nn.Module:
    """The column- or row-parallel form of ``linear`` for the given input and output layouts.

    ``split="auto"`` picks the cheaper one for ``tokens`` rows per call on ``profile`` (default
    ``ctx.profile``, agreed by every rank); the result is exact either way. The returned module
    has ``split`` and ``predicted_s`` attributes.
    """
    for name, layout in (("input_layout", input_layout), ("output_layout", output_layout)):
        if layout not in LAYOUTS:
            raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    if split not in ("auto", "column", "row"):
        raise ValueError(f"split must be 'auto', 'column' or 'row', got {split!r}")
    out_features, in_features = dense_weight(linear)[0].shape
    chosen, times = choose_split(tokens, in_features, out_features, ctx.tp_size, input_layout,
                                 output_layout, profile if profile is not None else ctx.profile)
    split = chosen if split == "auto" else split
    group = ctx.tp_group
    if split == "column":
        layer = ColumnParallelLinear.from_dense(linear, ctx,
                                                gather_output=output_layout == "replicated",
                                                reduce_input_grad=input_layout == "replicated")
        parts = ([_GatherInput(group)] if input_layout == "sharded" else []) + [layer]
    else:
        layer = RowParallelLinear.from_dense(linear, ctx,
                                             input_is_parallel=input_layout == "sharded")
        parts = [layer] + ([_SliceOutput(group)] if output_layout == "sharded" else [])
    module = nn.Sequential(*parts) if len(parts) > 1 else parts[0]
    module.split, module.predicted_s = split, times
    return module
