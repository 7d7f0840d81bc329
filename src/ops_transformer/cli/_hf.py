"""Shared by ``generate`` and ``embed``: loading a local Hugging Face model directory on every rank."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..data import decode, encode
from ..parallel import init_parallel, launch
from ..parallelize import parallelize
from ._profile import command_profile


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


def check_model_dir(path: str) -> Path:
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")
    return root


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer

    has_files = any((root / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                 "vocab.txt", "vocab.json"))
    return AutoTokenizer.from_pretrained(root) if has_files else ByteTokenizer()


def load_parallel(root: Path, auto_class: str, tp: int):
    """``(ctx, model)``: the model loaded on this rank, in eval mode, parallelised over ``tp``."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.disable_progress_bar()
    ctx = init_parallel(tp=tp, profile=command_profile(None))  # rank 0 reads it, then broadcasts
    model = getattr(transformers, auto_class).from_pretrained(root).eval()
    if tp > 1:
        model = parallelize(model, ctx)
    return ctx, model


def run_on_ranks(worker, tp: int, nproc: int | None, *args):
    """Self-launch ``nproc`` local ranks (default ``tp``), or run on this torchrun rank."""
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    if nproc is None and "WORLD_SIZE" not in os.environ:
        nproc = tp
    if nproc is not None:
        if nproc != tp:
            raise ValueError(f"--nproc ({nproc}) must equal --tp ({tp}): inference uses no data "
                             f"parallelism")
        return launch(worker, nproc, *args)[0]
    return worker(*args)
