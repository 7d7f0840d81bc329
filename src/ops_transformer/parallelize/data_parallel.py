"""The data-parallel step of ``parallelize``: ZeRO 1/2 buckets or FSDP2 units, laid out last.

``parallelize(model, ctx, data_parallel={"zero": N})`` runs this after the plan, LoRA, dropout
and the memory options — over the parameters that train at the end — and then builds the
gradient reducers **once**, in the form the layout needs (:func:`.reducers.gradient_reducers`):

====== ================================================ ===========================================
zero   what is laid out here                            the chain's data-parallel reducers
====== ================================================ ===========================================
0      nothing                                          ``GradSync`` (all-reduce) per group
1      ZeRO buckets (:func:`~..memory.zero.lay_out_zero`) ``GradSync``; ``ot.zero_optimizer``
                                                        shards the optimizer state over them
2      ZeRO buckets                                     ``ReduceScatterGradSync`` (and ``GradSync``
                                                        for the partial-gradient buckets)
3      FSDP2 units (:func:`~..memory.fsdp.              ``FSDPGradSync`` (and ``GradSync`` for the
       fully_shard_layers`)                             parameters left whole)
====== ================================================ ===========================================

``ot.zero_optimizer`` and ``ot.shard_parameters`` called on a model prepared with ``zero=0`` take
the same step afterwards (they lay out and swap the averaging in the chain they find); on a model
prepared with ``zero=1/2`` ``ot.zero_optimizer`` steps the buckets laid out here.
"""

from __future__ import annotations

from torch import nn

from ..memory.fsdp import check_shardable, fully_shard_layers
from ..memory.zero import lay_out_zero
from .options import ParallelOptions


def prepare_data_parallel(model: nn.Module, ctx, options: ParallelOptions) -> None:
    """Lay out ``options.data_parallel`` on ``model.parallel_state`` (its ``zero`` or its
    ``sharding``); nothing for ``zero=0``."""
    section, state = options.data_parallel, model.parallel_state
    if section.zero == 3:
        check_shardable(model, ctx, section.reshard_after_forward, section.mixed_precision,
                        who="data_parallel zero=3")
        state.sharding = fully_shard_layers(model, ctx, section.reshard_after_forward,
                                            section.mixed_precision)
    elif section.zero:
        state.zero = lay_out_zero(model, ctx, section.zero, options.bucket_bytes)
