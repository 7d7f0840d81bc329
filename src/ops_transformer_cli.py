"""The ``ops-transformer`` console script.

``ops-transformer --version`` answers from the installed packages' metadata, without importing
torch (which takes 2-9 s on a cold machine); everything else is ``ops_transformer.cli.main``.
"""

from __future__ import annotations

import sys


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    def of(name: str) -> str:
        try:
            return installed(name)
        except PackageNotFoundError:
            return "not installed"

    return f"ops-transformer {of('ops-transformer')} (torch {of('torch')})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args in (["--version"], ["-V"]):
        print(version())
        return 0
    from ops_transformer.cli.main import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
