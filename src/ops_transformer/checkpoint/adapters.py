"""Exporting a LoRA checkpoint, which holds the adapters and a reference to their base
(:func:`~ops_transformer.lora`, ``train --lora-rank``): a PEFT adapter directory, or the base
with the adapters merged into its weights.

* ``--adapter``: ``adapter_config.json`` (written by ``peft``'s own ``LoraConfig``) and
  ``adapter_model.safetensors``, the factors in dense coordinates under PEFT's keys
  (``base_model.model.<module>.lora_A.weight [rank, in]``, ``….lora_B.weight [out, rank]``):
  ``PeftModel.from_pretrained(base, OUT)`` loads them onto the plain base model.
* ``--merge``: ``W + (alpha/rank) · B A`` in each adapted layer (transposed for GPT-2's ``Conv1D``,
  whose weight is ``[in, out]``), computed in fp32 and stored in the base weight's dtype; a
  Hugging Face base becomes a ``save_pretrained`` directory, the reference GPT a safetensors file.

The base: a Hugging Face model's directory as recorded at training time (or ``base_dir`` when it
has moved); a preset GPT is rebuilt from its configuration and seed, exactly as ``train`` built it
(``torch.manual_seed(seed); GPT(config)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..models.gpt import GPT, GPTConfig
from .errors import CheckpointError
from .export import copy_side_files, default_modes

PEFT_PREFIX = "base_model.model."  # PeftModel → LoraModel → the base model


def lora_info(manifest: dict, path) -> dict:
    """The checkpoint's LoRA configuration (``LoRAConfig.to_dict()``), or a
    :class:`CheckpointError` for a checkpoint without adapters."""
    info = manifest["model"].get("lora")
    if info is None:
        raise CheckpointError(f"checkpoint {path} holds a whole model, not LoRA adapters: export "
                              f"it without --adapter / --merge")
    return info


def adapter_keys(info: dict) -> list[str]:
    return [f"{name}.lora_{role}.weight" for name in info["targets"] for role in ("A", "B")]


def export_peft_adapter(state: dict[str, torch.Tensor], manifest: dict, out: Path,
                        path="") -> Path:
    """A PEFT adapter directory at ``out`` (see the module docstring)."""
    try:
        import peft
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ValueError(f"checkpoint export --adapter writes PEFT's format and needs peft and "
                         f"safetensors ({exc}): pip install -e '.[lora]'") from None
    info = lora_info(manifest, path)
    extra = sorted(set(state) - set(adapter_keys(info)))
    if extra:
        raise CheckpointError(f"checkpoint {path} also trained {len(extra)} tensor(s) besides the "
                              f"adapters (e.g. {extra[:3]}), which a PEFT adapter directory does "
                              f"not hold: export with --merge")
    huggingface = manifest["model"].get("kind") == "huggingface"
    causal = huggingface and manifest["model"]["class"].endswith("ForCausalLM")
    config = peft.LoraConfig(
        r=info["rank"], lora_alpha=info["alpha"], lora_dropout=info["dropout"],
        target_modules=list(info["targets"]), fan_in_fan_out=info["fan_in_fan_out"],
        bias="none", task_type="CAUSAL_LM" if causal else None,
        base_model_name_or_path=(info.get("base") or {}).get("model_dir"))
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    tensors = {PEFT_PREFIX + k: state[k].contiguous() for k in adapter_keys(info)}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    default_modes([out])  # safetensors writes 0o600
    return out


def base_model(manifest: dict, path, base_dir: str | None = None) -> nn.Module:
    """The base the checkpoint's adapters belong to (module docstring), on the CPU."""
    info, model_info = lora_info(manifest, path), manifest["model"]
    base = info.get("base") or {}
    if model_info.get("kind") == "huggingface":
        directory = base_dir or base.get("model_dir")
        if directory is None or not Path(directory).is_dir():
            raise CheckpointError(f"checkpoint {path}: the base model directory "
                                  f"{directory!r} is not there; pass --base DIR")
        import transformers

        return getattr(transformers, model_info["class"]).from_pretrained(directory,
                                                                          dtype="auto")
    if model_info.get("kind") == "gpt" and "seed" in base:
        torch.manual_seed(base["seed"])  # as train builds it: same dense init on every rank
        return GPT(GPTConfig(**model_info["config"]))
    raise CheckpointError(f"checkpoint {path}: its adapters' base ({base or 'not recorded'}) "
                          f"cannot be rebuilt; merge them into it by hand (W += scaling · B A)")


@torch.no_grad()
def merge_adapters(model: nn.Module, state: dict[str, torch.Tensor], info: dict) -> nn.Module:
    """``model`` (the plain base) with the checkpoint's adapters merged into its weights, and
    any other tensor the checkpoint trained put in place."""
    params = dict(model.named_parameters())
    for name in info["targets"]:
        module = model.get_submodule(name)
        a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        delta = (b.double() @ a.double()) * info["scaling"]  # [out, in]
        if type(module).__name__ == "Conv1D":
            delta = delta.t()  # Conv1D stores [in, out]
        module.weight.copy_((module.weight.double() + delta).to(module.weight.dtype))
    for key in set(state) - set(adapter_keys(info)):  # parameters unfrozen after ot.lora
        params[key].copy_(state[key])
    return model


def export_merged(state: dict[str, torch.Tensor], manifest: dict, out: Path, path="",
                  base_dir: str | None = None) -> Path:
    """The base with the adapters merged: a ``save_pretrained`` directory (Hugging Face) or one
    ``.safetensors`` file (the reference GPT)."""
    info = lora_info(manifest, path)
    model = merge_adapters(base_model(manifest, path, base_dir), state, info)
    if manifest["model"].get("kind") == "huggingface":
        model.save_pretrained(out)
        copy_side_files(Path(base_dir or info["base"]["model_dir"]), out)  # the tokenizer
        default_modes([out])
        return out
    from safetensors.torch import save_model

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "step": str(manifest["step"]), "merged_lora": json.dumps(info)}
    save_model(model, str(out), metadata=meta)  # tied weights once; load_model re-ties them
    default_modes([out])
    return out
