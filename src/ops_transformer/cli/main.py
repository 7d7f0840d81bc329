"""``ops-transformer <command>``: argument parsing and uniform error handling.

A user error (``ValueError``, also when raised on a rank) prints one clear line and exits with code
2; a rank that died or failed otherwise prints its cause in one line (exit 1; a timeout adds the
ranks' stacks); ``--debug`` shows the traceback instead. Nothing else is caught. Under ``torchrun`` only rank 0
writes to stdout, so a result (and a ``--json`` document) appears once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import sys

from .._version import __version__
from ..launch.local import RankError
from ._common import error_line, one_line_warnings, quiet_unless_lead

# command → (the module of its command line, the module that runs it), both under cli/: a
# command's modules are imported only when it is the one that runs (its parser module imports no
# torch: ``train --help`` and an argument error are quick); ``check_args(args)`` of the parser
# module, where there is one, runs before the run module is imported.
COMMANDS = {"demo": ("demo", "demo"), "train": ("train_args", "train"),
            "generate": ("generate", "generate"), "embed": ("embed", "embed"),
            "plan": ("plan", "plan"), "calibrate": ("calibrate", "calibrate"),
            "profile": ("profile", "profile"), "diagnose": ("diagnose", "diagnose"),
            "sweep": ("sweep", "sweep"), "bench": ("bench", "bench"),
            "memory": ("memory", "memory"), "checkpoint": ("checkpoint", "checkpoint"),
            "check": ("check", "check")}
DEBUG_HELP = "show the traceback of an error instead of one line"


def command_module(name: str, part: int = 0):
    """The module of command ``name``'s command line (``part`` 0) or of its run (1)."""
    return importlib.import_module(f"{__package__}.{COMMANDS[name][part]}")


def build_parser(commands=tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The command line of ``commands`` (default: every one) — :func:`main` builds the one
    command it runs, importing no other command's modules."""
    parser = argparse.ArgumentParser(
        prog="ops-transformer",
        description="Exact, low-overhead tensor parallelism for Transformers on PyTorch.")
    parser.add_argument("--version", action="version",
                        version=f"ops-transformer {__version__} (torch {_torch_version()})")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in commands:
        module = command_module(name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_parser(command)
        # also after the command; SUPPRESS keeps the value given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=DEBUG_HELP)
    return parser


def _torch_version() -> str:
    try:  # the installed distribution's metadata: no import of torch
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commands_of(argv: list[str]) -> tuple[str, ...]:
    """The commands whose parsers ``argv`` needs: the one it names (its first word that is not an
    option), none for ``--version`` alone, else every one (``--help``, a mistyped command)."""
    words = [a for a in argv if not a.startswith("-")]
    if words and words[0] in COMMANDS:
        return (words[0],)
    return () if not words and "--version" in argv else tuple(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(commands_of(argv)).parse_args(argv)
    args.argv = argv  # what resumes an interrupted run
    try:
        with quiet_unless_lead(), (contextlib.nullcontext() if args.debug
                                   else one_line_warnings(args.command)):
            check = getattr(command_module(args.command), "check_args", None)
            if check is not None:  # before the run's modules (and torch) are imported
                check(args)
            return command_module(args.command, 1).run(args) or 0
    except ValueError as exc:
        if args.debug:
            raise
        print(error_line(args.command, exc), file=sys.stderr)
        return 2
    except RankError as exc:  # a rank died or failed: its cause, not the launcher's traceback
        if args.debug:
            raise
        print(rank_failure(args.command, exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def rank_failure(command: str, exc: BaseException) -> str:
    """A failed rank in one line — ``[rank 1/2] rank 1 exited with code -9 (killed by signal 9,
    SIGKILL) …`` and which ranks failed after it; a timeout keeps the ranks' stacks below it."""
    text = str(exc)
    first, _, stacks = text.partition("\n--- rank ")
    notes = " ".join(getattr(exc, "__notes__", []))
    line = error_line(command, Exception(first + (f" ({notes})" if notes else "")))
    if stacks:
        return f"{line}\n--- rank {stacks}"
    return line + (" (--debug shows its traceback)" if getattr(exc, "remote_traceback", "") else "")


if __name__ == "__main__":
    sys.exit(main())
