"""The gradient reducers ``parallelize`` builds (and ``ot.lora`` rebuilds): one ordered chain."""

from __future__ import annotations

import functools

from torch import nn

from ..comm.bucketing import partial_grad_group
from ..layers.moe import expert_shard, scale_expert_grads, split_expert_params
from ..memory.fsdp import fsdp_reducers
from ..memory.zero import zero_reducers
from ..parallel.grad_reduce import GradSums, GradSync
from ..parallel.grad_shard import FSDPGradSync, ReduceScatterGradSync
from ..parallel.state import GradReducers, parallel_state_of
from ..precision.policy import resolve_grad_reduce_dtype
from .options import ParallelOptions


def gradient_reducers(model: nn.Module, ctx, options: ParallelOptions,
                      params=None) -> GradReducers:
    """The model's gradient reductions, in the order they finish: data-parallel averaging of the
    dense parameters over ``dp × ep`` (EP ranks read different micro-batches, like DP ranks; ``× cp``
    with context parallelism, each ``cp`` rank seeing its part of the tokens) and of the experts
    over ``dp`` (``× cp``) — in the form the model's data-parallel layout needs (ZeRO-2's
    reduce-scatter, FSDP2's: :mod:`.data_parallel`) — then the sums of the partial gradients the
    plan marked. Frozen
    parameters (``requires_grad=False``: a LoRA model's base) get none; one unfrozen later is
    reduced from its first backward on (:meth:`GradReducers.watch`). ``params``: only these."""
    dtype = resolve_grad_reduce_dtype(model, options.grad_reduce_dtype)
    buckets, reducers = options.bucket_bytes, GradReducers()
    chosen = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    state = parallel_state_of(model) if params is None else None
    sharding, zero = getattr(state, "sharding", None), getattr(state, "zero", None)
    if sharding is not None:  # ZeRO-3: FSDP2 reduce-scatters what it shards (and scales experts)
        scale_expert_grads([p for p in sharding.unsharded if expert_shard(p) is not None],
                           ctx.ep_size)
        for r in fsdp_reducers(model, ctx, sharding, bucket_bytes=buckets, reduce_dtype=dtype):
            reducers.append(r)
    elif ctx.dp_ep_size * getattr(ctx, "cp_size", 1) > 1 or zero is not None:
        dense, experts = split_expert_params(chosen)
        scale_expert_grads(experts, ctx.ep_size)
        if params is not None and ctx.ep_size > 1:  # adopted late: this backward's, unscaled
            for p in experts:
                p.grad.div_(ctx.ep_size)
        sharded = zero_reducers(zero, dtype) if zero is not None else []  # ZeRO-2
        for r in sharded:
            reducers.append(r)
        if not sharded and ctx.dp_ep_size * getattr(ctx, "cp_size", 1) > 1:
            reducers.append(GradSync(dense, ctx.grad_group, bucket_bytes=buckets,
                                     reduce_dtype=dtype))
        if not sharded and experts and ctx.dp_size * getattr(ctx, "cp_size", 1) > 1:  # dp (× cp)
            reducers.append(GradSync(experts, ctx.expert_grad_group, bucket_bytes=buckets,
                                     reduce_dtype=dtype, name="dp_experts"))
    pairs = [(p, partial_grad_group(p)) for p in dict.fromkeys(chosen)
             if partial_grad_group(p) is not None
             and not getattr(p, "_sums_in_fsdp", False)]  # ZeRO-3: its unit's hook sums it
    if pairs:
        reducers.append(GradSums(pairs, dtype=dtype, bucket_bytes=buckets))
    if params is None:
        reducers.watch(model, functools.partial(_adopt_late, model, ctx, options, reducers))
    return reducers


def _adopt_late(model: nn.Module, ctx, options: ParallelOptions, chain: GradReducers,
                late: list) -> list:
    """The reducers of parameters made trainable after preparation (:meth:`GradReducers.watch`);
    refused in one line, naming them, once ZeRO laid out the data-parallel state (its buckets or
    FSDP2's units, over the parameters trainable then: ZeRO-1's optimizer would not step it)."""
    if any(isinstance(r, (ReduceScatterGradSync, FSDPGradSync)) for r in chain) or \
            getattr(parallel_state_of(model), "zero", None) is not None:
        names = [n for n, p in model.named_parameters() if any(p is q for q in late)]
        raise RuntimeError(f"{', '.join(names)}: requires_grad was turned on after ZeRO laid out "
                           f"the parameters trainable then; set it before parallelize("
                           f"data_parallel=...) / ot.zero_optimizer / ot.shard_parameters (or "
                           f"train --zero 1/2/3)")
    return list(gradient_reducers(model, ctx, options, params=late))
