"""Gradient-norm clipping of a parallelized model: the dense model's norm, every shard scaled alike.

``torch.nn.utils.clip_grad_norm_`` on one rank of a TP model would see a few shards and every
replicated parameter: a norm that is neither the model's nor the same on every rank, so each rank
would clip by a different factor. Here each rank adds up only what it owns of the dense gradient,
``Σ|g|ᵖ`` over:

* a TP-sharded parameter (``shard_spec``): its shard — without the zero padding rows of a padded
  vocabulary; a shard held by several replicas (K/V heads replicated over ``tp / n_kv_heads``
  ranks) only on the first of them;
* a replicated parameter (norms, biases of row-parallel layers, a replicated vocabulary): only on
  TP rank 0;
* data-parallel replicas hold equal (averaged) gradients: only data-parallel rank 0 adds anything
  (EP rank 0 too, except for expert parameters, which differ across EP ranks);
* a parameter sharded over its data-parallel ranks (ZeRO-3, FSDP2's ``DTensor``): every rank adds
  its own rows, which no other rank holds.

One all-reduce over the job then gives every rank the dense norm; every gradient is multiplied by
``clamp(max_norm / (norm + 1e-6), max=1)`` exactly as in PyTorch, so the clipped gradients are the
dense model's clipped gradients, sharded. The all-reduce has a second element: the overflow flag of
the loss scaler that unscaled these gradients (0 without one), so that ``unscale_ → clip → step``
agrees on both with one collective (:mod:`.loss_scaler`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import collectives as C
from ..parallel.sharding import data_shard_rows, local_tensor, shard_spec


def counted_on_tp_rank(param: torch.Tensor, ctx) -> bool:
    """Whether this TP rank holds the copy of ``param``'s gradient that the dense norm counts: its
    own shard (the first replica's, for replicated K/V heads), or a replicated parameter on TP
    rank 0."""
    spec = shard_spec(param)
    if spec is not None and spec.tp_size > 1:
        return spec.tp_rank % spec.replicas == 0
    return ctx.tp_rank == 0


def _counted_here(param: torch.Tensor, ctx) -> bool:
    """Whether this rank adds ``param``'s gradient to the dense norm (see the module docstring).
    (ZeRO's sharded gradients differ across dp ranks and count on each:
    :meth:`~ops_transformer.memory.zero.ZeroOptimizer.grad_norm_partial`.)"""
    if getattr(param, "pipeline_tied_copy", False):  # a tied embedding's last-stage half:
        return False  # counted once, on the first stage (parallelize/pipeline.py)
    if local_tensor(param) is not param:  # sharded over data-parallel ranks: own rows
        return counted_on_tp_rank(param, ctx)
    expert = getattr(param, "expert_shard", None) is not None  # differs across EP ranks
    return (counted_on_tp_rank(param, ctx) and ctx.dp_rank == 0 and (expert or ctx.ep_rank == 0)
            and getattr(ctx, "cp_rank", 0) == 0)  # replicated over cp, like over dp


def _real_rows(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` (this rank's local tensor of ``param``'s gradient) without the padding rows of a
    padded (vocabulary) split dimension; for a data-parallel shard of the rows, of its rows."""
    spec = shard_spec(param)
    if spec is None or not spec.padded_size:
        return grad
    local = param.shape[spec.split_dim]  # (a DTensor's shape is the tensor-parallel one)
    start = spec.shard_index * local
    real = max(0, min(local, spec.full_shape[spec.split_dim] - start))
    if spec.split_dim == 0:
        first, rows = data_shard_rows(param)
        return grad.narrow(0, 0, max(0, min(rows, real - first)))
    return grad.narrow(spec.split_dim, 0, real)


def real_rows_mask(param: torch.Tensor) -> torch.Tensor:
    """A boolean tensor shaped like ``param``: ``False`` on the padding rows of a padded split
    dimension (see :func:`_real_rows`)."""
    mask = torch.zeros(param.shape, dtype=torch.bool, device=param.device)
    _real_rows(mask, param).fill_(True)
    return mask


def params_with_grad(model_or_params) -> list[torch.Tensor]:
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) \
        else model_or_params
    return [p for p in dict.fromkeys(params) if p.grad is not None]


def grad_norm_partial(params, ctx, norm_type: float = 2.0) -> torch.Tensor:
    """This rank's share of the dense gradient norm, as a one-element float32 tensor: ``Σ|g|ᵖ``
    over what it owns (``max |g|`` for ``p = inf``). Summing the shares of every rank of the job
    (taking the max for ``inf``) gives the dense model's ``‖g‖ᵖ``."""
    parts = []
    for p in params:
        if not _counted_here(p, ctx) and not math.isinf(norm_type):
            continue
        g = _real_rows(local_tensor(p.grad).detach(), p)
        parts.append(torch.linalg.vector_norm(g, norm_type, dtype=torch.float32))
    return reduce_norm_parts(parts, norm_type, ctx.device)


def reduce_norm_parts(norms: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """``Σ normᵖ`` (``max`` for ``inf``) of per-tensor norms, as a one-element float32 tensor."""
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=device)
    stacked = torch.stack(norms)
    return (stacked.max() if math.isinf(norm_type) else (stacked ** norm_type).sum()).reshape(1)


def total_norm(reduced_partial: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
    """The norm from the job's reduced :func:`grad_norm_partial` (a 0-d float32 tensor)."""
    share = reduced_partial.reshape(())
    return share if math.isinf(norm_type) else share ** (1.0 / norm_type)


@torch.no_grad()
def clip_grads_with_norm_(params, max_norm: float, norm: torch.Tensor) -> None:
    """Multiply every gradient by ``clamp(max_norm / (norm + 1e-6), max=1)`` (PyTorch's rule)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        grad = local_tensor(p.grad)
        grad.mul_(coef.to(grad.dtype))


def check_max_norm(max_norm: float, norm_type: float) -> None:
    if not (isinstance(max_norm, (int, float)) and max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type!r}")


def clip_grad_norm_(model, max_norm: float, ctx, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a parallelized ``model`` (or of an iterable of its parameters) to a
    total ``norm_type``-norm of ``max_norm`` and return the total norm before clipping — the
    dense model's: equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Collective
    over every rank of the job: one all-reduce of two elements (the norm share, and the overflow
    flag of a loss scaler that unscaled these gradients, which it then need not reduce itself)."""
    check_max_norm(max_norm, norm_type)
    params = params_with_grad(model)
    scalers = [s for s in dict.fromkeys(getattr(local_tensor(p.grad), "unscaled_by", None)
                                        for p in params)
               if s is not None and s.awaits_agreement]
    flag = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    for scaler in scalers:
        flag = torch.maximum(flag, scaler.local_found_inf.to(flag.device))
    shares = torch.cat([grad_norm_partial(params, ctx, norm_type), flag])
    op = C.ReduceOp.MAX if math.isinf(norm_type) else C.ReduceOp.SUM  # a SUM of flags > 0 ⇔ MAX
    C.all_reduce(shares, ctx.world_group, op=op, label="grad_norm")
    for scaler in scalers:
        scaler.agree_found_inf(bool(shares[1] > 0))
    norm = total_norm(shares[:1], norm_type)
    clip_grads_with_norm_(params, max_norm, norm)
    return norm
