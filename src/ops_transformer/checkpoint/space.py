"""Disk space for checkpoints and outputs: what is free, what a save needs, and whether a failed
write was a full disk (``ENOSPC`` arrives as an ``OSError``, or from torch's zip writer as a
``RuntimeError`` "unexpected pos …", which never says so)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from .errors import NoSpaceError

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("no space left on device", "disk quota exceeded", "unexpected pos")


def existing_parent(path: str | os.PathLike) -> Path:
    """``path`` or its nearest ancestor that exists (where the files will land)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def device_of(path: str | os.PathLike) -> str:
    """The mount point of the file system holding ``path``."""
    path = existing_parent(path).resolve()
    while not os.path.ismount(path) and path.parent != path:
        path = path.parent
    return str(path)


def free_bytes(path: str | os.PathLike) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def megabytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 10 * 2**20 else f"{n / 2**20:,.0f} MiB"


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from, or one a DCP ``CheckpointException``
    carries for some rank) is a full disk or an exceeded quota."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, NoSpaceError):
            return True
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if isinstance(e, (OSError, RuntimeError)) and any(t in str(e).lower() for t in _FULL_TEXT):
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        stack += [e.__cause__, e.__context__]
    return False


def no_space(where: str | os.PathLike, what: str, needed: float | None,
             free: float | None = None, consequence: str = "",
             place: str | os.PathLike | None = None) -> NoSpaceError:
    """``no space left on DEVICE while WHAT (needs ~X MB); Y MB free in PLACE; CONSEQUENCE``."""
    text = f"no space left on {device_of(where)} while {what}"
    if needed:
        text += f" (needs ~{megabytes(needed)})"
    if free is not None:
        text += f"; {megabytes(free)} free" + (f" in {place}" if place else "")
    elif place:
        text += f" in {place}"
    return NoSpaceError(text + consequence)


def check_free(where: str | os.PathLike, needed: float, what: str, consequence: str = "",
               place: str | os.PathLike | None = None) -> None:
    """A :class:`NoSpaceError` when the file system of ``where`` has less than ``needed`` bytes
    free."""
    free = free_bytes(where)
    if free < needed:
        raise no_space(where, what, needed, free, consequence, place)
