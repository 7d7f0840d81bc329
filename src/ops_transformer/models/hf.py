"""What the package knows about a model's structure, in one place: whether it is a Hugging Face
``transformers`` model, the prefix of its base model, and where its Transformer layers and final
norm are. Plans, memory options, sequence parallelism and measurements all ask here.
"""

from __future__ import annotations

from torch import nn

from .gpt import GPT

# (layers, final norm) under the base model, for the families sequence parallelism supports
DECODER_LAYOUTS = {"gpt2": ("h", "ln_f"), "llama": ("layers", "norm"),
                   "mistral": ("layers", "norm"), "qwen2": ("layers", "norm")}
LAYER_LISTS = ("layers", "h", "encoder.layer")  # where Transformer blocks live, in that order


def is_hf(model: nn.Module) -> bool:
    """A Hugging Face ``transformers`` model (its ``config`` has a ``model_type``)."""
    return hasattr(model, "config") and hasattr(model.config, "model_type")


def own_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps a module's class for a subclass
    ``FSDP<Name>`` of ``(FSDPModule, <Name>)``; this is ``<Name>`` (what ``transformers`` knows, what
    a checkpoint records and an export rebuilds)."""
    cls = type(model)
    while cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 \
            and cls.__bases__[0].__name__ == "FSDPModule":
        cls = cls.__bases__[1]
    return cls


def model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def base_prefix(model: nn.Module) -> str:
    """``"transformer."`` for a GPT2LMHeadModel, ``""`` for a bare GPT2Model, and so on: the prefix
    of the base model's module names."""
    base = getattr(model, "base_model_prefix", "")
    return f"{base}." if base and isinstance(getattr(model, base, None), nn.Module) else ""


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated Transformer layers, in order: ``model.layers`` for the reference GPT; the
    decoder (``layers``, ``h``) or encoder (``encoder.layer``) blocks of a Hugging Face model."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) if is_hf(model) else None
    for owner in (model, base):
        if owner is None:
            continue
        for path in LAYER_LISTS:
            try:
                layers = owner.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(layers, nn.ModuleList) and len(layers):
                return list(layers)
    raise ValueError(f"cannot find the Transformer layers of {type(model).__name__}: expected an "
                     f"nn.ModuleList named {', '.join(LAYER_LISTS[:-1])} or {LAYER_LISTS[-1]}")


def decoder_layout(model: nn.Module) -> tuple[str, str] | None:
    """``(layers, final norm)`` module names of the reference GPT or a Hugging Face decoder whose
    layout is known (:data:`DECODER_LAYOUTS`); ``None`` for any other model."""
    if isinstance(model, GPT):
        return "layers", "norm"
    if model_type(model) in DECODER_LAYOUTS:
        layers, norm = DECODER_LAYOUTS[model_type(model)]
        return base_prefix(model) + layers, base_prefix(model) + norm
    return None
