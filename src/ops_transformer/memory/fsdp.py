"""ZeRO-3 through FSDP2: a tensor-parallel model's parameters sharded over its data-parallel ranks.

:func:`shard_parameters` applies ``torch.distributed.fsdp.fully_shard`` to each Transformer layer
and to the root of a model that :func:`~ops_transformer.parallelize` has split over ``tp`` — the
2-D ``dp × tp`` layout torchtitan uses. Each rank keeps ``1/n`` of its tensor-parallel shards
(dim 0, padded like ``torch.chunk``), over the parameter's data-parallel group of ``n`` ranks, a
one-dimensional sub-mesh of ``ctx.mesh`` (:meth:`~ops_transformer.parallel.ParallelContext.data_mesh`):

=========================== ============ ===================================================
parameters                  group        FSDP unit
=========================== ============ ===================================================
experts (``expert_shard``)  ``dp``       the experts' module of each layer, its own unit;
                            (``× cp``)   gradients divided by ``dp·ep·cp`` (the EP ranks'
                                         tokens were summed by the all-to-all)
dense (everything else)     ``dp × ep``  each Transformer layer; the LM head (unless tied to
                                         the embeddings); the root (embeddings, final norm)
partial gradients of norms  ``dp × ep``  each norm its own unit: FSDP2 reduce-scatters the
(sequence parallelism)                   gradient over dp, its all-reduce hook sums the shard
                                         over TP (``fsdp_partial_sums``), one call per norm
other partial gradients     ``—``        not sharded: averaged by the chain's ``GradSync``
(a row layer's bias under                and summed over TP by its ``GradSums``, as before
SP, KV replicas, LoRA's
replicated factors)
=========================== ============ ===================================================

FSDP2 all-gathers a unit's parameters before its forward (and again before its backward when it
``reshard_after_forward``), reduce-scatters its gradients after its backward and keeps only the
shard — a ``DTensor`` on the data mesh whose local tensor is this rank's rows. Our own
data-parallel averaging steps aside for the sharded parameters (:class:`FSDPGradSync` takes its
place in the model's reducer chain, so :func:`~ops_transformer.no_sync` pauses FSDP2 too); the
tensor-parallel side is untouched: the layers' collectives over ``tp`` run as before, on the
unsharded parameters. FSDP2's collectives run through ours (:mod:`ops_transformer.comm.fsdp_comm`:
ledger labels ``fsdp_params``, ``fsdp_grads``, on the data-parallel group only).

Every public attribute of a parameter (``shard_spec``, ``expert_shard``, …) is copied to its
sharded ``DTensor``, so clipping, checkpoints and gathering know each shard's place in the dense
tensor. An optimizer built after sharding (a plain ``torch.optim`` one) holds ``1/n`` of the state.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.bucketing import DEFAULT_BUCKET_BYTES, partial_grad_group
from ..comm.fsdp_comm import LedgerAllGather, LedgerReduceScatter
from ..layers.moe import expert_shard
from ..models.hf import transformer_layers
from ..parallel.grad_reduce import GradSums, GradSync
from ..parallel.grad_shard import FSDPGradSync
from ..parallel.state import DataSharding, parallel_state_of

# The final norm under SP is its own unit (a partial gradient) whose output is the sequence
# all-gather's view; FSDP2 warns that an in-place op on such a view would skip its pre-backward
# hook. Nothing writes into it in place (the LM head reads it), so this one warning is noise.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGatherSequenceOutput",
                        category=UserWarning)

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch without FSDP2
    FSDPModule = MixedPrecisionPolicy = fully_shard = None


def shard_parameters(model: nn.Module, ctx, *, reshard_after_forward: bool = True,
                     mixed_precision=None) -> nn.Module:
    """Shard ``model``'s parameters over its data-parallel ranks with FSDP2 (ZeRO-3; see the
    module docstring), in place; return the model. Call it after
    :func:`~ops_transformer.parallelize` and before building the optimizer.

    ``reshard_after_forward``: free each layer's gathered parameters after its forward and gather
    them again for its backward (``True``: ZeRO-3's memory), or keep them until the end of backward
    (``False``: one all-gather per unit and step, the memory of ZeRO-2). ``mixed_precision``: an
    FSDP2 ``MixedPrecisionPolicy`` (e.g. ``param_dtype=torch.bfloat16, reduce_dtype=
    torch.float32``): the parameters are gathered and computed in ``param_dtype`` while the shards
    the optimizer steps stay in their own dtype (fp32 masters)."""
    state = check_shardable(model, ctx, reshard_after_forward, mixed_precision)
    state.sharding = fully_shard_layers(model, ctx, reshard_after_forward, mixed_precision)
    buckets = getattr(state.options, "bucket_bytes", DEFAULT_BUCKET_BYTES)
    state.reducers.replace_averaging(fsdp_reducers(model, ctx, state.sharding,
                                     bucket_bytes=buckets,
                                     reduce_dtype=_reduce_dtype(state.reducers)))
    sums = state.reducers.get("partial_sums")
    if sums is not None:  # the TP sums left to GradSums: those FSDP2's hooks do not run
        pairs = [(p, partial_grad_group(p)) for p in dict.fromkeys(model.parameters())
                 if p.requires_grad and partial_grad_group(p) is not None
                 and not getattr(p, "_sums_in_fsdp", False)]
        state.reducers.replace(sums, [GradSums(pairs, dtype=sums.dtype, bucket_bytes=buckets)]
                               if pairs else [])
    return model


def fully_shard_layers(model: nn.Module, ctx, reshard_after_forward: bool = True,
                       mixed_precision=None) -> DataSharding:
    """The FSDP2 units of :func:`shard_parameters` (each layer's experts, each layer, the LM head,
    the root), the gradient reducers left as they are; what was sharded."""
    partial_units = _partial_modules(model)
    summed = {id(p) for module, _ in partial_units for p in module.parameters()}
    unsharded = tuple(p for p in _unsharded(model, ctx) if id(p) not in summed)
    common = {"reshard_after_forward": reshard_after_forward,
              "mp_policy": mixed_precision or MixedPrecisionPolicy(),
              "ignored_params": set(unsharded)}
    attributes = _public_attributes(model)
    with torch.no_grad():  # FSDP2 shards contiguous tensors (a Conv1D's shard is a transpose)
        for p in model.parameters():
            if not p.is_contiguous() and p not in common["ignored_params"]:
                p.data = p.data.contiguous()
    units = []
    for module, group in partial_units:  # inside the layers: sharded before them (bottom-up)
        unit = fully_shard(module, mesh=ctx.data_mesh(), **common)
        unit.set_all_reduce_hook(functools.partial(_sum_over, group=group))
        units.append(unit)
    state = parallel_state_of(model)
    roots = getattr(state, "pipeline_modules", None) or (model,)  # pp: each stage is a root
    for layer in transformer_layers(model):
        if not any(True for _ in layer.parameters()):  # a layer another pipeline stage holds
            continue
        if ctx.ep_size > 1 and ctx.dp_size > 1:  # experts over dp, the rest over dp × ep
            for module in _expert_modules(layer):
                unit = fully_shard(module, mesh=ctx.data_mesh(experts=True), **common)
                unit.set_gradient_divide_factor(float(ctx.dp_size * ctx.ep_size * ctx.cp_size))
                units.append(unit)
        units.append(fully_shard(layer, mesh=ctx.data_mesh(), **common))
    head = _head(model, common["ignored_params"])
    if head is not None:  # its own unit: gathered last in forward, reduced first in backward
        units.append(fully_shard(head, mesh=ctx.data_mesh(), **common))
    units += [fully_shard(root, mesh=ctx.data_mesh(), **common) for root in roots]
    for unit in units:
        unit.set_custom_all_gather(LedgerAllGather())
        unit.set_custom_reduce_scatter(LedgerReduceScatter())
        unit.set_force_sum_reduction_for_comms(True)
    _restore_attributes(model, attributes)
    for module, _ in partial_units:
        for p in module.parameters():
            p._sums_in_fsdp = True  # its TP sum is the unit's hook: not GradSums'
    return DataSharding(tuple(units), unsharded, reshard_after_forward, mixed_precision)


def _partial_modules(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """``[(module, group)]``: the normalisation modules (a class named ``*Norm*``: the SP norms)
    every parameter of which has a partial gradient over one ``group`` (``mark_partial_grad``),
    outside the experts; each becomes an FSDP2 unit whose all-reduce hook sums its
    reduce-scattered gradient over ``group``. Only modules whose own ``forward`` runs can be units
    (FSDP2 gathers in their forward hooks): a column layer of KV replicas may be fed by its
    region's collective matmul, and a LoRA factor is read by its layer, so those stay whole."""
    found, taken = [], set()
    for module in model.modules():
        params = list(module.parameters())
        if (not params or any(id(p) in taken for p in params)
                or not any("Norm" in k.__name__ for k in type(module).__mro__)):
            continue
        groups = {id(partial_grad_group(p)) for p in params}
        if (len(groups) != 1 or partial_grad_group(params[0]) is None
                or any(expert_shard(p) is not None for p in params)):
            continue
        found.append((module, partial_grad_group(params[0])))
        taken.update(id(p) for p in params)
    return found


def _sum_over(reduce_output: torch.Tensor, group) -> None:
    """FSDP2's all-reduce hook of a partial-gradient unit: this backward's reduce-scattered
    gradient shard summed over the parameters' partial group, before it is accumulated (the
    same rows on every rank of ``group``: the layout over dp is the same on each)."""
    C.all_reduce(reduce_output, group, label="fsdp_partial_sums")


def check_shardable(model: nn.Module, ctx, reshard_after_forward, mixed_precision, *,
                    who: str = "shard_parameters"):
    """The model's parallel state, or a ``ValueError`` saying why it cannot be sharded."""
    if fully_shard is None or not hasattr(FSDPModule, "set_custom_all_gather"):
        raise RuntimeError(f"{who} needs FSDP2 with custom collectives "
                           f"(torch >= 2.8); this is torch {torch.__version__}")
    state = parallel_state_of(model)
    if state is None or state.plan is None:
        raise ValueError("shard_parameters shards a parallelised model: call "
                         "parallelize(model, ctx) first (at tp 1 too), then shard_parameters, "
                         "then build the optimizer")
    if state.sharding is not None:
        raise ValueError(f"{who}: this model's parameters are already sharded")
    if ctx.dp_ep_size * ctx.cp_size == 1:
        raise ValueError(f"{who} shards over the data-parallel ranks, but dp "
                         f"({ctx.dp_size}) × ep ({ctx.ep_size}) is 1: run more processes than "
                         f"tp ({ctx.tp_size})")  # (and cp is 1: cp ranks shard too)
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True or False, got "
                         f"{reshard_after_forward!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise ValueError(f"mixed_precision must be None or a torch.distributed.fsdp."
                         f"MixedPrecisionPolicy, got {mixed_precision!r}")
    if any(getattr(p, "_zero_bucketed", False) for p in model.parameters()):
        raise ValueError(f"{who}: a ZeRO optimizer already holds this model's "
                         "parameters; shard first, then build a plain torch.optim optimizer")
    return state


def _unsharded(model: nn.Module, ctx) -> list[nn.Parameter]:
    """The parameters left whole: partial gradients (their TP sums run on the whole tensor), and
    experts when there is no ``dp`` to shard them over (each EP rank holds its own)."""
    return [p for p in dict.fromkeys(model.parameters())
            if partial_grad_group(p) is not None
            or (expert_shard(p) is not None and ctx.ep_size > 1 and ctx.dp_size == 1)]


def _head(model: nn.Module, ignored) -> nn.Module | None:
    """The LM head (``lm_head``, or a Hugging Face model's output embeddings), when it shares no
    parameter with the rest of the model (tied embeddings stay in the root's unit) and has one to
    shard."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or head is model:
        return None
    own = {id(p) for p in head.parameters()}
    inside = {id(m) for m in head.modules()}
    elsewhere = {id(p) for m in model.modules() if id(m) not in inside
                 for p in m.parameters(recurse=False)}
    if not own or own & elsewhere or all(p in ignored for p in head.parameters()):
        return None
    return head


def _expert_modules(layer: nn.Module) -> list[nn.Module]:
    return [m for m in layer.modules()
            if any(expert_shard(p) is not None for p in m.parameters(recurse=False))]


def _public_attributes(model: nn.Module) -> dict[tuple[int, str], dict]:
    return {(id(m), name): {k: v for k, v in vars(p).items() if not k.startswith("_")}
            for m in model.modules() for name, p in m.named_parameters(recurse=False)}


def _restore_attributes(model: nn.Module, attributes: dict) -> None:
    """Copy each parameter's public attributes onto the ``DTensor`` FSDP2 registered instead."""
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            for key, value in attributes.get((id(m), name), {}).items():
                if not hasattr(p, key):
                    setattr(p, key, value)


def fsdp_reducers(model: nn.Module, ctx, sharding: DataSharding, *, bucket_bytes: int,
                  reduce_dtype=None) -> list:
    """The data-parallel reducers of a sharded model: FSDP2's reduce-scatters
    (:class:`FSDPGradSync`), then the averaging of the dense parameters left whole (partial
    gradients, over ``dp × ep``); the experts left whole (``dp = 1``) need averaging only over
    ``cp`` (replicated there)."""
    new = [FSDPGradSync(model, sharding.units)]
    dense = [p for p in sharding.unsharded if expert_shard(p) is None]
    experts = [p for p in sharding.unsharded if expert_shard(p) is not None]
    if dense:
        new.append(GradSync(dense, ctx.grad_group, bucket_bytes=bucket_bytes,
                            reduce_dtype=reduce_dtype))
    if experts and getattr(ctx, "cp_size", 1) > 1:  # whole experts (dp 1), replicated over cp
        new.append(GradSync(experts, ctx.expert_grad_group, bucket_bytes=bucket_bytes,
                            reduce_dtype=reduce_dtype, name="dp_experts"))
    return new


def _reduce_dtype(reducers):
    sync = reducers.get("dp")
    return getattr(sync, "reduce_dtype", None)


def sharding_of(model: nn.Module) -> DataSharding | None:
    """The model's :class:`~ops_transformer.parallel.state.DataSharding`, or ``None``."""
    state = parallel_state_of(model)
    return None if state is None else state.sharding


def mixed_precision_for(policy) -> object | None:
    """The FSDP2 ``MixedPrecisionPolicy`` of a precision policy (``train --precision``): for bf16
    and fp16, parameters gathered and computed in the compute dtype, gradients reduced in
    ``grad_reduce_dtype`` (float32), the residual stream left to autocast (no input cast);
    ``None`` for fp32."""
    if policy.compute_dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=policy.compute_dtype,
                                reduce_dtype=policy.grad_reduce_dtype, cast_forward_inputs=False)
