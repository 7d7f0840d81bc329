"""Periodic checkpoints and resumption for a training loop (used by ``train``).

A resumed run is bit-identical to one that never stopped because everything a step depends on is
restored: weights, optimizer state, every rank's RNG states, and the data position. Batches are a
pure function of ``(seed, step)`` (:mod:`ops_transformer.data`), so the position is the step
itself plus the settings that define the stream (seed, batch, sequence length, corpus), which are
saved and compared on resume.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .api import load_checkpoint, save_checkpoint
from .errors import CheckpointError
from .store import latest_step, list_steps, read_manifest, step_dirname


REBALANCE = ("auto", "off")  # train --rebalance: re-plan a resume on another size, or not


def check_options(cfg) -> None:
    """The checkpoint settings of a ``TrainConfig`` (``ckpt_dir``, ``save_every``, ``resume``,
    ``max_restarts``, ``keep_checkpoints``, ``rebalance``, ``elastic``), named as the ``train``
    flags."""
    for name in ("save_every", "max_restarts"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got "
                             f"{getattr(cfg, name)}")
    if cfg.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be at least 1, got {cfg.keep_checkpoints}")
    if getattr(cfg, "rebalance", "auto") not in REBALANCE:
        raise ValueError(f"--rebalance must be one of {', '.join(REBALANCE)}, got "
                         f"{cfg.rebalance!r}")
    if getattr(cfg, "elastic", False) and not cfg.max_restarts:
        raise ValueError("--elastic continues on the nodes left after a failure: it needs "
                         "--max-restarts 1 or more (and --resume)")
    if not cfg.ckpt_dir:
        used = [flag for flag, on in (("--save-every", cfg.save_every), ("--resume", cfg.resume),
                                      ("--max-restarts", cfg.max_restarts)) if on]
        if used:
            raise ValueError(f"{' and '.join(used)} need --ckpt-dir (where checkpoints go)")
    elif cfg.max_restarts and not cfg.resume:
        raise ValueError("--max-restarts needs --resume: a restarted job continues from the last "
                         "checkpoint in --ckpt-dir")


def should_save(step: int, total: int, every: int) -> bool:
    """After ``step`` completed steps: every ``every`` steps (0: never) and after the last one."""
    return step == total or (every > 0 and step % every == 0)


def resume(ckpt_dir, model, optimizer, ctx, data_position: dict, **objects) -> tuple[int, dict]:
    """``(step, extra)`` of the latest checkpoint in ``ckpt_dir``, loaded into the job; ``(0, {})``
    when there is none yet (the first start of a job that will be restarted)."""
    if latest_step(ckpt_dir) is None:
        return 0, {}
    info = load_checkpoint(ckpt_dir, model, optimizer, ctx, **objects)
    extra = info["extra"] or {}
    saved = extra.get("data_position")
    if saved is not None and saved != data_position:
        changed = ", ".join(f"{k}: {saved.get(k)!r} → {data_position.get(k)!r}"
                            for k in sorted(set(saved) | set(data_position))
                            if saved.get(k) != data_position.get(k))
        warnings.warn(f"resuming from {info['path']} with a different data stream ({changed}): "
                      f"the run will not be identical to one that never stopped", stacklevel=2)
    return info["step"], extra


def save(ckpt_dir, model, optimizer, ctx, step: int, data_position: dict, *, keep: int | None,
         extra: dict | None = None, **objects):
    """A checkpoint of ``step`` whose ``extra`` records the data position (``objects``: the
    scaler, stateful objects and the manifest's ``meta``, see :func:`save_checkpoint`)."""
    return save_checkpoint(ckpt_dir, model, optimizer, ctx, step, keep=keep,
                           extra={**(extra or {}), "data_position": data_position}, **objects)


def saved_split(ckpt_dir, batch: int) -> dict | None:
    """The layout and batch split (``meta``, ``train.batch_layout``) of the newest checkpoint in
    ``ckpt_dir`` whose manifest reads:
    ``{"step", "world_size", "dp", "ep", "tp", "global_batch", "micro_batch", "grad_accum"}``;
    ``None`` when there is none. A checkpoint saved without ``meta`` ran each rank's rows in one
    micro-batch of ``batch`` (the run's global batch) over its ``dp × ep``."""
    for step in reversed(list_steps(ckpt_dir)):
        try:
            manifest = read_manifest(Path(ckpt_dir) / step_dirname(step))
        except CheckpointError:
            continue  # damaged: the resume falls back past it
        layout = manifest["layout"]
        readers = layout["dp"] * layout.get("ep", 1)
        split = {"global_batch": batch, "micro_batch": batch // readers, "grad_accum": 1,
                 **{k: v for k, v in (manifest.get("meta") or {}).items()
                    if k in ("global_batch", "micro_batch", "grad_accum")}}
        return {"step": manifest["step"], "world_size": layout["world_size"],
                "dp": layout["dp"], "ep": layout.get("ep", 1), "tp": layout["tp"], **split}
    return None
