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

from ..checkpoint.api import load_checkpoint
from ..checkpoint.errors import CheckpointError, DamagedCheckpointError
from ..checkpoint.store import latest_step, list_steps, read_manifest, step_dirname
from ..checkpoint.writer import save_checkpoint


from .config import REBALANCE  # train --rebalance: re-plan a resume on another size, or not


def check_options(cfg) -> None:
    """The checkpoint settings of a ``TrainConfig`` (``ckpt_dir``, ``save_every``, ``resume``,
    ``max_restarts``, ``keep_checkpoints``, ``rebalance``, ``elastic``), named as the ``train``
    flags."""
    for name in ("save_every", "max_restarts"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got "
                             f"{getattr(cfg, name)}")
    if cfg.resume not in RESUME:
        raise ValueError(f"--resume takes no value or 'strict', got {cfg.resume!r}")
    if getattr(cfg, "on_save_error", "stop") not in ON_SAVE_ERROR:
        raise ValueError(f"--on-save-error must be one of {', '.join(ON_SAVE_ERROR)}, got "
                         f"{cfg.on_save_error!r}")
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


RESUME = (False, True, "strict")


def nothing_to_train(ckpt_dir, saved: int, steps: int) -> ValueError:
    return ValueError(f"--resume: the checkpoint in {str(ckpt_dir)!r} is at step {saved} and "
                      f"--steps is {steps}: nothing to train (pass --steps above {saved} to train "
                      f"on, or drop --resume to start over)")


def check_resume(cfg) -> bool:
    """Before any rank starts: ``--resume`` with ``--steps`` at or below the step of the newest
    checkpoint (whose manifest reads) would train nothing; ``--resume strict`` with no checkpoint
    in ``--ckpt-dir`` has nothing to resume. Returns whether a ``--resume`` found nothing (it
    starts from step 0; the CLI says so)."""
    if not (cfg.resume and cfg.ckpt_dir):
        return False
    steps = list_steps(cfg.ckpt_dir) if Path(cfg.ckpt_dir).is_dir() else []
    if not steps:
        if cfg.resume == "strict":
            raise ValueError(f"--resume strict: no checkpoint in {cfg.ckpt_dir} (a mistyped "
                             f"--ckpt-dir?); plain --resume starts from step 0 when there is none")
        return True
    for step in reversed(steps):
        try:
            read_manifest(Path(cfg.ckpt_dir) / step_dirname(step))
        except CheckpointError:
            continue  # damaged: --resume falls back past it
        if cfg.steps <= step:
            raise nothing_to_train(cfg.ckpt_dir, step, cfg.steps)
        return False
    return False


def resume(ckpt_dir, model, optimizer, ctx, data_position: dict, *, steps: int | None = None,
           strict: bool = False, **objects) -> tuple[int, dict]:
    """``(step, extra)`` of the newest checkpoint in ``ckpt_dir`` that verifies, loaded into the
    job; ``(0, {})`` when there is none yet (the first start of a job that will be restarted).

    A damaged newest checkpoint (a missing, truncated or corrupted file) is skipped with a
    warning naming it, and the next older one loaded; ``strict=True`` (``--resume strict``)
    refuses instead. A checkpoint that does not fit the model, or one that asks to run code, is
    never skipped. ``steps`` (the run's total): a checkpoint at or beyond it is an error, the run
    would train nothing."""
    newest = latest_step(ckpt_dir)
    if newest is None:
        return 0, {}
    older = [s for s in reversed(list_steps(ckpt_dir)) if s < newest]
    skipped = []
    for step in [newest] + ([] if strict else older):
        try:
            info = load_checkpoint(ckpt_dir, model, optimizer, ctx, step=step, **objects)
            break
        except DamagedCheckpointError as exc:  # the same on every rank (verified together)
            if strict:
                raise
            skipped.append((step, exc))
    else:
        raise DamagedCheckpointError(f"--resume: no checkpoint in {str(ckpt_dir)!r} verifies "
                                     f"(the newest: {skipped[0][1]})")
    if skipped and ctx.rank == 0:
        names = ", ".join(f"step {s}" for s, _ in skipped)
        warnings.warn(f"--resume: skipped {names} of {ckpt_dir} ({skipped[0][1]}); resuming from "
                      f"step {info['step']}, the newest checkpoint that verifies (--resume strict "
                      f"refuses instead)", stacklevel=2)
    if steps is not None and info["step"] >= steps:
        raise nothing_to_train(ckpt_dir, info["step"], steps)
    extra = info["extra"] or {}
    saved = extra.get("data_position")
    if saved is not None and saved != data_position:
        changed = ", ".join(f"{k}: {saved.get(k)!r} → {data_position.get(k)!r}"
                            for k in sorted(set(saved) | set(data_position))
                            if saved.get(k) != data_position.get(k))
        warnings.warn(f"resuming from {info['path']} with a different data stream ({changed}): "
                      f"the run will not be identical to one that never stopped", stacklevel=2)
    return info["step"], extra


ON_SAVE_ERROR = ("stop", "continue")


def save(ckpt_dir, model, optimizer, ctx, step: int, data_position: dict, *, keep: int | None,
         extra: dict | None = None, on_error: str = "stop", **objects):
    """A checkpoint of ``step`` whose ``extra`` records the data position (``objects``: the
    scaler, stateful objects and the manifest's ``meta``, see :func:`save_checkpoint`). A save that fails (a
    full disk: :class:`~.errors.NoSpaceError`) raises on every rank, or with
    ``on_error="continue"`` (``train --on-save-error continue``) is a warning and returns
    ``None``: training goes on, the next save tries again."""
    try:
        return save_checkpoint(ckpt_dir, model, optimizer, ctx, step, keep=keep,
                               extra={**(extra or {}), "data_position": data_position},
                               **objects)
    except CheckpointError as exc:  # the same on every rank: they all go on, or all stop
        if on_error != "continue":
            raise
        if ctx.rank == 0:
            warnings.warn(f"{exc}; training goes on (--on-save-error continue)", stacklevel=2)
        return None


def saved_split(ckpt_dir, batch: int) -> dict | None:
    """The layout and batch split (``meta``, ``train.batch_layout``) of the newest checkpoint in
    ``ckpt_dir`` whose manifest reads:
    ``{"step", "world_size", "dp", "ep", "tp", "global_batch", "micro_batch", "grad_accum"}``
    (and ``"cp"`` when the sequence was split, ``"pp"`` when the layers were);
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
                "dp": layout["dp"], "ep": layout.get("ep", 1), "tp": layout["tp"],
                **{k: layout[k] for k in ("cp", "pp") if layout.get(k, 1) > 1}, **split}
    return None


def saved_settings(ckpt_dir) -> dict | None:
    """What the newest checkpoint in ``ckpt_dir`` whose manifest reads says about its run:
    ``{"step", "settings", "global_batch", "lora"}`` (``settings``: ``train``'s record of its
    batch, sequence and schedule, ``{}`` in older checkpoints; ``lora``: the adapters' config or
    ``None``); ``None`` without a checkpoint."""
    for step in reversed(list_steps(ckpt_dir)):
        try:
            manifest = read_manifest(Path(ckpt_dir) / step_dirname(step))
        except CheckpointError:
            continue
        meta = manifest.get("meta") or {}
        return {"step": manifest["step"], "settings": dict(meta.get("settings") or {}),
                "global_batch": meta.get("global_batch"),
                "lora": (manifest.get("model") or {}).get("lora")}
    return None
