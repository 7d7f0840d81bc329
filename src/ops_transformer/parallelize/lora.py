"""``ot.lora(model, ctx, rank=…)``: LoRA adapters on a parallelised model, every other weight frozen.

The adapters themselves, their sharding and why they add no collective are in
:mod:`ops_transformer.layers.lora`. Here: which layers get one (``targets``), the one generator
they are drawn from (so tp 1, 2 and 4 start from the same adapter), freezing the rest, and the
model's gradient reducers rebuilt over the adapters alone — data-parallel averaging of the
adapters, and one coalesced all-reduce per backward of the replicated factors' partial gradients
(``GradSums``, with any other partial gradient of the same group).
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..layers.lora import SUPPORTED, adapter_kind, add_adapter, dense_dims, is_conv1d
from ..models.hf import is_hf, transformer_layers
from ..parallel.grad_shard import ReduceScatterGradSync
from .reducers import gradient_reducers
from .options import ParallelOptions, check_lora_args

log = logging.getLogger("ops_transformer")
_WILDCARDS = "*?["


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters :func:`lora` added (``model.parallel_state.lora``; checkpoints record it).

    ``targets``: the adapted modules' names, in model order; ``fan_in_fan_out``: some target is a
    GPT-2 ``Conv1D`` (PEFT's flag of that name); ``base``: what the adapters belong to — for a
    Hugging Face model the directory it was loaded from (``{"model_dir": …}``), for a preset the
    seed of its initialisation (``{"preset": …, "seed": …}``), or ``None``."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    seed: int = 0
    fan_in_fan_out: bool = False
    base: dict | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets), "scaling": self.scaling}


def lora(model: nn.Module, ctx, *, rank: int, alpha: float | None = None, targets=None,
         dropout: float = 0.0, seed: int = 0, base: dict | None = None) -> nn.Module:
    """Add a LoRA adapter ``W x + (alpha/rank) · B A x`` to each targeted linear of ``model`` (a
    model :func:`~ops_transformer.parallelize` prepared: the reference GPT or a Hugging Face
    model, at any tp), freeze every other parameter, and return the model (changed in place).

    ``targets``: module names or ``fnmatch`` patterns (``"*.q_proj"``), one string or several;
    default: every linear of the attention and the FFN of each Transformer layer (not the experts
    or routers of an MoE layer). ``alpha=None`` means ``alpha = rank``. ``dropout`` applies to the
    adapter's input (PEFT's ``lora_dropout``). ``seed``: the generator the factors are drawn from
    in dense coordinates (``A`` Kaiming-uniform, ``B`` zero, as PEFT), whatever the tp.
    ``base``: what the adapters belong to, recorded in checkpoints (:class:`LoRAConfig`).
    Build the optimizer afterwards: only the adapters then get gradients and optimizer state."""
    state = getattr(model, "parallel_state", None)
    if state is None:
        raise ValueError("lora needs a model prepared by parallelize (model.parallel_state is not "
                         "set): call ot.parallelize(model, ctx) first, at any tp")
    if state.lora is not None:
        raise ValueError(f"this model already has LoRA adapters (rank {state.lora.rank} on "
                         f"{len(state.lora.targets)} modules)")
    if getattr(state, "sharding", None) is not None:
        raise ValueError("lora must come before shard_parameters (and is untested with it): "
                         "FSDP2 has already sharded the parameters lora would change")
    if state.pipeline_stages is not None:
        raise ValueError("lora must come before pipeline: its factors are drawn in the dense "
                         "model's order of layers, which a model split into stages lacks")
    if getattr(state, "zero", None) is not None or \
            any(isinstance(r, ReduceScatterGradSync) for r in state.reducers):
        raise ValueError("lora must come before zero_optimizer (ZeRO's buckets are laid out over "
                         "the parameters that train, which lora changes): pass "
                         "parallelize(..., lora={...}, data_parallel={...}) or call lora first")
    config = add_lora(model, ctx, rank=rank, alpha=alpha, targets=targets, dropout=dropout,
                      seed=seed, base=base)
    for reducer in state.reducers:
        reducer.remove()
    state.reducers = gradient_reducers(model, ctx, state.options or ParallelOptions())
    state.lora = config
    return model


def add_lora(model: nn.Module, ctx, *, rank: int, alpha: float | None = None, targets=None,
             dropout: float = 0.0, seed: int = 0, base: dict | None = None) -> LoRAConfig:
    """The adapters of :func:`lora`, every other parameter frozen; the gradient reducers are the
    caller's (``parallelize`` builds them afterwards, :func:`lora` rebuilds them)."""
    alpha = check_lora_args(rank, alpha, dropout)
    names = resolve_targets(model, targets)
    check_rank(model, names, rank)
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    generator = torch.Generator().manual_seed(seed)  # the adapters in dense coordinates
    modules = [model.get_submodule(n) for n in names]
    fan_in_fan_out = any(is_conv1d(m) for m in modules)
    for module in modules:
        add_adapter(module, ctx, rank=rank, alpha=alpha, dropout=dropout, generator=generator)
    log.info("lora: rank %d, alpha %g on %d modules, %d trainable parameters on this rank",
             rank, alpha, len(names), sum(p.numel() for p in model.parameters()
                                          if p.requires_grad))
    return LoRAConfig(rank, float(alpha), tuple(names), float(dropout), seed, fan_in_fan_out,
                      base if base is not None else _base_of(model))


def check_rank(model: nn.Module, names: list[str], rank: int) -> None:
    """``rank`` at most every target's smaller dimension (a larger one adds no expressiveness)."""
    for name in names:
        in_features, out_features = dense_dims(model.get_submodule(name))
        if rank > min(in_features, out_features):
            raise ValueError(f"lora: rank ({rank}) exceeds the smaller dimension of {name} "
                             f"(in_features {in_features}, out_features {out_features}): choose a "
                             f"rank of at most {min(in_features, out_features)}")


def resolve_targets(model: nn.Module, targets) -> list[str]:
    """The names of the modules ``targets`` selects, in model order (see :func:`lora`)."""
    modules = dict(model.named_modules())
    if targets is None:
        chosen = set(default_targets(model))
    else:
        if isinstance(targets, str):
            targets = [targets]
        chosen = set()
        for target in targets:
            chosen.update(_match(model, modules, target))
    return [name for name in modules if name in chosen]


def _match(model, modules: dict[str, nn.Module], target: str) -> list[str]:
    if not isinstance(target, str) or not target:
        raise ValueError(f"lora: a target must be a module name or an fnmatch pattern, got "
                         f"{target!r}")
    if not any(c in target for c in _WILDCARDS):
        if target not in modules:
            hint = (f"; did you mean '*.{target}'?"
                    if any(n.endswith("." + target) for n in modules) else "")
            raise ValueError(f"lora: target {target!r} matches no module of "
                             f"{type(model).__name__}{hint}")
        _check_supported(model, target, modules[target])
        return [target]
    hits = [n for n in modules if n and fnmatch.fnmatchcase(n, target)]
    linear = [n for n in hits if _adaptable(model, modules[n])]
    if not linear:
        if not hits:
            raise ValueError(f"lora: target pattern {target!r} matches no module of "
                             f"{type(model).__name__}")
        kinds = sorted({type(modules[n]).__name__ for n in hits})
        raise ValueError(f"lora: target pattern {target!r} matches {len(hits)} module(s), none "
                         f"of a type LoRA supports ({', '.join(kinds)}); LoRA adapts {SUPPORTED}")
    return linear


def _adaptable(model: nn.Module, module: nn.Module) -> bool:
    return adapter_kind(module) is not None and not _is_head(model, module)


def _is_head(model: nn.Module, module: nn.Module) -> bool:
    heads = getattr(model, "get_output_embeddings", None)
    return callable(heads) and heads() is module


def _check_supported(model: nn.Module, name: str, module: nn.Module) -> None:
    if _is_head(model, module):
        raise ValueError(f"lora: {name} is the LM head, which LoRA does not adapt (under tensor "
                         f"parallelism it is vocabulary-parallel); target the attention and FFN "
                         f"linears")
    if adapter_kind(module) is None:
        raise ValueError(f"lora: {name} ({type(module).__name__}) is a layer type LoRA does "
                         f"not support; LoRA adapts {SUPPORTED}")


def default_targets(model: nn.Module) -> list[str]:
    """Every adaptable linear inside the Transformer layers, except in MoE blocks (their
    experts and routers)."""
    try:
        layers = {id(m) for m in transformer_layers(model)}
    except ValueError as exc:
        raise ValueError(f"lora: no default targets for {type(model).__name__} ({exc}); pass "
                         f"targets= (module names or fnmatch patterns)") from None
    names, layer_names = [], [n for n, m in model.named_modules() if id(m) in layers]
    for name, module in model.named_modules():
        inside = any(name.startswith(layer + ".") for layer in layer_names)
        if inside and _adaptable(model, module) and not _in_moe(model, name):
            names.append(name)
    if not names:
        raise ValueError(f"lora: {type(model).__name__}'s Transformer layers have no linear LoRA "
                         f"supports; pass targets=")
    return names


def _in_moe(model: nn.Module, name: str) -> bool:
    parts = name.split(".")
    return any(hasattr(model.get_submodule(".".join(parts[:i])), "experts")
               for i in range(1, len(parts)))


def _base_of(model: nn.Module) -> dict | None:
    """A Hugging Face model's directory (``config._name_or_path``), when it is one."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None) if is_hf(model) else None
    return {"model_dir": str(Path(path).resolve())} if path and Path(path).is_dir() else None
