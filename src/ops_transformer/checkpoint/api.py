"""``load_checkpoint`` (and ``save_checkpoint``, :mod:`.writer`): sharded, atomic, verified,
reshardable.

Both are collective: every rank of the job calls them with its own model (and optimizer). Each rank
writes only the chunks it holds, through ``torch.distributed.checkpoint``; rank 0 publishes the
checkpoint (:mod:`.store`) once every rank's files are written and hashed. Loading verifies every
file against the manifest (the ranks share the hashing) and reads into fresh buffers; only when
everything has been read are the model, optimizer, scaler and RNG states replaced.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm import collectives as C
from . import store
from .chunked import LoadPlanner
from .contents import (OPTIM, RNG, ModelTensors, check_lora, commit_model, model_targets,
                       unclaimed)
from .errors import CheckpointError, DamagedCheckpointError
from .optim import adapter_for
from .reader import SafeReader, rank_failures
from .rng import set_rng_state


def world_group(ctx):
    return dist.group.WORLD if ctx.world_size > 1 else None


def run_dcp(fn, state: dict, group, **kwargs):
    """``dcp.save`` or ``dcp.load`` over ``group`` (``None``: this process alone, without the
    warning DCP prints for that case)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(state, process_group=group, no_dist=group is None, **kwargs)


def max_over_ranks(tensor: torch.Tensor, ctx) -> torch.Tensor:
    tensor = tensor.to(ctx.device)
    C.all_reduce(tensor, world_group(ctx), op=C.ReduceOp.MAX, label="checkpoint")
    return tensor.cpu()


def agree(error: BaseException | None, ctx, what: str, cls=RuntimeError) -> None:
    """Raise on every rank when ``error`` happened on any (no rank is left waiting): the failing
    rank raises ``error``; the others a ``CheckpointError`` of the same type and message when it is
    one (a full disk, a checkpoint that does not fit), else ``cls`` naming the rank and the cause."""
    flag = int(max_over_ranks(torch.tensor([ctx.rank + 1 if error is not None else 0]), ctx))
    if not flag:
        return
    src = flag - 1
    mine = ((type(error) if isinstance(error, CheckpointError) else None,
             " ".join(str(error).split()) or type(error).__name__) if ctx.rank == src else None)
    kind, message = C.broadcast_object(mine, src, world_group(ctx), label="checkpoint")
    if error is not None:
        raise error
    if kind is not None:
        raise kind(message)
    raise cls(f"{what} failed on rank {src}: {message}")


def job_layout(ctx) -> dict:
    """The degrees a checkpoint records (``cp`` only when the sequence was split, ``pp`` only
    when the layers were: the tensors are in dense coordinates, so any layout reads them)."""
    cp, pp = getattr(ctx, "cp_size", 1), getattr(ctx, "pp_size", 1)
    return {"world_size": ctx.world_size, "dp": ctx.dp_size, "tp": ctx.tp_size, "ep": ctx.ep_size,
            **({"cp": cp} if cp > 1 else {}), **({"pp": pp} if pp > 1 else {})}


def read_failure(path: Path, exc: BaseException) -> CheckpointError:
    """The one-line error of a DCP read that failed: the first rank's :class:`CheckpointError`
    (it names the file), else the first failure's type and first line."""
    failures = rank_failures(exc) or [(None, exc)]
    for _, failure in failures:
        if isinstance(failure, CheckpointError):
            return failure
    rank, first = failures[0]
    where = f" on rank {rank}" if rank is not None else ""
    text = str(first).splitlines()[0] if str(first) else ""
    return DamagedCheckpointError(f"checkpoint {path} could not be read{where}: "
                           f"{type(first).__name__}: {text}")


def verify(path: Path, manifest: dict, ctx=None) -> None:
    """Check every file of the checkpoint at ``path`` against its manifest, the ranks of ``ctx``
    sharing the work; a :class:`CheckpointError` naming the first bad file on every rank."""
    names = sorted(manifest["files"])
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    codes = torch.zeros(len(names), dtype=torch.int32)
    for i in range(rank, len(names), world):
        codes[i] = store.check_file(path, names[i], manifest["files"][names[i]])
    if ctx is not None:
        codes = max_over_ranks(codes, ctx)
    bad = [(names[i], int(c)) for i, c in enumerate(codes.tolist()) if c]
    if bad:
        first, code = bad[0]
        more = f"; {len(bad) - 1} more: {[b[0] for b in bad[1:4]]}" if len(bad) > 1 else ""
        raise DamagedCheckpointError(f"checkpoint {path}: file {first!r} is {store.PROBLEMS[code]}"
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
    "saved_layout", "resharded", "meta"}`` (``meta``: what the save's ``meta=`` wrote into the
    manifest, ``None`` without it).
    """
    path = store.resolve(root, step)
    manifest = store.read_manifest(path)
    verify(path, manifest, ctx)
    reader = SafeReader(path)  # no pickle of the checkpoint may run code (reader.py)
    saved = reader.read_metadata().state_dict_metadata
    tensors, adapter, targets, error = ModelTensors(model), None, {}, None
    try:
        check_lora(manifest["model"], model, path)
        targets = model_targets(tensors, saved)
        if optimizer is not None:
            adapter = adapter_for(optimizer)
            optim_saved = {k[len(OPTIM):]: v for k, v in saved.items() if k.startswith(OPTIM)}
            targets.update({OPTIM + k: v for k, v in
                            adapter.load_targets(optimizer, tensors, optim_saved, ctx).items()})
    except (CheckpointError, ValueError) as exc:
        error = exc
    agree(error, ctx, "checking the checkpoint against the model", CheckpointError)
    extra_keys = unclaimed(tensors, saved, lambda flags: max_over_ranks(flags, ctx))
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
        run_dcp(dcp.load, targets, world_group(ctx), storage_reader=reader, planner=LoadPlanner())
    except (Exception, CheckpointException) as exc:  # verified files that still do not
        raise read_failure(path, exc) from None                # load: report, load nothing
    if adapter is not None:
        adapter.commit(optimizer, tensors, {k[len(OPTIM):]: v for k, v in targets.items()
                                            if k.startswith(OPTIM)}, ctx)
    objects = {"scaler": scaler, **{f"stateful/{k}": v for k, v in (stateful or {}).items()}}
    for key, obj in objects.items():
        if obj is not None and key in targets:
            obj.load_state_dict(targets[key])
    commit_model(tensors, targets)
    if restore_rng:
        set_rng_state(targets[rng_key], ctx.device)
    return {"step": manifest["step"], "extra": targets.get("extra"), "path": str(path),
            "saved_layout": manifest["layout"], "resharded": manifest["layout"] != job_layout(ctx),
            "meta": manifest.get("meta")}
