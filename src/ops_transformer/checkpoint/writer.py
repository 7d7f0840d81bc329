"""``save_checkpoint``: each rank writes its chunks through DCP, rank 0 publishes the checkpoint
(:mod:`.store`) once every rank's files are written and hashed.

A save that fails leaves no partial checkpoint (rank 0 removes the ``.tmp-`` directory) and every
earlier one, and raises the same one-line error on every rank: a full disk as a
:class:`NoSpaceError` ("no space left on DEVICE while saving step N …, needs ~X MB"), found before
anything is written when the free space is short of what the global plan will write, or when a
write fails (DCP's ``CheckpointException`` carries every rank's traceback; torch's zip writer
reports a full disk as "unexpected pos …").
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .._version import __version__
from . import space, store
from .api import agree, job_layout, run_dcp, world_group
from .chunked import SavePlanner
from .contents import (OPTIM, RNG, ModelTensors, check_picklable, describe_model,
                       model_entries)
from .errors import CheckpointError
from .optim import adapter_for
from .reader import rank_failures
from .rng import rng_state


KEPT = "; the partial checkpoint was removed, earlier checkpoints are kept"


def _space_check(tmp: Path, step: int):
    """Rank 0's check of the planned bytes against the free space, before anything is written."""
    def check(needed: int) -> None:
        space.check_free(tmp, needed, f"saving step {step}",
                         "; nothing was written, earlier checkpoints are kept", place=tmp.parent)
    return check


def _save_error(exc: BaseException, root: Path, step: int, needed: int | None) -> BaseException:
    """What a failed save raises: a full disk as one :class:`NoSpaceError` line; DCP's failure
    report (every rank's traceback) as the first rank's error in one line; anything else as is."""
    if isinstance(exc, CheckpointError):
        return exc
    stop = _interruption(exc)
    if stop is not None:  # Ctrl-C or a signal mid-save: the interrupt, not a broken write
        return stop
    failures = rank_failures(exc)  # DCP's report: a rank's own CheckpointError first
    for _, failure in failures:
        if isinstance(failure, CheckpointError):
            return failure
    if space.is_disk_full(exc):
        return space.no_space(root, f"saving step {step}", needed, place=root,
                              consequence=KEPT)
    if failures:
        rank, first = failures[0]
        text = " ".join(str(first).split()[:40])
        return CheckpointError(f"saving step {step} failed on rank {rank}: "
                               f"{type(first).__name__}: {text}{KEPT}")
    return exc


def _interruption(exc: BaseException) -> BaseException | None:
    """The ``KeyboardInterrupt`` (or other non-``Exception``, such as a signal turned into one)
    that ``exc`` is, or was raised from or during, or that DCP's report carries for a rank."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if not isinstance(e, (Exception, CheckpointException)):  # DCP's is a BaseException
            return e
        stack += [e.__cause__, e.__context__, *(f for _, f in rank_failures(e))]
    return None


def _save_entries(model: ModelTensors, optimizer, ctx, extra, scaler,
                  stateful) -> dict[str, Any]:
    entries: dict[str, Any] = model_entries(model)
    if optimizer is not None:
        state = adapter_for(optimizer).save_state(optimizer, model, ctx)
        entries.update({OPTIM + k: v for k, v in state.items()})
    entries[f"{RNG}{ctx.rank}"] = rng_state(ctx.device)
    if ctx.rank == 0:  # the same on every rank: written once
        singles = {"extra": extra, "scaler": scaler.state_dict() if scaler is not None else None,
                   **{f"stateful/{k}": v.state_dict() for k, v in (stateful or {}).items()}}
        for key, value in singles.items():
            if value is not None:
                check_picklable(value, key)
                entries[key] = value
    return entries


def save_checkpoint(root, model, optimizer, ctx, step: int, *, extra=None, keep: int | None = 3,
                    scaler=None, stateful: Mapping[str, Any] | None = None,
                    meta: Mapping[str, Any] | None = None) -> Path:
    """Save a sharded checkpoint of step ``step`` under ``root`` (collective on every rank).

    Saved: the model's tensors (each rank its own chunks, in the dense model's names and shapes),
    the optimizer's state (``None``: none), every rank's RNG states, ``extra`` (plain data:
    tensors, numbers, strings, lists, dicts — e.g. the data position), and ``scaler`` and
    ``stateful`` objects (``state_dict()``); ``meta``: plain JSON data written into the manifest,
    readable without loading (``train`` records how its global batch was split: a resume on
    another number of ranks keeps the micro-batch). The checkpoint appears as
    ``root/step-<step>`` in one rename once complete; ``root/latest`` then names it; checkpoints
    older than the ``keep`` newest are deleted after that (``keep=None`` keeps all). Returns the checkpoint's directory.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    meta = _check_meta(meta)
    root, group = Path(root), world_group(ctx)
    name = store.step_dirname(step)
    tmp = root / f"{store.TMP_PREFIX}{name}"
    start = time.perf_counter()
    error = None
    try:
        tensors = ModelTensors(model)
        entries = _save_entries(tensors, optimizer, ctx, extra, scaler, stateful)
        if ctx.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            store.clean_stale(root)
            tmp.mkdir()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
        error = _save_error(exc, root, step, None)
    agree(error, ctx, "preparing the checkpoint")
    planner = SavePlanner(check=_space_check(tmp, step) if ctx.rank == 0 else None)
    try:
        _write(entries, tmp, group, planner, ctx, root, step)
        if ctx.rank == 0:
            try:
                manifest = _manifest(tmp, model, tensors, optimizer, ctx, step, extra, scaler,
                                     stateful)
                if meta is not None:
                    manifest["meta"] = meta
                manifest["write_seconds"] = round(time.perf_counter() - start, 3)
                store.write_manifest(tmp, manifest)
                store.publish(tmp, root, name)
                store.prune(root, keep, step)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the others
                error = _save_error(exc, root, step, planner.needed_bytes)
        agree(error, ctx, "publishing the checkpoint")
    except BaseException as exc:  # an interrupt too: its partial directory goes
        if ctx.rank == 0:  # never leave a partial checkpoint behind: --resume would trip on it
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, (Exception, CheckpointException)):
            raise
        raise _save_error(exc, root, step, planner.needed_bytes) from None
    return root / name


def _check_meta(meta):
    """``meta`` as the JSON the manifest will hold (a ``ValueError`` for anything else)."""
    if meta is None:
        return None
    try:
        return json.loads(json.dumps(dict(meta), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta must be plain JSON data (a dict of numbers, strings, lists, "
                         f"dicts): {exc}") from None


def _write(entries, tmp: Path, group, planner: SavePlanner, ctx, root: Path, step: int) -> None:
    """Every rank's chunks through DCP, then each rank's SHA-256 records of its files."""
    run_dcp(dcp.save, entries, group, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
            planner=planner)
    error = None
    try:  # each rank hashes the files it wrote; rank 0 collects them through the directory
        mine = {p.name: store.file_record(p) for p in sorted(tmp.glob(f"__{ctx.rank}_*"))}
        (tmp / f".hashes-{ctx.rank}.json").write_text(json.dumps(mine))
    except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
        error = _save_error(exc, root, step, planner.needed_bytes)
    agree(error, ctx, "hashing the checkpoint files")


def _manifest(tmp: Path, model, tensors: ModelTensors, optimizer, ctx, step, extra, scaler,
              stateful) -> dict:
    files = {".metadata": store.file_record(tmp / ".metadata")}
    for rank in range(ctx.world_size):
        part = tmp / f".hashes-{rank}.json"
        files.update(json.loads(part.read_text()))
        part.unlink()
    plan = getattr(model, "parallel_plan", None)
    return {
        "format": store.FORMAT, "version": store.VERSION, "step": step,
        "created_unix": round(time.time(), 3), "torch": torch.__version__,
        "ops_transformer": __version__, "layout": job_layout(ctx),
        "model": {**describe_model(model), "tensors": len(tensors.keys()),
                  "aliases": tensors.aliases,
                  "plan": ({"attention": plan.attention, "vocab": plan.vocab}
                           if plan is not None else None)},
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "scaler": scaler is not None, "stateful": sorted(stateful or {}),
        "extra": extra is not None,
        "files": files, "total_bytes": sum(f["size"] for f in files.values()),
    }
