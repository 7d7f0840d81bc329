"""What a checkpoint holds, as DCP keys, and how each part goes back into the job.

=========================  =================================================  ==================
key                        value                                              written by
=========================  =================================================  ==================
``model/<name>``           each dense tensor of the model before              the ranks holding
                           parallelisation, its name and shape (tied weights  its chunks (once
                           once: the others are aliases in the manifest); a   per distinct chunk)
                           LoRA model's adapters only (``lora_A``/``lora_B``,
                           and any parameter unfrozen after ``ot.lora``):
                           its base is referenced in the manifest
``optim/…``                the optimizer adapter's entries (:mod:`.optim`)    idem
``rng/<rank>``             that rank's RNG states                             that rank
``extra``, ``scaler``,     the caller's ``extra``; ``state_dict()`` of the    rank 0
``stateful/<name>``        loss scaler and other stateful objects
=========================  =================================================  ==================
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..layers.lora import adapter_parameters
from ..models.hf import own_class
from ..parallel.sharding import local_tensor
from .chunked import ChunkedTensor
from .errors import CheckpointError
from .layout import Entry, layout_of
from .pieces import data_shard_entry

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"


ModuleEntries = Callable[[torch.nn.Module, str], dict[str, list[Entry]]]
_MODULE_ENTRIES: dict[type, ModuleEntries] = {}


def register_module_entries(module_type: type, entries: ModuleEntries) -> None:
    """Modules of ``module_type`` map their tensors to dense entries themselves:
    ``entries(module, prefix)`` returns, per local tensor name (as in its ``state_dict``), the
    :class:`Entry` objects of the dense tensors it holds, keyed by their names in the dense model
    (``prefix`` is the module's, with a trailing dot)."""
    _MODULE_ENTRIES[module_type] = entries


class ModelTensors:
    """A model's tensors in the checkpoint's terms: ``tensors`` (``state_dict`` name → parameter or
    persistent buffer, each tensor once; tied weights are ``aliases``) and the dense
    :class:`Entry` objects each one holds (usually one, under its own name)."""

    def __init__(self, model: torch.nn.Module):
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        seen: dict[int, str] = {}
        trained = _lora_tensors(model)
        for name, tensor in model.state_dict(keep_vars=True).items():
            if trained is not None and name not in trained:
                continue  # a LoRA model's frozen base: referenced, not saved
            if id(tensor) in seen:
                self.aliases[name] = seen[id(tensor)]
            else:
                seen[id(tensor)] = name
                self.tensors[name] = tensor
        special = {}
        for prefix, module in model.named_modules():
            hook = next((f for cls, f in _MODULE_ENTRIES.items() if isinstance(module, cls)), None)
            if hook is not None:
                prefix = f"{prefix}." if prefix else ""
                for k, v in hook(module, prefix).items():  # an outer module's hook wins
                    special.setdefault(prefix + k, v)
        self.entries = {name: special.get(name) or [Entry(_dense_key(name, t), layout_of(t))]
                        for name, t in self.tensors.items()}
        for name, t in self.tensors.items():
            if local_tensor(t) is not t:  # sharded over data-parallel ranks: this rank's rows
                self.entries[name] = [data_shard_entry(e, t) for e in self.entries[name]]
        self._by_id = {id(t): name for name, t in self.tensors.items()}

    def local(self, name: str) -> torch.Tensor:
        """The tensor this rank holds for ``name`` (a data-parallel shard's own rows)."""
        return local_tensor(self.tensors[name]).detach()

    def name_of(self, tensor: torch.Tensor) -> str | None:
        return self._by_id.get(id(tensor))

    def entries_of(self, tensor: torch.Tensor) -> list[Entry]:
        return self.entries[self._by_id[id(tensor)]]

    def keys(self) -> list[str]:
        """Every dense key, in order."""
        return [e.key for entries in self.entries.values() for e in entries]


def _dense_key(name: str, tensor: torch.Tensor) -> str:
    """The dense key of a tensor: its name, or for a tied weight's copy on another pipeline
    stage (``pipeline_tied_copy``: the dense name of the weight it copies) that weight's name, so
    the checkpoint holds it once, as the dense model's does (both copies are equal)."""
    tied = getattr(tensor, "pipeline_tied_copy", None)
    return tied if isinstance(tied, str) else name


def lora_config(model: torch.nn.Module):
    """The :class:`~ops_transformer.parallelize.lora.LoRAConfig` of a model with adapters, or
    ``None``."""
    return getattr(getattr(model, "parallel_state", None), "lora", None)


def _lora_tensors(model: torch.nn.Module) -> set[str] | None:
    """What a LoRA model's checkpoint holds: the adapters and whatever else trains."""
    if lora_config(model) is None:
        return None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return set(adapter_parameters(model)) | trainable


def model_entries(model: ModelTensors) -> dict[str, ChunkedTensor]:
    return {MODEL + e.key: ChunkedTensor.of_entry(e, model.local(name))
            for name in model.tensors for e in model.entries[name]}


def model_targets(model: ModelTensors, saved: Mapping[str, Any]) -> dict[str, ChunkedTensor]:
    """Fresh zero buffers shaped like each local tensor, to load into; a key of this rank's model
    missing from the checkpoint, or a dense shape that differs, is a :class:`CheckpointError`.
    (Checkpoint tensors that no rank's model holds: :func:`unclaimed`.)"""
    missing = sorted(k for k in model.keys() if MODEL + k not in saved)
    if missing:
        raise CheckpointError(f"the checkpoint does not fit this model: {len(missing)} tensor(s) "
                              f"of the model are not in it (e.g. {missing[:3]})")
    targets = {}
    for name in model.tensors:
        buffer = torch.zeros_like(model.local(name))
        for entry in model.entries[name]:
            md, dense = saved[MODEL + entry.key], tuple(entry.layout.global_shape)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != dense:
                shape = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
                raise CheckpointError(f"model tensor {entry.key!r}: the checkpoint's dense shape is "
                                      f"{shape}, this model's is {dense} (a different model "
                                      f"configuration?)")
            targets[MODEL + entry.key] = ChunkedTensor.of_entry(entry, buffer)
    return targets


def unclaimed(model: ModelTensors, saved: Mapping[str, Any], covered) -> list[str]:
    """The checkpoint's model tensors that no rank holds. ``covered(flags)`` reduces this rank's
    0/1 flags (one per saved model key, in sorted order) with MAX over the ranks: with experts
    over ``ep`` each rank holds only some of them."""
    names = sorted(k for k in saved if k.startswith(MODEL))
    mine = {MODEL + k for k in model.keys()}
    flags = covered(torch.tensor([int(k in mine) for k in names], dtype=torch.int32))
    return [k[len(MODEL):] for k, flag in zip(names, flags.tolist()) if not flag]


@torch.no_grad()
def commit_model(model: ModelTensors, loaded: Mapping[str, Any]) -> None:
    for name in model.tensors:
        model.local(name).copy_(loaded[MODEL + model.entries[name][0].key].local)


def describe_model(model: torch.nn.Module) -> dict:
    """Enough to rebuild the dense model for export: its class and configuration."""
    adapters = lora_config(model)
    lora = {} if adapters is None else {"lora": adapters.to_dict()}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):  # Hugging Face
        return {"kind": "huggingface", "class": own_class(model).__name__,
                "config": json.loads(config.to_json_string(use_diff=False)), **lora}
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        return {"kind": "gpt", "class": own_class(model).__name__, "config": cfg.to_dict(), **lora}
    return {"kind": "module", "class": own_class(model).__name__, **lora}


def check_lora(saved_model: dict, model: torch.nn.Module, path) -> None:
    """A :class:`CheckpointError` when the checkpoint's adapters (``saved_model``: its manifest's
    ``model``) do not belong on ``model``: one has adapters and the other not, or they differ in
    rank, targets or base."""
    saved, mine = saved_model.get("lora"), lora_config(model)
    if saved is None and mine is None:
        return
    if mine is None:
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters (rank {saved['rank']} on "
                              f"{len(saved['targets'])} modules), not a whole model: load it into "
                              f"its base with the same adapters (ot.lora, train --lora-rank), or "
                              f"export it (checkpoint export --adapter or --merge)")
    if saved is None:
        raise CheckpointError(f"checkpoint {path} holds a whole model, not LoRA adapters: this "
                              f"model has adapters (rank {mine.rank}); load it without ot.lora")
    for key, value in (("rank", mine.rank), ("targets", list(mine.targets)),
                       ("base", mine.base)):
        if saved.get(key) != value:
            raise CheckpointError(f"checkpoint {path}: its LoRA adapters have {key} "
                                  f"{saved.get(key)!r}, this model's have {value!r}")


def check_picklable(value, what: str) -> None:
    """``value`` must load back with ``torch.load(weights_only=True)`` (tensors, numbers,
    strings, lists, tuples, dicts): checked at save time rather than discovered at load."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{what} must hold only tensors, numbers, strings, booleans, None, lists, "
                         f"tuples and dicts (it is loaded with weights_only=True): {exc}") from None
