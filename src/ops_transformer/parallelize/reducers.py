"""The gradient reducers ``parallelize`` builds (and ``ot.lora`` rebuilds): one ordered chain."""

from __future__ import annotations

import functools

from torch import nn

from ..comm.bucketing import partial_grad_group
from ..layers.moe import scale_expert_grads, split_expert_params
from ..parallel.grad_reduce import GradSums, GradSync
from ..parallel.grad_shard import FSDPGradSync, ReduceScatterGradSync
from ..parallel.state import GradReducers
from ..precision.policy import resolve_grad_reduce_dtype
from .options import ParallelOptions


def gradient_reducers(model: nn.Module, ctx, options: ParallelOptions,
                      params=None) -> GradReducers:
    """The model's gradient reductions, in the order they finish: data-parallel averaging of the
    dense parameters over ``dp × ep`` (EP ranks read different micro-batches, like DP ranks; ``× cp``
    with context parallelism, each ``cp`` rank seeing its part of the tokens) and of the experts
    over ``dp`` (``× cp``), then the sums of the partial gradients the plan marked. Frozen
    parameters (``requires_grad=False``: a LoRA model's base) get none; one unfrozen later is
    reduced from its first backward on (:meth:`GradReducers.watch`). ``params``: only these."""
    dtype = resolve_grad_reduce_dtype(model, options.grad_reduce_dtype)
    buckets, reducers = options.bucket_bytes, GradReducers()
    chosen = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    if ctx.dp_ep_size * getattr(ctx, "cp_size", 1) > 1:
        dense, experts = split_expert_params(chosen)
        scale_expert_grads(experts, ctx.ep_size)
        if params is not None and ctx.ep_size > 1:  # adopted late: this backward's, unscaled
            for p in experts:
                p.grad.div_(ctx.ep_size)
        reducers.append(GradSync(dense, ctx.grad_group, bucket_bytes=buckets, reduce_dtype=dtype))
        if experts and ctx.dp_size * getattr(ctx, "cp_size", 1) > 1:  # over dp (× cp)
            reducers.append(GradSync(experts, ctx.expert_grad_group, bucket_bytes=buckets,
                                     reduce_dtype=dtype, name="dp_experts"))
    pairs = [(p, partial_grad_group(p)) for p in dict.fromkeys(chosen)
             if partial_grad_group(p) is not None]
    if pairs:
        reducers.append(GradSums(pairs, dtype=dtype, bucket_bytes=buckets))
    if params is None:
        reducers.watch(model, functools.partial(_adopt_late, model, ctx, options, reducers))
    return reducers


def _adopt_late(model: nn.Module, ctx, options: ParallelOptions, chain: GradReducers,
                late: list) -> list:
    """The reducers of parameters made trainable after preparation (:meth:`GradReducers.watch`);
    refused in one line, naming them, once the data-parallel state is sharded (ZeRO-2/3 built it
    over the parameters trainable then)."""
    if any(isinstance(r, (ReduceScatterGradSync, FSDPGradSync)) for r in chain):
        names = [n for n, p in model.named_parameters() if any(p is q for q in late)]
        raise RuntimeError(f"{', '.join(names)}: requires_grad was turned on after ZeRO sharded "
                           f"the gradients over the parameters trainable then; set it before "
                           f"ot.zero_optimizer / ot.shard_parameters (or train --zero 2/3)")
    return list(gradient_reducers(model, ctx, options, params=late))
