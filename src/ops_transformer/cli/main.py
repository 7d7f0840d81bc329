"""``ops-transformer <command>``: argument parsing and uniform error handling.

A user error (``ValueError``, also when raised on a rank) prints one clear line and exits with code
2; a rank that died or failed otherwise prints its cause in one line (exit 1; a timeout adds the
ranks' stacks); ``--debug`` shows the traceback instead. Nothing else is caught. Under ``torchrun`` only rank 0
writes to stdout, so a result (and a ``--json`` document) appears once.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from .._version import __version__
from . import calibrate, checkpoint, demo, embed, generate, plan, train
from . import bench, diagnose, memory, profile, sweep
from . import check
from ..launch.local import RankError
from ._common import error_line, one_line_warnings, quiet_unless_lead

COMMANDS = {"demo": demo, "train": train, "generate": generate, "embed": embed, "plan": plan,
            "calibrate": calibrate, "profile": profile, "diagnose": diagnose, "sweep": sweep,
            "bench": bench}
COMMANDS["memory"] = memory
COMMANDS["checkpoint"] = checkpoint
COMMANDS["check"] = check
DEBUG_HELP = "show the traceback of an error instead of one line"


def build_parser() -> argparse.ArgumentParser:
    import torch

    parser = argparse.ArgumentParser(
        prog="ops-transformer",
        description="Exact, low-overhead tensor parallelism for Transformers on PyTorch.")
    parser.add_argument("--version", action="version",
                        version=f"ops-transformer {__version__} (torch {torch.__version__})")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_parser(command)
        # also after the command; SUPPRESS keeps the value given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what resumes an interrupted run
    try:
        with quiet_unless_lead(), (contextlib.nullcontext() if args.debug
                                   else one_line_warnings(args.command)):
            return COMMANDS[args.command].run(args) or 0
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
