"""The memory options of a training run (``train --sequence-parallel --recompute
--activation-cache --zero``): checked before any process starts, and the optimizer they imply."""

from __future__ import annotations

import torch
from torch import nn

from ..comm.bucketing import partial_grad_group
from ..layers.sequence_parallel import sequence_parallel_mode
from ..parallel.sharding import local_tensor
from ..planner.runnable import ZERO_STAGES, runtime_problem
from ..memory.apply import ACTIVATION_CACHES
from ..memory.fsdp import mixed_precision_for, shard_parameters
from ..memory.recompute import RECOMPUTE
from ..memory.zero import zero_optimizer


def check_memory_flags(cfg, dp: int, tp: int) -> None:
    """Validate ``cfg.sequence_parallel``, ``recompute``, ``activation_cache`` and ``zero`` of a
    :class:`~ops_transformer.train.TrainConfig` against the layout ``dp × tp``."""
    if cfg.recompute not in RECOMPUTE:
        raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got "
                         f"{cfg.recompute!r}")
    if cfg.activation_cache not in ACTIVATION_CACHES:
        raise ValueError(f"--activation-cache must be one of {', '.join(ACTIVATION_CACHES)}, got "
                         f"{cfg.activation_cache!r}")
    if cfg.zero not in ZERO_STAGES:
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero!r}")
    try:
        sequence_parallel_mode(cfg.sequence_parallel)
    except ValueError:
        raise ValueError(f"--sequence-parallel takes no value (the gathered region inputs kept "
                         f"for backward) or 'regather' (only this rank's slice kept, all-gathered "
                         f"again in backward), got {cfg.sequence_parallel!r}") from None
    model = f"the MoE preset {cfg.preset!r}"
    problem = runtime_problem(tp=tp, dp=dp, ep=getattr(cfg, "ep", 1), pp=getattr(cfg, "pp", 1),
                              cp=getattr(cfg, "cp", 1), attention=cfg.attention,
                              sequence_parallel=bool(cfg.sequence_parallel),
                              recompute=cfg.recompute, zero_stage=cfg.zero,
                              experts=getattr(cfg.model_config(), "n_experts", 0) or 1,
                              seq=cfg.seq, model=model)
    if problem:  # the planner's search applies the same rule
        raise ValueError(problem)


def shard_for_zero(model: nn.Module, ctx, zero: int, policy=None) -> nn.Module:
    """ZeRO-3 (``zero == 3``): ``model``'s parameters sharded over its data-parallel ranks
    (:func:`~.fsdp.shard_parameters`; with a 16-bit precision ``policy``, gathered and computed
    in its dtype over fp32 master shards); other stages leave the model as it is."""
    if zero == 3:
        shard_parameters(model, ctx, mixed_precision=None if policy is None
                         else mixed_precision_for(policy))
    return model


def make_optimizer(model: nn.Module, ctx, zero: int, **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters (a LoRA model: its adapters), sharded with
    ZeRO ``zero``: 1 or 2 through :func:`~.zero.zero_optimizer`; 3 (a model :func:`shard_for_zero`
    sharded) a plain AdamW, whose state is sharded with the parameters it steps."""
    if zero in (1, 2):
        return zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, **adamw_kwargs)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw_kwargs)


def memory_from_plan(layout: dict, path: str) -> dict:
    """``sequence_parallel``, ``recompute`` and ``zero`` of a planner layout (``train --plan``),
    ZeRO-3 included, run as written: a combination train cannot run (sequence parallelism with an
    attention strategy that has no sequence-parallel form, …: :func:`~ops_transformer.planner.
    runnable.runtime_problem`, the rule the planner's search applies) is refused, never changed."""
    zero = layout.get("zero_stage", 0)
    if zero not in ZERO_STAGES:
        raise ValueError(f"--plan {path!r} has zero_stage {zero!r}; expected 0, 1, 2 or 3")
    recompute = layout.get("recompute", "none")
    if recompute not in RECOMPUTE:
        raise ValueError(f"--plan {path!r} has recompute {recompute!r}; expected one of "
                         f"{', '.join(RECOMPUTE)}")
    sequence_parallel = bool(layout.get("sequence_parallel", False))
    problem = runtime_problem(tp=layout.get("tp", 1), dp=layout.get("dp", 1),
                              ep=layout.get("ep", 1), cp=layout.get("cp", 1),
                              attention=layout.get("attention", "heads"),
                              sequence_parallel=sequence_parallel, recompute=recompute,
                              zero_stage=zero)
    if problem:
        raise ValueError(f"--plan {path!r} cannot run as written: {problem} (train runs a plan as "
                         f"it is or not at all; plans from this version's planner always run)")
    return {"sequence_parallel": sequence_parallel, "recompute": recompute, "zero": zero}


def partial_numel(model: nn.Module, group) -> int:
    """Elements of the parameters whose partial gradients are summed over ``group`` (sequence
    parallelism's norms and row biases on the TP group; a LoRA model's replicated factors); a
    frozen parameter has no gradient to sum."""
    return sum(p.numel() for p in dict.fromkeys(model.parameters())
               if group is not None and p.requires_grad and partial_grad_group(p) is group)


def memory_summary(config: dict) -> str:
    """``"sequence parallel, recompute=full, int8 cache, ZeRO-2"`` for a run's config, or ``""``."""
    sp = config.get("sequence_parallel")
    parts = [f"sequence parallel{' (regather)' if sp == 'regather' else ''}"] if sp else []
    if config.get("recompute", "none") != "none":
        parts.append(f"recompute={config['recompute']}")
    if config.get("activation_cache", "none") != "none":
        parts.append(f"{config['activation_cache']} activation cache")
    if config.get("zero"):
        parts.append(f"ZeRO-{config['zero']}")
    return ", ".join(parts)


def measured_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}``: the bytes this rank holds of each, counted from the
    tensors themselves (each storage once: tied weights, views). Call it after ``step`` and
    before ``zero_grad``, while the gradients exist."""
    def total(tensors) -> int:
        storages = {}
        for t in tensors:
            t = local_tensor(t) if isinstance(t, torch.Tensor) else t  # (a shard's own rows)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    params = list(dict.fromkeys(model.parameters()))
    state = [v for s in getattr(optimizer, "state", {}).values() for v in s.values()]
    return {"params": total(params), "grads": total(p.grad for p in params),
            "optimizer": total(state)}
