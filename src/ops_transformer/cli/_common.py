"""Checks and output rules shared by the commands.

- **Output locations are checked before any work**: :func:`check_out_dir` / :func:`check_out_file`
  create what is missing and prove it writable, or raise a ``ValueError`` naming the flag.
- **A result is printed once**: only the lead process (rank 0 of a ``torchrun`` job, or the process
  that launches local ranks) writes to stdout (:func:`quiet_unless_lead`); with ``--json`` stdout
  holds exactly one JSON document (:func:`print_json`); status lines go to stderr (:func:`status`).
- **A user error is one line** (:func:`error_line`), exit code 2.

Only this layer (the CLI) reads the ``torchrun`` environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from ..launch.local import DEFAULT_LAUNCH_TIMEOUT


def under_torchrun() -> bool:
    """Whether this process is a rank of a ``torchrun`` job (``RANK`` and ``WORLD_SIZE`` set)."""
    return bool(os.environ.get("WORLD_SIZE")) and bool(os.environ.get("RANK"))


def world_size() -> int:
    """The ``torchrun`` job's world size, 1 outside ``torchrun``."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1


def is_lead() -> bool:
    """Rank 0 of a ``torchrun`` job, or a process outside ``torchrun``: the one that prints."""
    return not under_torchrun() or os.environ["RANK"] == "0"


def status(message: str) -> None:
    """A progress or status line: stderr (stdout is for the result), lead process only."""
    if is_lead():
        print(message, file=sys.stderr, flush=True)


def print_json(obj) -> None:
    """The result as one JSON document on stdout."""
    print(json.dumps(obj, indent=2), flush=True)


@contextlib.contextmanager
def quiet_unless_lead():
    """Send stdout to ``os.devnull`` on every rank but the lead while the block runs."""
    if is_lead():
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


@contextlib.contextmanager
def one_line_warnings(command: str):
    """While the block runs, a Python warning prints as ``ops-transformer CMD: warning: MESSAGE``
    (one line, no source path), once per message, and only from the lead process or rank 0: local
    ranks forked by ``launch`` inherit this, so a warning every rank raises appears once."""
    seen: set[str] = set()
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        if text in seen or not is_lead():
            return
        seen.add(text)
        print(f"ops-transformer {command}: warning: {text}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def refuse_torchrun(command: str, why: str) -> None:
    """A command that starts its own local ranks cannot run as one rank of a ``torchrun`` job."""
    if under_torchrun():
        raise ValueError(f"{command} {why}: run it with plain `ops-transformer {command}`, not "
                         f"under torchrun")


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create the output directory ``path`` (and its parents) and check that files can be written
    in it; on ``torchrun`` ranks other than 0 (which write nothing) only the path is returned."""
    out = Path(path)
    if not is_lead():
        return out
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is an existing file; name a directory (it is "
                         f"created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {_reason(exc)}") from None
    _check_writable(out, flag, path)
    return out


def check_out_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check that the file ``path`` can be written (creating its parent directories): not an
    existing directory, in a writable place."""
    out = Path(path)
    if not is_lead():
        return out
    if out.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; name a file, e.g. "
                         f"{str(out / 'profile.json')!r}")
    _writable_parent(out, flag, path)
    return out


def _writable_parent(out: Path, flag: str, path) -> None:
    """Create ``out``'s parent directories and check that they can be written: one line naming
    ``flag`` otherwise."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r}: its directory cannot be created: "
                         f"{_reason(exc)}") from None
    _check_writable(out.parent, flag, path)


@contextlib.contextmanager
def replacing_output(path: str | os.PathLike, *, directory: bool, overwrite: bool = False,
                     flag: str = "--out"):
    """Write an output (a directory, or a file) that appears whole or not at all: the block
    writes to the yielded path in a temporary directory beside ``path``, which is then swapped in
    (a file by one ``os.replace``; a directory by renaming the old one aside, the new one in, and
    removing the old). An existing non-empty ``path`` is refused in one line unless
    ``overwrite``; on an error nothing of the attempt is left and ``path`` is as it was."""
    out = Path(path)
    if out.exists() and (out.is_dir() != directory):
        kind = "an existing file; name a directory" if directory else \
            f"a directory; name a file, e.g. {str(out / 'model.safetensors')!r}"
        raise ValueError(f"{flag} {str(path)!r} is {kind}")
    occupied = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if occupied and not overwrite:
        raise ValueError(f"{flag} {str(path)!r} already exists and is not empty; name a new "
                         f"{'directory' if directory else 'file'}, or pass --overwrite to "
                         f"replace it")
    created = missing_dirs(out.parent)
    _writable_parent(out, flag, path)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    target = work if directory else work / out.name
    try:
        yield target
        if not directory:
            os.replace(target, out)
        elif not out.exists() or not occupied:
            if out.exists():
                out.rmdir()
            work.rename(out)
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            out.rename(old)
            try:
                work.rename(out)
            except BaseException:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        remove_if_empty(created)
        raise
    finally:
        if not directory:
            shutil.rmtree(work, ignore_errors=True)


def missing_dirs(path: str | os.PathLike | None) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what
    :func:`check_out_dir` will create, for :func:`remove_if_empty`."""
    if not path:
        return []
    missing = []
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            break
        missing.append(p)
    return missing


def remove_if_empty(dirs: list[Path]) -> None:
    """Remove the directories of :func:`missing_dirs` that are still empty (a run that failed
    before writing leaves no empty ``runs/train-…`` behind), deepest first."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break  # not empty (or gone): keep it and its parents


def _check_writable(directory: Path, flag: str, path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r} is not writable: {_reason(exc)}") from None


def _reason(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")


def add_launch_timeout(parser, default: float = DEFAULT_LAUNCH_TIMEOUT) -> None:
    """``--launch-timeout SECONDS``: how long local ranks may run; read it with
    :func:`launch_timeout`."""
    parser.add_argument("--launch-timeout", type=float, default=default, metavar="SECONDS",
                        help=f"end the local ranks, showing their stacks, after this many "
                        f"seconds (default {default:.0f})")


def launch_timeout(args) -> float:
    value = args.launch_timeout
    if not value > 0:
        raise ValueError(f"--launch-timeout must be a positive number of seconds, got {value}")
    return value


def error_line(command: str, exc: BaseException) -> str:
    """``ops-transformer CMD: error: MESSAGE`` on one line (line breaks in the message become
    spaces)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"ops-transformer {command}: error: {text}"
