"""The collectives FSDP2 issues, run by ours: recorded in the ledger, timed by the profiler.

``torch.distributed.fsdp.fully_shard`` calls ``torch.distributed`` itself — an all-gather of each
unit's parameter shards before its forward (and again before its backward when it reshards after
forward) and a reduce-scatter of its gradients after its backward. FSDP2 lets a module replace
both (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, which take objects with
FSDP's ``AllGather`` / ``ReduceScatter`` interface: ``allocate`` a buffer, ``__call__`` the
collective). :class:`LedgerAllGather` and :class:`LedgerReduceScatter` are such objects; their
``__call__`` is :func:`~.collectives.all_gather_into` / :func:`~.collectives.reduce_scatter_into`,
so FSDP2's collectives are recorded by every open :class:`~.ledger.CommLedger` — labels
``fsdp_params`` (all-gather) and ``fsdp_grads`` (reduce-scatter), on the unit's data-parallel group
— run with the algorithm the communication engine chose for that group, and appear in the profiler
as ``ops_transformer::all_gather`` / ``ops_transformer::reduce_scatter`` like every other
collective of the package. Buffers are plain ``torch.empty`` (FSDP2's default).

=============== ========================= ==================================================
class           FSDP2 calls it            runs (ledger label)
=============== ========================= ==================================================
LedgerAllGather unshard (forward, and     ``all_gather_into`` of the unit's flat shards over
                backward after a reshard) its mesh's group (``fsdp_params``)
LedgerReduce…   post-backward             ``reduce_scatter_into`` of the unit's flat padded
                                          gradients, SUM (``fsdp_grads``); FSDP2 divides by
                                          the group's size itself
=============== ========================= ==================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:  # FSDP2's interfaces for custom collectives (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # older torch: shard_parameters refuses to run (memory/fsdp.py)
    AllGather = ReduceScatter = object

from . import collectives as C


class _Allocate:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class LedgerAllGather(_Allocate, AllGather):
    """FSDP2's parameter all-gather through :func:`~.collectives.all_gather_into`."""

    label = "fsdp_params"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        return C.all_gather_into(output_tensor, input_tensor, group, async_op=async_op,
                                 label=self.label)


class LedgerReduceScatter(_Allocate, ReduceScatter):
    """FSDP2's gradient reduce-scatter through :func:`~.collectives.reduce_scatter_into`. FSDP2
    is told to reduce with SUM and divide itself (``set_force_sum_reduction_for_comms``): gloo has
    no AVG, and the engine's multi-step algorithms sum."""

    label = "fsdp_grads"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        if op != C.ReduceOp.SUM:
            raise ValueError(f"FSDP2 asked for a reduce-scatter with {op}; the units of "
                             f"ops_transformer.shard_parameters reduce with SUM and divide after")
        return C.reduce_scatter_into(output_tensor, input_tensor, group, async_op=async_op,
                                     label=self.label)
