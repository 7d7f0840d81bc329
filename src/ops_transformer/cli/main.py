"""``ops-transformer <command>``: argument parsing and uniform error handling.

A user error (``ValueError``, also when raised on a rank) prints one clear line and exits with code
2; nothing else is caught.
"""

from __future__ import annotations

import argparse
import sys

from . import calibrate, demo, embed, generate, plan, train
from . import bench, diagnose, profile, sweep

COMMANDS = {"demo": demo, "train": train, "generate": generate, "embed": embed, "plan": plan,
            "calibrate": calibrate, "profile": profile, "diagnose": diagnose, "sweep": sweep,
            "bench": bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ops-transformer",
        description="Exact, low-overhead tensor parallelism for Transformers on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.add_parser(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args) or 0
    except ValueError as exc:
        print(f"ops-transformer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
