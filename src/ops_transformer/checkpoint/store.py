"""The checkpoint directory on disk: naming, the manifest, checksums, and atomic publication.

::

    root/
      latest                  name of the last complete checkpoint ("step-00000020"), updated last
      step-00000010/          one complete checkpoint
        checkpoint.json       the manifest: step, layout, model, contents, size + SHA-256 of each file
        .metadata             DCP's global metadata: every tensor's dense shape and stored chunks
        __0_0.distcp          the chunks rank 0 wrote (DCP), one file per rank
        __1_0.distcp
      step-00000020/
      .tmp-step-00000030/     a save in progress; never read, removed by the next save

A checkpoint directory becomes visible only by the rename of its ``.tmp-`` directory, after every
file in it (manifest last) was written and fsynced; ``latest`` is replaced (write, fsync, rename)
only after that. Old checkpoints are first renamed to ``.deleting-…`` and then removed, so a crash
at any point leaves every visible ``step-`` directory complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from .errors import CheckpointError, DamagedCheckpointError

MANIFEST = "checkpoint.json"
LATEST = "latest"
FORMAT = "ops-transformer/checkpoint"
VERSION = 1
TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".deleting-"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_HASH_BLOCK = 1 << 20


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def list_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (those with a manifest), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [parse_step(p.name) for p in root.iterdir() if (p / MANIFEST).is_file()]
    return sorted(s for s in steps if s is not None)


def latest_step(root: str | Path) -> int | None:
    """The step ``root/latest`` names, or the newest complete checkpoint if ``latest`` is missing
    or names one that is gone; ``None`` when there is no checkpoint."""
    root = Path(root)
    try:
        step = parse_step((root / LATEST).read_text().strip())
    except OSError:
        step = None
    if step is not None and (root / step_dirname(step) / MANIFEST).is_file():
        return step
    steps = list_steps(root)
    return steps[-1] if steps else None


def resolve(root: str | Path, step: int | None) -> Path:
    """The directory of checkpoint ``step`` (``None``: the latest) under ``root``."""
    root = Path(root)
    if step is None:
        step = latest_step(root)
        if step is None:
            where = "does not exist" if not root.exists() else "holds no complete checkpoint"
            raise CheckpointError(f"no checkpoint to load: {str(root)!r} {where}")
    path = root / step_dirname(step)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint for step {step} in {str(root)!r}; available steps: "
                              f"{list_steps(root) or 'none'}")
    return path


def file_record(path: Path) -> dict:
    """``{"size", "sha256"}`` of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


PROBLEMS = {1: "missing", 2: "truncated or extended (its size differs from the manifest's)",
            3: "corrupted (its SHA-256 differs from the manifest's)"}


def check_file(directory: Path, name: str, record: dict) -> int:
    """0 when ``directory/name`` matches its manifest record, else a key of :data:`PROBLEMS`."""
    path = directory / name
    if not path.is_file():
        return 1
    if path.stat().st_size != record["size"]:
        return 2
    return 3 if file_record(path)["sha256"] != record["sha256"] else 0


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path, body: dict) -> None:
    """The manifest, with the SHA-256 of its own body, written and fsynced."""
    text = json.dumps({"manifest": body, "sha256": _digest(body)}, indent=1, sort_keys=True)
    write_durably(directory / MANIFEST, text + "\n")


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text())
        body = data["manifest"]
        intact = data["sha256"] == _digest(body)
    except FileNotFoundError:
        raise DamagedCheckpointError(f"{path}: missing (not a complete checkpoint)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable manifest ({type(exc).__name__}: {exc})") from None
    if not intact:
        raise DamagedCheckpointError(f"{path}: corrupted (its SHA-256 differs from the one it records)")
    if body.get("format") != FORMAT or body.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: not an ops-transformer checkpoint of a known version "
                              f"(format {body.get('format')!r}, version {body.get('version')!r})")
    return body


def write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, root: Path, name: str) -> Path:
    """Make ``tmp`` visible as ``root/name`` (one rename), then point ``latest`` at it."""
    final = root / name
    fsync_dir(tmp)
    if final.exists():  # the same step saved again: move the old one out of the way first
        trash = root / f"{TRASH_PREFIX}{name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    latest_tmp = root / f"{TMP_PREFIX}{LATEST}"
    write_durably(latest_tmp, name + "\n")
    os.replace(latest_tmp, root / LATEST)
    fsync_dir(root)
    return final


def prune(root: Path, keep: int | None, current: int) -> list[int]:
    """Delete complete checkpoints older than the ``keep`` newest (never ``current``)."""
    if keep is None:
        return []
    doomed = [s for s in list_steps(root)[:-keep] if s != current]
    for step in doomed:
        name = step_dirname(step)
        trash = root / f"{TRASH_PREFIX}{name}"
        os.rename(root / name, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def clean_stale(root: Path) -> None:
    """Remove what interrupted saves and deletions left behind."""
    for p in root.iterdir():
        if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
