"""Shared by ``generate`` and ``embed``: checking and loading a local Hugging Face model directory on
every rank.

A broken directory is a user error, found before any rank starts: a missing or corrupt
``config.json``, missing or truncated weights, a model of the wrong kind, or ``transformers`` not
installed each raise one ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

import torch

from ..checkpoint.errors import CheckpointError
from ..training.data import decode, encode
from ..loading import from_pretrained
from ..parallel import init_parallel, launch
from ..parallel.context import check_local_ranks
from ..launch.local import DEFAULT_LAUNCH_TIMEOUT
from ._common import under_torchrun
from ._calibrated import command_profile

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class ByteTokenizer:
    """Fallback for a model directory without tokenizer files: token ids are UTF-8 bytes."""

    def __call__(self, texts: list[str], **_) -> dict[str, torch.Tensor]:
        ids = [encode(t) for t in texts]
        width = max(len(i) for i in ids)
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, seq in enumerate(ids):
            input_ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = 1
        return {"input_ids": input_ids, "attention_mask": mask}

    def decode(self, ids) -> str:
        return decode([i for i in ids if i < 256])


def import_transformers(command: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{command} needs the Hugging Face `transformers` package, which is not "
                         f"installed: install the `hf` extra (pip install "
                         f"'ops-transformer[hf]', or `pip install -e '.[hf]'` in a clone)") from None
    return transformers


def check_model_dir(path: str, command: str = "generate"):
    """``(root, config)`` of a loadable model directory, or a ``ValueError`` naming what is wrong.
    A local directory needs no hub: ``HF_HUB_OFFLINE`` is set (unless set already)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")
    try:
        json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file} is not a readable JSON config: {exc}") from None
    transformers = import_transformers(command)
    try:
        config = transformers.AutoConfig.from_pretrained(root)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{config_file} is not a valid model config: {_first_line(exc)}") from None
    check_weights(root)
    return root, config


def check_weights(root: Path) -> None:
    """The weights named in ``root`` exist and are complete (safetensors headers against file
    sizes, zip archives of ``torch.save``)."""
    present = [root / name for name in WEIGHT_FILES if (root / name).is_file()]
    if not present:
        raise ValueError(f"--model {str(root)!r} has no weights: expected one of "
                         f"{', '.join(WEIGHT_FILES)}")
    files = []
    for file in present:
        if file.name.endswith(".index.json"):
            try:
                shards = set(json.loads(file.read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{file} is not a readable weight index: {exc}") from None
            missing = sorted(s for s in shards if not (root / s).is_file())
            if missing:
                raise ValueError(f"{file} names weight files that are missing: "
                                 f"{', '.join(missing)}")
            files += [root / s for s in sorted(shards)]
        else:
            files.append(file)
    for file in files:
        if file.suffix == ".safetensors":
            _check_safetensors(file)
        elif _looks_like_zip(file) and not zipfile.is_zipfile(file):
            raise ValueError(f"{file} is truncated or corrupt (an incomplete zip archive)")


def _check_safetensors(file: Path) -> None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
    if size < 8 + n + end:
        raise ValueError(f"{file} is truncated: {size:,} bytes, its header describes "
                         f"{8 + n + end:,}")


def _looks_like_zip(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_causal_lm(root: Path, config, command: str = "generate") -> None:
    """``generate`` (and ``train --model``) run causal language models only: an encoder (BERT,
    MiniLM) has no trained next-token head, and loading it as one would sample from random
    weights."""
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        causal = any(a.endswith(CAUSAL_SUFFIXES) for a in archs)
    else:
        from transformers.models.auto import modeling_auto as auto

        causal = (config.model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                  and (config.model_type not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
                       or getattr(config, "is_decoder", False)))
    if not causal or getattr(config, "is_encoder_decoder", False):
        kind = "/".join(archs) or f"model_type {config.model_type!r}"
        raise ValueError(f"--model {str(root)!r} is a {kind}, not a causal language model: "
                         f"{command} needs a *ForCausalLM or *LMHeadModel architecture (use "
                         f"`embed` for encoders)")


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer

    has_files = any((root / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                 "vocab.txt", "vocab.json"))
    return AutoTokenizer.from_pretrained(root) if has_files else ByteTokenizer()


def check_split(config, auto_class: str, tp: int, command: str) -> None:
    """The sizes ``parallelize`` would split divide by ``tp`` (whole heads per rank, KV heads
    split or replicated): checked from the config with the model built on the meta device, so that
    ``--tp 5`` on 12 heads is one line before any rank starts or loads a weight."""
    if tp <= 1:
        return
    import torch

    from ..parallelize.hf_plans import hf_plan

    transformers = import_transformers(command)
    try:
        with torch.device("meta"):
            model = getattr(transformers, auto_class).from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot build the model from its config: {_first_line(exc)}") from None
    try:
        hf_plan(model, tp)
    except ValueError as exc:
        raise ValueError(f"--tp {tp}: {exc}") from None


def load_parallel(root: Path, auto_class: str, tp: int):
    """``(ctx, model)``: the model loaded on this rank, in eval mode, parallelised over ``tp`` —
    each rank reading only its shards onto its device (:func:`~ops_transformer.from_pretrained`).
    The caller closes ``ctx`` (``with ctx:``)."""
    ctx = init_parallel(tp=tp, profile=command_profile(None))  # rank 0 reads it, then broadcasts
    try:
        model = from_pretrained(root, ctx, auto_class=auto_class,
                                strict=auto_class != "AutoModel")  # an encoder: heads skipped
    except (OSError, ValueError) as exc:
        ctx.close()
        if isinstance(exc, CheckpointError):
            raise
        raise ValueError(f"cannot load the model in {str(root)!r}: {_first_line(exc)}") from None
    return ctx, model


def run_on_ranks(worker, tp: int, nproc: int | None, *args,
                 timeout: float = DEFAULT_LAUNCH_TIMEOUT):
    """Self-launch ``nproc`` local ranks (default ``tp``), or run on this torchrun rank. Returns
    what ``worker`` returns on rank 0 (workers return ``None`` on the other ranks)."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if nproc is None and not under_torchrun():
        nproc = tp
    if nproc is not None:
        if nproc != tp:
            raise ValueError(f"--nproc ({nproc}) must equal --tp ({tp}): inference uses no data "
                             f"parallelism")
        check_local_ranks(nproc, "--tp")
        return launch(worker, nproc, *args, timeout=timeout)[0]
    return worker(*args)
