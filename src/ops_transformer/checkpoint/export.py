"""Reading a checkpoint without a job: what it holds (``inspect``) and its dense weights
(``export``), in one process — DCP assembles each dense tensor from the stored chunks."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import store
from .api import read_failure, run_dcp, verify
from .chunked import LoadPlanner
from .contents import MODEL, OPTIM
from .errors import CheckpointError
from .reader import SafeReader, UnsafeCheckpointError, check_pickled_values


def describe(path: Path, *, check: bool = True) -> dict:
    """The manifest of the checkpoint at ``path`` with a ``status`` ("ok", "not verified" or the
    problem) and, when its files are intact, what its tensors add up to."""
    try:
        manifest = store.read_manifest(path)
    except CheckpointError as exc:
        return {"path": str(path), "step": store.parse_step(path.name), "status": str(exc)}
    info = {"path": str(path), **manifest, "status": "not verified"}
    if check:
        try:
            verify(path, manifest)
            info["status"] = "ok"
        except CheckpointError as exc:
            info["status"] = str(exc)
            return info
    try:  # read as a load would: no pickle of the checkpoint may run code (reader.py)
        metadata = SafeReader(path).read_metadata()
        check_pickled_values(path, metadata)
    except UnsafeCheckpointError as exc:
        return {**info, "status": str(exc), "unsafe": True}
    except CheckpointError as exc:
        return {**info, "status": str(exc)}
    saved = metadata.state_dict_metadata
    for part, prefix in (("model", MODEL), ("optimizer", OPTIM)):
        tensors = {k: md for k, md in saved.items()
                   if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
        info[f"{part}_tensors"] = len(tensors)
        info[f"{part}_elements"] = sum(math.prod(md.size) for md in tensors.values())
    return info


def describe_root(root: Path, *, check: bool = True) -> dict:
    """Every checkpoint under ``root`` (or the one checkpoint ``root`` is)."""
    root = Path(root)
    if (root / store.MANIFEST).exists() or store.parse_step(root.name) is not None:
        return {"root": str(root.parent), "latest": None, "checkpoints": [describe(root, check=check)],
                "incomplete": []}
    if not root.is_dir():
        raise CheckpointError(f"{str(root)!r} is not a checkpoint directory")
    dirs = sorted((p for p in root.iterdir() if store.parse_step(p.name) is not None),
                  key=lambda p: store.parse_step(p.name))
    incomplete = sorted(p.name for p in root.iterdir() if p.name.startswith(store.TMP_PREFIX))
    return {"root": str(root), "latest": store.latest_step(root),
            "checkpoints": [describe(p, check=check) for p in dirs], "incomplete": incomplete}


def dense_state_dict(root, step: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """``(name → dense tensor, manifest)``: the model's weights as the unparallelised model holds
    them (tied weights once; ``manifest["model"]["aliases"]`` names the others). Verified first."""
    path = store.resolve(root, step)
    manifest = store.read_manifest(path)
    verify(path, manifest)
    reader = SafeReader(path)
    metadata = reader.read_metadata()
    check_pickled_values(path, metadata)  # a crafted value is refused, though export skips it
    saved = metadata.state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in saved.items() if k.startswith(MODEL)}
    try:
        run_dcp(dcp.load, state, None, storage_reader=reader, planner=LoadPlanner())
    except (Exception, CheckpointException) as exc:
        raise read_failure(path, exc) from None
    return {k[len(MODEL):]: v for k, v in state.items()}, manifest


def export_safetensors(state: dict[str, torch.Tensor], manifest: dict, out: Path) -> Path:
    """One ``.safetensors`` file; ``safetensors.torch.load_model(model, out)`` loads it into the
    unparallelised model (it re-ties shared weights)."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "step": str(manifest["step"]),
            "model": json.dumps({k: v for k, v in manifest["model"].items() if k != "tensors"})}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata=meta)
    default_modes([out])
    return out


def default_modes(paths) -> None:
    """Give the files ``paths`` (and the files under directories among them) the mode a new file
    gets here (``0o666`` less the umask): ``safetensors`` creates its files ``0o600``, unreadable
    to the group that shares the model."""
    umask = os.umask(0)
    os.umask(umask)
    for path in map(Path, paths):
        for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
            os.chmod(file, 0o666 & ~umask)


# What a model directory holds besides its config and weights, copied into an export.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
              "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json",
              "chat_template.jinja", "generation_config.json")


def export_huggingface(state: dict[str, torch.Tensor], manifest: dict, out: Path) -> Path:
    """A ``save_pretrained`` directory of the checkpoint's Hugging Face model; the tokenizer files
    (and generation config) of the directory it was loaded from (``train --model``), when that
    still exists, are copied next to it (:func:`copied_side_files` lists them)."""
    import transformers

    transformers.logging.disable_progress_bar()
    info = manifest["model"]
    config = transformers.AutoConfig.for_model(**info["config"])
    model = getattr(transformers, info["class"])(config)
    aliases = {alias: state[name] for alias, name in info.get("aliases", {}).items()}
    model.load_state_dict({**state, **aliases}, strict=True)
    model.save_pretrained(out)
    copy_side_files(source_dir(manifest), out)
    default_modes([out])
    return out


def copy_side_files(source: Path | None, out: Path) -> list[str]:
    """Copy the :data:`SIDE_FILES` that ``source`` (a model directory) has into ``out``."""
    names = [] if source is None else [n for n in SIDE_FILES if (source / n).is_file()]
    for name in names:
        shutil.copyfile(source / name, out / name)
    return names


def source_dir(manifest: dict) -> Path | None:
    """The model directory a Hugging Face checkpoint's model was loaded from, if it exists."""
    name = manifest["model"].get("config", {}).get("_name_or_path")
    return Path(name) if name and Path(name).is_dir() else None


def copied_side_files(manifest: dict) -> list[str]:
    source = source_dir(manifest)
    return [] if source is None else [n for n in SIDE_FILES if (source / n).is_file()]
