"""``save_checkpoint`` and ``load_checkpoint``: sharded, atomic, verified, reshardable.

Both are collective: every rank of the job calls them with its own model (and optimizer). Each rank
writes only the chunks it holds, through ``torch.distributed.checkpoint``; rank 0 publishes the
checkpoint (:mod:`.store`) once every rank's files are written and hashed. Loading verifies every
file against the manifest (the ranks share the hashing) and reads into fresh buffers; only when
everything has been read are the model, optimizer, scaler and RNG states replaced.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .._version import __version__
from ..comm import collectives as C
from . import store
from .chunked import LoadPlanner, SavePlanner
from .contents import (MODEL, OPTIM, RNG, ModelTensors, check_picklable, commit_model,
                       describe_model, model_entries, model_targets, unclaimed)
from .errors import CheckpointError
from .optim import adapter_for
from .rng import rng_state, set_rng_state


def _world(ctx):
    return dist.group.WORLD if ctx.world_size > 1 else None


def run_dcp(fn, state: dict, group, **kwargs):
    """``dcp.save`` or ``dcp.load`` over ``group`` (``None``: this process alone, without the
    warning DCP prints for that case)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, process_group=group, no_dist=group is None, **kwargs)


def _max_over_ranks(tensor: torch.Tensor, ctx) -> torch.Tensor:
    tensor = tensor.to(ctx.device)
    C.all_reduce(tensor, _world(ctx), op=C.ReduceOp.MAX, label="checkpoint")
    return tensor.cpu()


def _agree(error: BaseException | None, ctx, what: str, cls=RuntimeError) -> None:
    """Raise on every rank when ``error`` happened on any (no rank is left waiting)."""
    flag = int(_max_over_ranks(torch.tensor([ctx.rank + 1 if error is not None else 0]), ctx))
    if error is not None:
        raise error
    if flag:
        raise cls(f"{what} failed on rank {flag - 1} (its error is reported there)")


def _layout(ctx) -> dict:
    return {"world_size": ctx.world_size, "dp": ctx.dp_size, "tp": ctx.tp_size, "ep": ctx.ep_size}


def _save_entries(model: ModelTensors, optimizer, ctx, extra, scaler,
                  stateful) -> dict[str, Any]:
    entries: dict[str, Any] = model_entries(model)
    if optimizer is not None:
        state = adapter_for(optimizer).save_state(optimizer, model, ctx)
        entries.update({OPTIM + k: v for k, v in state.items()})
    entries[f"{RNG}{ctx.rank}"] = rng_state()
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
    another number of ranks keeps the micro-batch). The checkpoint appears as ``root/step-<step>`` in one
    rename once complete; ``root/latest`` then names it; checkpoints older than the ``keep``
    newest are deleted after that (``keep=None`` keeps all). Returns the checkpoint's directory.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    meta = _check_meta(meta)
    root, group = Path(root), _world(ctx)
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
        error = exc
    _agree(error, ctx, "preparing the checkpoint")
    run_dcp(dcp.save, entries, group, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
            planner=SavePlanner())
    error = None
    try:  # each rank hashes the files it wrote; rank 0 collects them through the directory
        mine = {p.name: store.file_record(p) for p in sorted(tmp.glob(f"__{ctx.rank}_*"))}
        (tmp / f".hashes-{ctx.rank}.json").write_text(json.dumps(mine))
    except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
        error = exc
    _agree(error, ctx, "hashing the checkpoint files")
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
        except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = exc
    _agree(error, ctx, "publishing the checkpoint")
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
        "ops_transformer": __version__, "layout": _layout(ctx),
        "model": {**describe_model(model), "tensors": len(tensors.keys()),
                  "aliases": tensors.aliases,
                  "plan": ({"attention": plan.attention, "vocab": plan.vocab}
                           if plan is not None else None)},
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "scaler": scaler is not None, "stateful": sorted(stateful or {}),
        "extra": extra is not None,
        "files": files, "total_bytes": sum(f["size"] for f in files.values()),
    }


def verify(path: Path, manifest: dict, ctx=None) -> None:
    """Check every file of the checkpoint at ``path`` against its manifest, the ranks of ``ctx``
    sharing the work; a :class:`CheckpointError` naming the first bad file on every rank."""
    names = sorted(manifest["files"])
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    codes = torch.zeros(len(names), dtype=torch.int32)
    for i in range(rank, len(names), world):
        codes[i] = store.check_file(path, names[i], manifest["files"][names[i]])
    if ctx is not None:
        codes = _max_over_ranks(codes, ctx)
    bad = [(names[i], int(c)) for i, c in enumerate(codes.tolist()) if c]
    if bad:
        first, code = bad[0]
        more = f"; {len(bad) - 1} more: {[b[0] for b in bad[1:4]]}" if len(bad) > 1 else ""
        raise CheckpointError(f"checkpoint {path}: file {first!r} is {store.PROBLEMS[code]}"
                              f"{more}; nothing was loaded")


def load_checkpoint(root, model, optimizer, ctx, *, step: int | None = None, scaler=None,
                    stateful: Mapping[str, Any] | None = None, restore_rng: bool = True) -> dict:
    """Load checkpoint ``step`` (``None``: the latest) from ``root`` into ``model`` and
    ``optimizer`` (``None``: skip its state), at this job's layout, whatever the layout it was
    saved at (collective on every rank).

    Every file is verified first; a missing, truncated or corrupted one — or a checkpoint that
    does not fit the model — raises :class:`CheckpointError` naming it, with nothing loaded.
    Restores ``scaler`` and ``stateful`` objects when given (one the checkpoint has no state for
    keeps its own, with a warning), and each rank's RNG states (a rank the saved job did not have
    gets rank 0's). Returns ``{"step", "extra", "path",
    "saved_layout", "resharded", "meta"}``.
    """
    path = store.resolve(root, step)
    manifest = store.read_manifest(path)
    verify(path, manifest, ctx)
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    tensors, adapter, targets, error = ModelTensors(model), None, {}, None
    try:
        targets = model_targets(tensors, saved)
        if optimizer is not None:
            adapter = adapter_for(optimizer)
            optim_saved = {k[len(OPTIM):]: v for k, v in saved.items() if k.startswith(OPTIM)}
            targets.update({OPTIM + k: v for k, v in
                            adapter.load_targets(optimizer, tensors, optim_saved, ctx).items()})
    except (CheckpointError, ValueError) as exc:
        error = exc
    _agree(error, ctx, "checking the checkpoint against the model", CheckpointError)
    extra_keys = unclaimed(tensors, saved, lambda flags: _max_over_ranks(flags, ctx))
    if extra_keys:
        raise CheckpointError(f"the checkpoint does not fit this model: {len(extra_keys)} of its "
                              f"tensors are in no rank's model (e.g. {extra_keys[:3]})")
    rng_key = f"{RNG}{ctx.rank}" if f"{RNG}{ctx.rank}" in saved else f"{RNG}0"
    if restore_rng and rng_key not in saved:
        raise CheckpointError(f"checkpoint {path} has no RNG states ({rng_key!r})")
    singles = {"extra": True, "scaler": scaler is not None, rng_key: restore_rng,
               **{f"stateful/{k}": True for k in (stateful or {})}}
    for key, wanted in singles.items():
        if wanted and key in saved:
            targets[key] = None
        elif wanted and key != "extra":  # e.g. a run resumed with --precision fp16
            warnings.warn(f"checkpoint {path} has no {key!r} state: that object keeps its "
                          f"current state", stacklevel=2)
    try:
        run_dcp(dcp.load, targets, _world(ctx), storage_reader=reader, planner=LoadPlanner())
    except Exception as exc:  # verified files that still do not load: report, load nothing
        raise CheckpointError(f"checkpoint {path} could not be read: {exc}") from exc
    if adapter is not None:
        adapter.commit(optimizer, tensors, {k[len(OPTIM):]: v for k, v in targets.items()
                                            if k.startswith(OPTIM)}, ctx)
    objects = {"scaler": scaler, **{f"stateful/{k}": v for k, v in (stateful or {}).items()}}
    for key, obj in objects.items():
        if obj is not None and key in targets:
            obj.load_state_dict(targets[key])
    commit_model(tensors, targets)
    if restore_rng:
        set_rng_state(targets[rng_key])
    return {"step": manifest["step"], "extra": targets.get("extra"), "path": str(path),
            "saved_layout": manifest["layout"], "resharded": manifest["layout"] != _layout(ctx),
            "meta": manifest.get("meta")}
