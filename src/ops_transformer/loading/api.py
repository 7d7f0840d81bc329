"""``from_pretrained``: a ``save_pretrained`` directory loaded straight into its parallel layout,
each rank reading only its own shards onto its own device (SPEC F15)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.errors import CheckpointError
from ..parallelize import parallelize
from ..parallelize.dropout import set_hf_dropout
from .keys import model_sources
from .materialize import init_buffers, load_shards
from .sources import INDEX, SINGLE, CheckpointFiles

log = logging.getLogger("ops_transformer")
BIN_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def from_pretrained(path, ctx, *, auto_class: str = "AutoModelForCausalLM",
                    dtype: torch.dtype | str | None = None, strict: bool = True,
                    dropout: float | None = None, **parallelize_kwargs) -> nn.Module:
    """The ``transformers`` model saved in the directory ``path`` (``save_pretrained``), parallelised
    over ``ctx`` by :func:`~ops_transformer.parallelize` (``parallelize_kwargs``: its options,
    e.g. ``vocab=``, ``loss_parallel=``, ``sequence_parallel=``), in eval mode.

    The model is built on the ``meta`` device, the plan is applied there, and only then does each
    rank read its shards — blocks of the safetensors files (``safe_open(...).get_slice``; one
    ``model.safetensors`` or an index and its shards) — straight onto ``ctx.device``: no rank ever
    holds the whole model. Replicated tensors (norms, routers, a replicated head) are read whole;
    tied embeddings are read once; non-persistent buffers (rotary ``inv_freq``) are computed on
    the device as ``transformers`` computes them. ``dtype`` (a ``torch.dtype`` or its name) is
    the floating-point dtype; ``None``: the checkpoint's. ``auto_class`` names the
    ``transformers`` auto class (``"AutoModelForCausalLM"``, ``"AutoModel"`` for encoders, …).

    Stored keys that the model does not have, model keys that the checkpoint lacks and shapes
    that differ from ``config.json`` raise :class:`~ops_transformer.CheckpointError` naming the
    file and the key; ``strict=False`` turns stored keys the model does not have into a warning
    (a checkpoint with a task head, loaded as its base model: ``auto_class="AutoModel"``). A directory with only ``pytorch_model.bin`` weights falls back to loading the
    whole model on every rank first (a warning says how much that is).

    ``dropout``: every dropout of the model set to it before it is parallelised
    (:func:`~ops_transformer.parallelize.dropout.set_hf_dropout`; ``None``: the config's); with
    dropout above 0 every rank draws the one-device masks of its part (``parallelize``).
    """
    transformers = _transformers()
    root = Path(path).resolve()
    dtype = _dtype(dtype)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{str(path)!r} is not a Hugging Face model directory (no "
                              f"config.json)")
    cls = _auto_class(transformers, auto_class)
    if not (root / SINGLE).is_file() and not (root / INDEX).is_file() and _bin_files(root):
        return _from_bin(transformers, cls, root, ctx, dtype, parallelize_kwargs, dropout)
    config = transformers.AutoConfig.from_pretrained(root)
    with CheckpointFiles(root) as files:
        dtype = dtype or files.floating_dtype() or torch.get_default_dtype()
        with torch.device("meta"):
            model = cls.from_config(config, dtype=dtype)
        model.config.name_or_path = str(root)  # as transformers' from_pretrained sets it
        if dropout is not None:
            set_hf_dropout(model, dropout)
        sources = model_sources(model, files.tensors, str(files.described), strict=strict)
        init_buffers(model, ctx.device)
        model = parallelize(model, ctx, materialize=lambda m: load_shards(m, sources, ctx.device),
                            **parallelize_kwargs)
    _load_generation_config(transformers, model, root)
    _check_on_device(model, ctx.device)
    return model.eval()


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("from_pretrained needs the Hugging Face `transformers` package: install "
                         "the `hf` extra (pip install 'ops-transformer[hf]')") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ValueError(f"from_pretrained needs transformers >= 5 (its checkpoint conversion "
                         f"mapping and buffer initialisation); installed: "
                         f"{transformers.__version__}")
    transformers.logging.disable_progress_bar()
    return transformers


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype or its name (float32, "
                         f"bfloat16, float16), got {dtype!r}")
    return value


def _auto_class(transformers, auto_class: str):
    cls = getattr(transformers, auto_class, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise ValueError(f"auto_class {auto_class!r} is not a transformers auto class (e.g. "
                         f"AutoModelForCausalLM, AutoModel)")
    return cls


def _bin_files(root: Path) -> list[Path]:
    return [root / n for n in BIN_FILES if (root / n).is_file()]


def _from_bin(transformers, cls, root: Path, ctx, dtype, parallelize_kwargs,
              dropout=None) -> nn.Module:
    """The whole-model path for ``torch.save`` checkpoints, which cannot be read by slices."""
    size = sum(f.stat().st_size for f in root.glob("pytorch_model*.bin"))
    warnings.warn(f"{root} holds only pytorch_model.bin weights (no safetensors): every rank "
                  f"loads the whole model ({size / 2**20:,.1f} MiB) into CPU memory before keeping "
                  f"its shards; save it with save_pretrained(safe_serialization=True) to load only "
                  f"each rank's shards", stacklevel=3)
    try:
        model = cls.from_pretrained(root, dtype=dtype or "auto")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load the model in {str(root)!r}: "
                              f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"
                              ) from None
    if dropout is not None:
        set_hf_dropout(model, dropout)
    model = parallelize(model, ctx, materialize=lambda m: m.to(ctx.device), **parallelize_kwargs)
    return model.eval()


def _load_generation_config(transformers, model: nn.Module, root: Path) -> None:
    if (root / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(root)
        except (OSError, ValueError) as exc:
            log.warning("from_pretrained: %s/generation_config.json not used: %s", root, exc)


def _check_on_device(model: nn.Module, device: torch.device) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device != device:
            raise AssertionError(f"from_pretrained left {name} on {tensor.device}, not {device}")
