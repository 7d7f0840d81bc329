"""The memory options of a training run (``train --sequence-parallel --recompute
--activation-cache --zero``): checked before any process starts, and the optimizer they imply."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..comm.bucketing import partial_grad_group
from ..layers.sequence_parallel import sequence_parallel_mode
from .apply import ACTIVATION_CACHES
from .recompute import RECOMPUTE
from .zero import zero_optimizer

ZERO_STAGES = (0, 1, 2)


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
        raise ValueError(f"--zero must be 0, 1 or 2, got {cfg.zero!r}")
    if cfg.zero and dp == 1:
        raise ValueError(f"--zero {cfg.zero} shards the optimizer over data-parallel ranks, but "
                         f"dp is 1: run more processes than --tp ({tp}), or drop --zero")
    if cfg.zero and getattr(cfg, "ep", 1) > 1:
        raise ValueError(f"--zero with --ep {cfg.ep} is not supported: expert parameters average "
                         f"over another group than the dense ones; drop --zero or --ep")
    try:
        sequence_parallel_mode(cfg.sequence_parallel)
    except ValueError:
        raise ValueError(f"--sequence-parallel takes no value (the gathered region inputs kept "
                         f"for backward) or 'regather' (only this rank's slice kept, all-gathered "
                         f"again in backward), got {cfg.sequence_parallel!r}") from None
    if cfg.sequence_parallel and getattr(cfg.model_config(), "n_experts", 0) > 0:
        raise ValueError(f"--sequence-parallel is not supported for the MoE preset "
                         f"{cfg.preset!r}: its expert layers have no sequence-parallel form")
    if cfg.sequence_parallel:
        if tp == 1:
            raise ValueError("--sequence-parallel splits the sequence over tensor-parallel ranks, "
                             "but tp is 1: set --tp 2 or more, or drop --sequence-parallel")
        if cfg.seq % tp:
            raise ValueError(f"--sequence-parallel splits the sequence over tp ({tp}) ranks: "
                             f"the sequence length s ({cfg.seq}) must be divisible by tp ({tp})")
        if cfg.attention not in ("auto", "heads"):
            raise ValueError(f"--sequence-parallel needs --attention heads (or auto), got "
                             f"{cfg.attention!r}")
    if cfg.recompute == "selective" and cfg.attention == "kv_split" and tp > 1:
        raise ValueError("--recompute selective replays the attention core, which "
                         "--attention kv_split spreads over the ranks with communication: use "
                         "--recompute full or another attention strategy")


def make_optimizer(model: nn.Module, ctx, zero: int, **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters, sharded with ZeRO ``zero`` (1 or 2) when non-zero."""
    if zero:
        return zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, **adamw_kwargs)
    return torch.optim.AdamW(model.parameters(), **adamw_kwargs)


def memory_from_plan(layout: dict, path: str) -> dict:
    """``sequence_parallel``, ``recompute`` and ``zero`` of a planner layout (``train --plan``).
    What train cannot run is changed with a warning: ZeRO-3 runs as ZeRO-2 (the parameters stay
    whole), and sequence parallelism is dropped for attention strategies without a
    sequence-parallel form."""
    zero = layout.get("zero_stage", 0)
    if zero == 3:
        warnings.warn(f"--plan {path!r} uses ZeRO-3, which train does not run (parameters are not "
                      f"sharded): running ZeRO-2; parameter memory will be higher than planned",
                      stacklevel=3)
        zero = 2
    if zero not in ZERO_STAGES:
        raise ValueError(f"--plan {path!r} has zero_stage {zero!r}; expected 0, 1, 2 or 3")
    recompute = layout.get("recompute", "none")
    if recompute not in RECOMPUTE:
        raise ValueError(f"--plan {path!r} has recompute {recompute!r}; expected one of "
                         f"{', '.join(RECOMPUTE)}")
    sequence_parallel = bool(layout.get("sequence_parallel", False))
    if sequence_parallel and layout.get("attention", "heads") not in ("auto", "heads"):
        warnings.warn(f"--plan {path!r} combines sequence parallelism with attention="
                      f"{layout['attention']!r}, which has no sequence-parallel form: running "
                      f"without sequence parallelism; activation memory will be higher than "
                      f"planned", stacklevel=3)
        sequence_parallel = False
    return {"sequence_parallel": sequence_parallel, "recompute": recompute, "zero": zero}


def partial_numel(model: nn.Module, group) -> int:
    """Elements of the parameters whose partial gradients are summed over ``group`` (sequence
    parallelism's norms and row biases on the TP group)."""
    return sum(p.numel() for p in dict.fromkeys(model.parameters())
               if group is not None and partial_grad_group(p) is group)


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
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    params = list(dict.fromkeys(model.parameters()))
    state = [v for s in getattr(optimizer, "state", {}).values() for v in s.values()]
    return {"params": total(params), "grads": total(p.grad for p in params),
            "optimizer": total(state)}
